"""DiLoCo's outer step: the global weights, the averaged pseudo-gradient, and the outer optimizer.

Between syncs every node trains its own copy of the model with the LightningModule's optimizer (the *inner*
steps); the nodes do not talk. At a sync each rank takes, for its shard of every parameter, the
*pseudo-gradient* ``global - local`` (how far its node moved since the last sync, with the sign of a gradient),
averages it with the ranks holding the same shard on the other nodes (one all-reduce over the replicate group),
and lets an outer optimizer, Nesterov SGD (Douillard et al. 2023, DiLoCo: learning rate 0.7, momentum 0.9),
apply it to the global weights; every node then continues from the new global weights.

With an outer learning rate of 1 and no momentum the new global weights are the mean of the nodes' local
weights: plain model averaging; with one inner step between syncs that is synchronous data parallelism over
the inner optimizer's updates (``tests/test_local_steps.py``).

The global weights and the momentum are fp32 whatever the parameters' dtype; the pseudo-gradient may travel as
bf16 (``comm_dtype``), halving the bytes of a sync. A sync whose average is not finite on some rank changes no
global weight (the decision is agreed over every rank) and every node restarts from the global weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dalle_lightning_plugins.comm_dtype import from_comm, resolve_comm_dtype, to_comm


class OuterStep:
    """The outer state of one rank (its shards' global weights, the outer optimizer) and the sync itself.

    Args:
        lr, momentum, nesterov: the outer SGD's settings.
        comm_dtype: the pseudo-gradient's wire dtype (float32 or bfloat16/float16, clamped to stay finite).
    """

    def __init__(self, lr: float, momentum: float, nesterov: bool, comm_dtype: torch.dtype | str) -> None:
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.comm_dtype = resolve_comm_dtype(comm_dtype)
        self.names: list[str] = []
        self.global_weights: list[torch.Tensor] = []
        self.optimizer: torch.optim.SGD | None = None
        self.updates_since_sync = 0  # inner updates since the last sync (the position in the cycle)
        self.syncs = 0
        self.skipped_syncs = 0
        self.bytes_sent = 0  # by this rank, over every sync of this fit

    def start(self, named_shards: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The global weights are the local shards as they are now (every node holds the same at a fit's start)."""
        self.names = [n for n, _ in named_shards]
        self.global_weights = [t.detach().float().clone() for _, t in named_shards]
        self.optimizer = torch.optim.SGD(self.global_weights, lr=self.lr, momentum=self.momentum,
                                         nesterov=self.nesterov and self.momentum > 0)
        self.updates_since_sync = self.syncs = self.skipped_syncs = self.bytes_sent = 0

    @torch.no_grad()
    def sync(self, shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None, replicas: int,
             flag_group: dist.ProcessGroup | None = None) -> bool:
        """Average the pseudo-gradient over ``group`` (``replicas`` ranks), step the global weights, reset the local
        shards to them. ``flag_group``: where the finite decision is agreed (None: every rank). False: skipped."""
        assert self.optimizer is not None, "OuterStep.sync() before start()"
        if len(shards) != len(self.global_weights):
            raise ValueError(f"{len(shards)} parameter shards, the outer state holds {len(self.global_weights)}")
        flat = torch.cat([(g - s.detach().float()).reshape(-1) for g, s in zip(self.global_weights, shards)])
        if replicas > 1:
            wire = flat if self.comm_dtype == torch.float32 else to_comm(flat / replicas, self.comm_dtype, replicas)
            dist.all_reduce(wire, group=group)
            flat = wire.div_(replicas) if self.comm_dtype == torch.float32 else from_comm(wire)
            self.bytes_sent += wire.numel() * wire.element_size()
        bad = (~torch.isfinite(flat).all()).to(torch.uint8).reshape(1)
        if dist.is_initialized() and dist.get_world_size(flag_group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=flag_group)
        finite = not bool(bad.item())
        if finite:
            for g, chunk in zip(self.global_weights, flat.split([g.numel() for g in self.global_weights])):
                g.grad = chunk.view(g.shape)
            self.optimizer.step()
            for g in self.global_weights:
                g.grad = None
            self.syncs += 1
        else:
            self.skipped_syncs += 1
        for g, s in zip(self.global_weights, shards):
            s.copy_(g)
        self.updates_since_sync = 0
        return finite

    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None
        return {"global": {n: g.clone() for n, g in zip(self.names, self.global_weights)},
                "optimizer": self.optimizer.state_dict(), "updates_since_sync": self.updates_since_sync,
                "syncs": self.syncs, "skipped_syncs": self.skipped_syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [n for n in self.names if n not in state["global"]]
        if missing or len(state["global"]) != len(self.names):
            raise ValueError(f"the checkpoint's outer state holds {sorted(state['global'])[:3]}..., this model "
                             f"{self.names[:3]}... ({len(missing)} missing): not the same model or mesh")
        with torch.no_grad():
            for n, g in zip(self.names, self.global_weights):
                g.copy_(state["global"][n])
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates_since_sync = int(state["updates_since_sync"])
        self.syncs, self.skipped_syncs = int(state["syncs"]), int(state["skipped_syncs"])
