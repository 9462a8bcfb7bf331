"""Nodes that talk every ``sync_every`` updates (DiLoCo), with FSDP2 within each node: a sibling strategy.

PowerSGD crosses a slow link every update with fewer bytes; DiLoCo (Douillard et al. 2023) crosses it every H
updates with the whole model's change since the last crossing, and an outer optimizer turns that change into the
next global weights (:mod:`dalle_lightning_plugins.compression.outer_step`). :class:`LocalStepsStrategy` is
:class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy` with the exchange between nodes moved
from every backward to every ``sync_every``-th optimizer step: the mesh, FSDP2 within a node, the checkpoints,
the failure messages and the skip of a non-finite update are the same code. It is a subclass, not an option,
because none of PowerSGD's settings applies to it (its constructor takes none of them) and its state, the global
weights and the outer momentum, is its own.

Per update: the forward and backward as under the parent; FSDP2's reduce-scatter averages gradients within the
node (nothing at one device per node), a non-finite gradient anywhere in the node skips the node's update (one
flag all-reduce within the node), and the LightningModule's optimizer steps. Every ``sync_every`` updates, and
once more at the end of a fit that stops between syncs, the outer step runs over every rank.

What it does as a Lightning user expects:

- the checkpoint holds, per rank, the local weights and the inner optimizer's state (they differ between
  nodes), the global weights, the outer momentum and the position in the cycle: a run resumed mid-cycle
  continues exactly as if never stopped; its model is node 0's local weights, as the parent writes it;
- a fit ends with a sync, so the model a fit leaves (and saves) is the global model, whatever ``max_steps``;
- validation between syncs sees each node's own weights (the reported loss is the mean over ranks); at a sync
  point, and after a fit, every node holds the global weights;
- ``trainer.fit`` again, or a new Trainer, starts a new cycle from the weights the model then has;
- gradient accumulation: updates are counted, not micro-batches;
- one optimizer: with several a sync would fall between them (an error says so).

Metrics: ``local_steps/updates_since_sync``, ``local_steps/inter_node_bytes_per_update`` (this rank's bytes over
every sync of the fit divided by the updates), ``local_steps/syncs``, ``local_steps/skipped_syncs``,
``local_steps/sync_ms`` (the updates' wall time spent in syncs, per sync: sending, waiting for the other nodes,
applying; with ``sync_delay`` the wire time hidden behind inner updates is not in it).

Streaming: ``fragments``, ``sync_delay`` and ``local_mix`` (:mod:`dalle_lightning_plugins.compression.outer_step`) sync the
model in parts, each overlapping inner updates. Then replicas never all agree between syncs, but the global
copy does on every rank holding the same shard; the fit's last sync gives every node the global weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from dalle_lightning_plugins.strategies import broadcasts
from dalle_lightning_plugins.compression.exchange import ExchangeError, average_whole
from dalle_lightning_plugins.strategies.mesh import local_shard
from dalle_lightning_plugins.compression.outer_step import OuterStep
from dalle_lightning_plugins.environments.peer_loss import PeerLost, lost_peer
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from dalle_lightning_plugins.compression.step_flags import agree_step_flags, finite_per_tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

STRATEGY_NAME = "local_steps"
OUTER_KEY = "local_steps"  # the outer state inside each rank's strategy state in a checkpoint


class LocalStepsStrategy(ShardedPowerSGDStrategy):
    """FSDP2 within each node, the nodes synchronised every ``sync_every`` updates by DiLoCo's outer step.

    Args:
        devices_per_node, block_classes, block_patterns, reshard_after_forward, prefetch_depth,
            activation_checkpointing, param_dtype, reduce_dtype, process_group_backend, timeout,
            checkpoint_format: as :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy`.
        sync_every: inner updates between two syncs of the nodes (DiLoCo's H).
        outer_lr, outer_momentum, outer_nesterov: the outer SGD. DiLoCo's 0.7 and 0.9 (Nesterov) were tuned at
            H = 500 on language models; on the demo prior at H = 10 momentum 0.9 lands 19% above ``ddp``'s loss
            after 400 updates and 0.5 3% above (docs/results.md, "nodes that talk every H updates").
        outer_comm_dtype: wire of the pseudo-gradient: float32, bfloat16 / float16 (half the bytes) or int8 (a
            quarter, all-gathered: :mod:`dalle_lightning_plugins.compression.outer_wire`). int8, with ``sync_delay=1``, is the
            default: on the demo prior it lands within 2.5% of ``ddp``'s loss and reaches it fastest over 50 and
            200 Mbit/s (docs/results.md, "Streaming").
        fragments: parameter fragments synced in turn, staggered over the ``sync_every`` updates (Streaming
            DiLoCo); 1: the whole model at each sync.
        sync_delay: inner updates a sync overlaps: the pseudo-gradient leaves at one update and its mean is
            applied ``sync_delay`` updates later (0: the update that starts a sync waits for it: DiLoCo).
        local_mix: when a sync lands, a node's weights become ``local_mix * local + (1 - local_mix) * global``
            (Streaming DiLoCo's mixing; 0: the global weights, DiLoCo). The fit's last sync always ends at 0.
        keep_overlapped: when a delayed sync lands, keep the node's ``sync_delay`` updates made meanwhile on top of
            the new global weights (False: drop them).
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        devices_per_node: int | None = None,
        *,
        sync_every: int = 10,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.5,
        outer_nesterov: bool = True,
        outer_comm_dtype: torch.dtype | str = torch.int8,
        fragments: int = 1,
        sync_delay: int = 1,
        local_mix: float = 0.0,
        keep_overlapped: bool = True,
        block_classes: Sequence[type[nn.Module] | str] | None = None,
        block_patterns: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        prefetch_depth: int = 1,
        activation_checkpointing: bool = False,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(minutes=30),
        checkpoint_format: str = "full",
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}, expected a positive number of updates between syncs")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr={outer_lr!r}, expected a positive outer learning rate (DiLoCo: 0.7)")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum={outer_momentum!r}, expected a momentum in [0, 1) (DiLoCo's: 0.9)")
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= sync_every:
            raise ValueError(f"fragments={fragments!r}, expected 1 to sync_every={sync_every} fragments (each "
                             "fragment syncs at its own update of the cycle)")
        if isinstance(sync_delay, bool) or not isinstance(sync_delay, int) or not 0 <= sync_delay <= sync_every:
            raise ValueError(f"sync_delay={sync_delay!r}, expected 0 to sync_every={sync_every} updates (a sync "
                             "must land before its fragment's next one leaves)")
        if not 0 <= local_mix < 1:
            raise ValueError(f"local_mix={local_mix!r}, expected the local weights' share in [0, 1)")
        super().__init__(
            devices_per_node, block_classes=block_classes, block_patterns=block_patterns,
            reshard_after_forward=reshard_after_forward, prefetch_depth=prefetch_depth,
            activation_checkpointing=activation_checkpointing, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            overlap=False, process_group_backend=process_group_backend, timeout=timeout,
            checkpoint_format=checkpoint_format)
        self.sync_every = sync_every
        self.outer = OuterStep(outer_lr, outer_momentum, outer_nesterov, outer_comm_dtype, sync_every=sync_every,
                               fragments=fragments, delay=sync_delay, local_mix=local_mix,
                               keep_overlapped=keep_overlapped)
        self._started = False  # the outer state holds this fit's global weights
        self._updates = 0  # this fit's updates, for the bytes per update

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if len(self.optimizers) > 1:
                raise ValueError(f"{type(self).__name__} takes one optimizer, got {len(self.optimizers)}: a sync "
                                 "would fall between their steps; use ShardedPowerSGDStrategy")
            self._started = False  # a new cycle from the weights the first update finds (resumed, or not)

    def _named_shards(self) -> list[tuple[str, torch.Tensor]]:
        assert self.lightning_module is not None
        return [(n, local_shard(p)) for n, p in self.lightning_module.named_parameters() if p.requires_grad]

    def _start_cycle(self) -> None:
        self.outer.start(self._named_shards())
        self._started, self._updates = True, 0

    # ------------------------------------------------------------------ the step

    @override
    def reduce_gradients(self) -> bool:
        """Within the node only: FSDP2 has averaged the shards; agree on the skip decision and on unused
        parameters over the node, and average the parameters FSDP2 left whole over the node."""
        module = self.lightning_module
        assert module is not None
        shard = self.device_mesh["shard"]
        group = shard.get_group() if shard.size() > 1 else None
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
        whole = [p for p in params if not hasattr(p, "to_local")]
        if group is None:  # one device per node: the node's decision is this rank's own, no collective
            finite = bool(finite_per_tensor(grads).all()) if grads else True
        else:
            flags = agree_step_flags(grads, whole=whole, group=group, device=self.root_device)
            finite = flags.finite
        if not finite:
            if self.powersgd is not None:
                self.powersgd.count_skip()  # where the non-finite callback counts a strategy's skips
            return False
        if group is None:
            return True
        average_whole(self.inter_node.replicated, group)  # finite: checked above
        return True

    @override
    def _buffer_scope(self) -> tuple[dist.ProcessGroup | None, int]:
        # The parent broadcasts rank 0's buffers (batch-norm statistics) over every rank when ddp would (and after a
        # resume): here only within the node (nodes talk at syncs), and over every rank at each sync.
        shard = self.device_mesh["shard"]
        return (shard.get_group() if shard.size() > 1 else None), shard.size()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None, **kwargs: Any) -> Any:
        if not self._started:
            self._start_cycle()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._updates += 1
        self._outer(self.outer.after_update)
        self._log()
        return output

    def _outer(self, call: Callable[[list[torch.Tensor], dist.ProcessGroup | None, int], Any]) -> Any:
        """Collective over every rank: the outer step's part of this update (see
        :mod:`dalle_lightning_plugins.compression.outer_step`); where a sync landed, rank 0's buffers go everywhere."""
        replicate = self.device_mesh["replicate"]
        replicas = replicate.size()
        start = time.perf_counter()
        try:
            landed = call([t for _, t in self._named_shards()], replicate.get_group() if replicas > 1 else None,
                          replicas)
            if landed and self.world_size > 1 and self.lightning_module is not None:
                broadcasts.broadcast_buffers(self.lightning_module)  # one model again: rank 0's buffers everywhere
            return landed
        except (RuntimeError, dist.DistError) as error:
            if not lost_peer(error):
                raise  # a bug keeps its type and traceback
            failed = ExchangeError("the outer step's exchange (the pseudo-gradient)", error)
            raise PeerLost(self.inter_node.failure(failed, time.perf_counter() - start)) from error

    def _log(self) -> None:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or not trainer.loggers:
            return
        if trainer.global_step % max(int(getattr(trainer, "log_every_n_steps", 1)), 1):
            return
        for logger in trainer.loggers:
            logger.log_metrics(self._figures(), step=trainer.global_step)

    def _figures(self) -> dict[str, float]:
        return {"local_steps/updates_since_sync": float(self.outer.updates_since_sync),
                "local_steps/inter_node_bytes_per_update": self.outer.bytes_sent / max(self._updates, 1),
                "local_steps/syncs": float(self.outer.syncs),
                "local_steps/sync_ms": 1e3 * self.outer.blocked_s / max(self.outer.syncs + self.outer.skipped_syncs, 1),
                "local_steps/skipped_syncs": float(self.outer.skipped_syncs)}

    @override
    def on_train_end(self) -> None:
        if self._started:  # a fit that stops between syncs, or with syncs on the wire, leaves the global model
            self._outer(self.outer.finish)
        super().on_train_end()
        figures = self.inter_node.figures  # PowerSGD's counters are the parent's: nothing is compressed here
        for key in [k for k in figures if k.startswith("powersgd/")]:
            del figures[key]
        figures.update(self._figures())

    # ------------------------------------------------------------------ checkpoints: the outer state per rank

    # The model and optimizer in a checkpoint are one copy (node 0's: the full file gathers rank 0's node, DCP
    # keeps one copy of each shard), which is every node's under per-step exchange. Here the nodes' weights differ
    # between syncs and each node's inner optimizer state always does, so each rank also keeps its own.

    @override
    def _rank_state(self) -> dict[str, Any]:
        state = super()._rank_state()
        if self._started:
            state[OUTER_KEY] = {**self.outer.state_dict(), "local": {n: t.detach().clone() for n, t in self._named_shards()},
                                "inner": self._inner_state()}
        return state

    @override
    def _load_rank_state(self, state: dict[str, Any]) -> None:
        outer = state.pop(OUTER_KEY, None)
        super()._load_rank_state(state)
        if outer is None:
            return
        local, inner = outer.pop("local"), outer.pop("inner")
        with torch.no_grad():  # this node's own weights and inner optimizer state over node 0's
            for name, shard in self._named_shards():
                shard.copy_(local[name])
            for name, values in self._inner_slots():
                for key, value in values.items():
                    if torch.is_tensor(value):
                        local_shard(value).copy_(inner[name][key])
        self._start_cycle()
        self.outer.load_state_dict(outer)

    def _inner_slots(self) -> list[tuple[str, dict[str, Any]]]:
        """(parameter name, the inner optimizer's state of it) for every parameter it holds state for."""
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        out = []
        for optimizer in self.optimizers:
            optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            out += [(names[id(p)], values) for p, values in optimizer.state.items() if id(p) in names]
        return out

    def _inner_state(self) -> dict[str, dict[str, Any]]:
        return {name: {k: local_shard(v).detach().clone() if torch.is_tensor(v) else v for k, v in values.items()}
                for name, values in self._inner_slots()}


if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(STRATEGY_NAME, LocalStepsStrategy,
                              description="FSDP2 within a node, the nodes synchronised every sync_every updates (DiLoCo)")

