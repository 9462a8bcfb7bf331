"""DiLoCo's outer step: the global weights, the averaged pseudo-gradient, and the outer optimizer.

Between syncs every node trains its own copy of the model with the LightningModule's optimizer (the *inner*
steps); the nodes do not talk. At a sync each rank takes, for its shard of every parameter, the
*pseudo-gradient* ``global - local`` (how far its node moved since the last sync, with the sign of a gradient),
averages it with the ranks holding the same shard on the other nodes (one collective over the replicate group),
and lets an outer optimizer, Nesterov SGD (Douillard et al. 2023, DiLoCo: learning rate 0.7, momentum 0.9),
apply it to the global weights; every node then continues from the new global weights.

With an outer learning rate of 1 and no momentum the new global weights are the mean of the nodes' local
weights: plain model averaging; with one inner step between syncs that is synchronous data parallelism over
the inner optimizer's updates (``tests/test_local_steps.py``).

Streaming (Douillard et al. 2025, Streaming DiLoCo): the parameters may be split into ``fragments`` synced in
turn, fragment ``f`` first after ``round((f + 1) * H / F)`` updates and then every ``H``, so the link carries
1/F of the model at a time; and a sync may overlap ``delay`` inner updates: the pseudo-gradient is put on the
wire at update ``u`` and its mean applied at update ``u + delay``, where the fragment's local weights become
``global + (local - local_at_send)`` with ``keep_overlapped`` (the default: the ``delay`` updates each node made
while the sync was on the wire are kept, on top of the new global weights, and go into its next pseudo-gradient),
or ``global`` without; and ``local_mix`` of the node's own weights is kept besides (Streaming DiLoCo's mixing:
``local_mix * local + (1 - local_mix) * target``). With one fragment, no delay and ``local_mix = 0`` this is
DiLoCo exactly.

The global weights and the momentum are fp32 whatever the parameters' dtype; the pseudo-gradient may travel as
bf16 or int8 (``comm_dtype``, :mod:`dalle_lightning_plugins.compression.outer_wire`), halving or quartering the bytes. A
sync whose average is not finite on some rank changes no global weight (the decision is agreed over every rank)
and every node restarts from the fragment's global weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dalle_lightning_plugins.compression.outer_wire import InFlight, resolve_outer_wire, start_average


@dataclass
class Pending:
    """A fragment's sync on the wire (``flight``) or already averaged (``mean``), applied after ``due`` updates."""

    fragment: int
    due: int
    flight: InFlight | None = None
    mean: torch.Tensor | None = None
    own: torch.Tensor | None = None  # this rank's pseudo-gradient at the send (``keep_overlapped``, delay > 0)

    def result(self) -> torch.Tensor:
        if self.mean is None:
            assert self.flight is not None
            self.mean, self.flight = self.flight.wait(), None
        return self.mean


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameter indices per fragment: each parameter, in order, to the fragment holding fewest elements so far
    (balanced bytes, neighbouring layers mostly in different fragments, as Streaming DiLoCo's strided split)."""
    if fragments > len(sizes):
        raise ValueError(f"fragments={fragments}, expected at most the {len(sizes)} trained parameter tensors")
    out: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    for i, size in enumerate(sizes):
        f = min(range(fragments), key=lambda k: (load[k], k))
        out[f].append(i)
        load[f] += size
    return out


class OuterStep:
    """The outer state of one rank (its shards' global weights, the outer optimizer, the fragments' schedule and
    the syncs on the wire) and the syncs themselves.

    Args:
        lr, momentum, nesterov: the outer SGD's settings.
        comm_dtype: the pseudo-gradient's wire: float32, bfloat16 / float16 (clamped to stay finite) or int8.
        sync_every: updates between two syncs of one fragment (H).
        fragments: parameter fragments synced in turn (1: the whole model at once).
        delay: inner updates a sync overlaps (0: the sync blocks the update that starts it).
        local_mix: the local weights' share when a sync lands (0: every node takes the global weights).
        keep_overlapped: when a delayed sync lands, add each node's updates since the send to the global weights
            (False: they are dropped, as Streaming DiLoCo's merge at ``local_mix = 0``).
    """

    def __init__(self, lr: float, momentum: float, nesterov: bool, comm_dtype: torch.dtype | str,
                 sync_every: int = 1, fragments: int = 1, delay: int = 0, local_mix: float = 0.0,
                 keep_overlapped: bool = True) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.comm_dtype = resolve_outer_wire(comm_dtype)
        self.sync_every, self.fragments, self.delay, self.local_mix = sync_every, fragments, delay, local_mix
        self.keep_overlapped = keep_overlapped
        self.names: list[str] = []
        self.global_weights: list[torch.Tensor] = []
        self.parts: list[list[int]] = []
        self.optimizer: torch.optim.SGD | None = None
        self.since: list[int] = []  # per fragment: updates since its last send (the position in the cycle)
        self.pending: list[Pending] = []
        self.syncs = 0
        self.skipped_syncs = 0
        self.bytes_sent = 0  # by this rank, over every sync of this fit
        self.blocked_s = 0.0  # seconds the updates waited on syncs (sending, waiting, applying)

    @property
    def updates_since_sync(self) -> int:
        """Updates since the last send of any fragment."""
        return min(self.since) if self.since else 0

    def start(self, named_shards: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The global weights are the local shards as they are now (every node holds the same at a fit's start)."""
        self.names = [n for n, _ in named_shards]
        self.global_weights = [t.detach().float().clone() for _, t in named_shards]
        self.parts = split_fragments([t.numel() for t in self.global_weights], self.fragments)
        self.optimizer = torch.optim.SGD(self.global_weights, lr=self.lr, momentum=self.momentum,
                                         nesterov=self.nesterov and self.momentum > 0)
        h, f = self.sync_every, self.fragments
        self.since = [h - round((k + 1) * h / f) for k in range(f)]  # staggered: fragment k first after (k+1)H/F
        self.pending = []
        self.syncs = self.skipped_syncs = self.bytes_sent = 0
        self.blocked_s = 0.0

    @torch.no_grad()
    def after_update(self, shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: int) -> int:
        """Count one inner update; apply the syncs due now, then send the fragments due now (collective).
        Returns how many syncs landed."""
        start, landed = time.perf_counter(), self.syncs + self.skipped_syncs
        self.since = [s + 1 for s in self.since]
        for p in self.pending:
            p.due -= 1
        self._land_due(shards)
        for k in [k for k, s in enumerate(self.since) if s >= self.sync_every]:
            self._send(k, shards, group, replicas, self.delay)
        self._land_due(shards)  # delay 0: the send's own result
        self.blocked_s += time.perf_counter() - start
        return self.syncs + self.skipped_syncs - landed

    @torch.no_grad()
    def finish(self, shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: int) -> bool:
        """The end of a fit: apply what is on the wire, then sync every fragment that moved since its last send
        and give every node the global weights. False: nothing was left to do."""
        if not self.pending and not any(self.since):
            return False
        start = time.perf_counter()
        for p in self.pending:
            p.due = 0
        self._land_due(shards)
        for k in [k for k, s in enumerate(self.since) if s > 0]:
            self._send(k, shards, group, replicas, 0)
        self._land_due(shards, mix=0.0)
        for k in range(self.fragments):  # landed earlier with local_mix > 0: the global weights everywhere now
            for i in self.parts[k]:
                shards[i].copy_(self.global_weights[i])
        self.blocked_s += time.perf_counter() - start
        return True

    def _send(self, k: int, shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: int,
              delay: int) -> None:
        if len(shards) != len(self.global_weights):
            raise ValueError(f"{len(shards)} parameter shards, the outer state holds {len(self.global_weights)}")
        idx = self.parts[k]
        flat = torch.cat([(self.global_weights[i] - shards[i].detach().float()).reshape(-1) for i in idx])
        own = flat.clone() if self.keep_overlapped and delay > 0 else None  # an fp32 wire is reduced in place
        flight = start_average(flat, self.comm_dtype, group, replicas)
        self.bytes_sent += flight.bytes
        self.pending.append(Pending(k, delay, flight=flight, own=own))
        self.since[k] = 0

    def _land_due(self, shards: Sequence[torch.Tensor], mix: float | None = None) -> None:
        due = [p for p in self.pending if p.due <= 0]
        self.pending = [p for p in self.pending if p.due > 0]
        for p in due:  # in send order: every rank lands the same syncs in the same order
            self._land(p, shards, self.local_mix if mix is None else mix)

    def _land(self, p: Pending, shards: Sequence[torch.Tensor], mix: float) -> None:
        mean = p.result()
        bad = (~torch.isfinite(mean).all()).to(torch.uint8).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank: all shards step, or none
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        idx = self.parts[p.fragment]
        finite = not bool(bad.item())
        before = [self.global_weights[i].clone() for i in idx] if finite and p.own is not None else None
        if finite:
            for i, chunk in zip(idx, mean.split([self.global_weights[i].numel() for i in idx])):
                self.global_weights[i].grad = chunk.view(self.global_weights[i].shape)
            assert self.optimizer is not None
            self.optimizer.step()  # SGD skips parameters without a gradient: only this fragment moves
            for i in idx:
                self.global_weights[i].grad = None
            self.syncs += 1
        else:
            self.skipped_syncs += 1
        if before is not None:  # local_at_send = before - own: the target is global + (local - local_at_send)
            own = p.own.split([self.global_weights[i].numel() for i in idx])
            for i, old, mine in zip(idx, before, own):
                step = self.global_weights[i] - old + mine.view(old.shape)
                shards[i].add_(step.to(shards[i].dtype), alpha=1.0 - mix)
            return
        for i in idx:
            if finite and mix > 0:
                shards[i].lerp_(self.global_weights[i].to(shards[i].dtype), 1.0 - mix)
            else:
                shards[i].copy_(self.global_weights[i])

    def state_dict(self) -> dict[str, Any]:
        """The outer state; a sync still on the wire is waited for (its mean does not depend on when)."""
        assert self.optimizer is not None
        return {"global": {n: g.clone() for n, g in zip(self.names, self.global_weights)},
                "optimizer": self.optimizer.state_dict(), "since": list(self.since),
                "pending": [{"fragment": p.fragment, "due": p.due, "mean": p.result().clone(), "own": p.own}
                            for p in self.pending],
                "syncs": self.syncs, "skipped_syncs": self.skipped_syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.names if n not in state["global"]]
        if missing or len(state["global"]) != len(self.names):
            raise ValueError(f"the checkpoint's outer state holds {sorted(state['global'])[:3]}..., this model "
                             f"{self.names[:3]}... ({len(missing)} missing): not the same model or mesh")
        since = state.get("since", [state.get("updates_since_sync", 0)])
        if len(since) != self.fragments:
            raise ValueError(f"the checkpoint's outer state has {len(since)} fragments, this run fragments="
                             f"{self.fragments}: resume with the same strategy.fragments")
        with torch.no_grad():
            for n, g in zip(self.names, self.global_weights):
                g.copy_(state["global"][n])
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])
        self.since = [int(s) for s in since]
        device = self.global_weights[0].device if self.global_weights else None  # a checkpoint's tensors are on CPU
        self.pending = [Pending(int(p["fragment"]), int(p["due"]), mean=p["mean"].to(device),
                                own=None if p.get("own") is None else p["own"].to(device))
                        for p in state.get("pending", [])]
        self.syncs, self.skipped_syncs = int(state["syncs"]), int(state["skipped_syncs"])
