"""The strategy's inter-node reduction: which path a step's exchange takes, and the exchange itself between nodes.

After FSDP2 has averaged the gradients over a node (or at once, at one device per node), each rank averages its
local shard of every gradient with its replicas on the other nodes: PowerSGD for the matrices, plain averages for
embeddings, vectors and what is listed uncompressed, one all-reduce over every rank for the parameters FSDP2
left whole, and one flag all-reduce that agrees on the skip decision and on unused gradients
(:mod:`dalle_lightning_plugins.compression.step_flags`). :func:`exchange_path` decides, in one place, when in the step that
happens; :class:`InterNodeReduction` runs it, times it, names a failed collective, and reports the bytes.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.compression.exchange import ExchangeError, OverlappedExchange, average_whole
from dalle_lightning_plugins.strategies.mesh import local_shard
from dalle_lightning_plugins.compression.path_choice import OverlapChoice
from dalle_lightning_plugins.environments.peer_loss import PeerLost, lost_peer
from dalle_lightning_plugins.compression.powersgd import DEFAULT_RANK, PowerSGD, rank_for_compression
from dalle_lightning_plugins.protocol import GroupUnscalingPrecision, UnscalingPrecision
from dalle_lightning_plugins.compression.step_flags import agree_step_flags

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class ExchangePath(enum.Enum):
    """When a backward's gradients cross between nodes."""

    OVERLAPPED = "overlapped"  # bucket by bucket during the backward, finished at its end
    AFTER_BACKWARD = "after_backward"  # all at once when the backward ends, before ``on_after_backward``
    IN_OPTIMIZER_STEP = "in_optimizer_step"  # in the optimizer step, after the precision plugin unscales
    NOT_THIS_BACKWARD = "not_this_backward"  # a micro-batch that is not the last: nothing crosses


def exchange_path(*, synchronised: bool, world_size: int, automatic_optimization: bool, precision: Any,
                  can_overlap: bool, every_unit_ran_once: bool = True) -> ExchangePath:
    """The one decision of when this backward's exchange runs.

    Only the last micro-batch of an automatic step exchanges (``block_backward_sync`` marks the others
    unsynchronised). Under manual optimisation the step may follow several backwards, and PowerSGD must compress
    their sum once: in the optimizer step. Under a loss-scaling precision (Lightning's ``GradScaler``, or an
    :class:`UnscalingPrecision` with per-block scales) the gradients must be unscaled before compression, which
    Lightning does only in the step; the overlapped exchange (``can_overlap``: several nodes, ``overlap`` on)
    instead has a :class:`GroupUnscalingPrecision` unscale each bucket as it is sent. A step in which some FSDP
    unit ran on no rank of a node, or more than once (``every_unit_ran_once`` false), takes the end-of-backward
    path: an idle unit's gradients are left alone, and a unit run twice is reduce-scattered twice, its gradient
    final only when the backward ends. A single process still runs the (local) reduction in the step, for its
    skip decision and counters.
    """
    if not synchronised:
        return ExchangePath.NOT_THIS_BACKWARD
    if world_size == 1 or not automatic_optimization or getattr(precision, "scaler", None) is not None:
        return ExchangePath.IN_OPTIMIZER_STEP
    group_unscaled = not isinstance(precision, UnscalingPrecision) or isinstance(precision, GroupUnscalingPrecision)
    if can_overlap and every_unit_ran_once and group_unscaled:
        return ExchangePath.OVERLAPPED
    if isinstance(precision, UnscalingPrecision):
        return ExchangePath.IN_OPTIMIZER_STEP
    return ExchangePath.AFTER_BACKWARD


def embedding_param_names(module: nn.Module) -> set[str]:
    """Names of the parameters owned by ``nn.Embedding`` modules: the paper all-reduces those uncompressed."""
    return {
        f"{mod_name}.{p_name}" if mod_name else p_name
        for mod_name, mod in module.named_modules()
        if isinstance(mod, nn.Embedding)
        for p_name, _ in mod.named_parameters(recurse=False)
    }


class InterNodeReduction:
    """The exchange between nodes of one strategy: its compressor, its overlapped exchange, its figures.

    Args:
        powersgd_kwargs: passed to :class:`PowerSGD` (its ``rank`` is replaced when ``compression`` is set).
        compression: the share of the compressed matrices' fp32 bytes to save, from which the rank follows once
            the model is known; None keeps the rank.
        overlap: use the :class:`OverlappedExchange` where it applies (several nodes): True, False, or ``"auto"``,
            the faster of the two paths timed on the run's own first updates (:mod:`~dalle_lightning_plugins.compression.path_choice`).
        bucket_cap_mb: the overlapped exchange's bucket size.
        uncompressed_patterns: fnmatch patterns of parameter names averaged uncompressed, besides embeddings.
    """

    def __init__(self, powersgd_kwargs: dict[str, Any], *, compression: float | None, overlap: bool | str,
                 bucket_cap_mb: float, uncompressed_patterns: Sequence[str]) -> None:
        """``powersgd_kwargs["rank"]`` None: from ``compression``, else ``DEFAULT_RANK``; the options are checked
        here, where they are used, each in one line naming the strategy's option."""
        rank = powersgd_kwargs.get("rank")
        if rank is not None and compression is not None:
            raise ValueError(f"powersgd_rank={rank!r} and compression={compression!r} both given; "
                             "set one: the rank, or the share of bytes to save from which the rank follows")
        if compression is not None and not 0 < compression < 1:
            raise ValueError(f"compression={compression!r}, expected a share of bytes saved between 0 and 1 (e.g. 0.86)")
        if rank is not None and (not isinstance(rank, int) or rank < 1):
            raise ValueError(f"powersgd_rank={rank!r}, expected a positive integer")
        if not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}, expected a non-negative size in MiB")
        self.powersgd_kwargs = {**powersgd_kwargs, "rank": DEFAULT_RANK if rank is None else rank}
        self.compression, self.overlap, self.bucket_cap_mb = compression, overlap, bucket_cap_mb
        self.choice = OverlapChoice(overlap)  # which path each update takes (overlap="auto": timed)
        self.uncompressed_patterns = list(uncompressed_patterns)
        self.powersgd: PowerSGD | None = None
        self.exchange: OverlappedExchange | None = None
        self.uncompressed: set[str] = set()
        self.replicated: list[nn.Parameter] = []  # parameters FSDP2 leaves whole (sharding.prepare_for_sharding)
        self.timeout: timedelta | None = None
        self.global_rank, self.world_size, self.per_node = 0, 1, 1
        self._time = [0.0, 0]  # seconds in reduce() and its calls (after the first), for the figures
        self.figures: dict[str, float] = {}  # the last fit's, see ShardedPowerSGDStrategy.exchange_figures()

    def rank_state(self, choice_key: str) -> dict[str, Any]:
        """This rank's own state for a checkpoint: PowerSGD's (Q, error buffers, counters) and, under
        ``choice_key``, ``overlap="auto"``'s schedule and decision."""
        assert self.powersgd is not None
        return {**self.powersgd.state_dict(), choice_key: self.choice.state_dict()}

    def load_rank_state(self, state: dict[str, Any], choice_key: str) -> None:
        assert self.powersgd is not None
        choice = state.pop(choice_key, None)
        self.powersgd.load_state_dict(state)
        if choice is not None:
            self.choice.load_state_dict(choice)

    def setup(self, mesh: DeviceMesh, global_rank: int, world_size: int, per_node: int, backend: str,
              timeout: timedelta | None) -> list[Callable[[], None]]:
        """A fresh compressor on the mesh's replicate group; the overlapped exchange's two groups if it applies.
        Returns the undo steps for the stage's teardown (the groups destroyed: this stage's only)."""
        self.global_rank, self.world_size, self.per_node = global_rank, world_size, per_node
        self.timeout = timeout
        self.powersgd = PowerSGD(mesh["replicate"].get_group(), dense_with_p=True, **self.powersgd_kwargs)
        self.exchange = None
        self.choice.reset()
        nodes = world_size // self.per_node
        if self.overlap is not False and nodes > 1:
            # Two more groups over this rank's replicate ranks: P's and Q''s are issued at different moments on
            # each rank, so each kind needs a group of its own to keep the order of issue equal everywhere
            # (exchange.py). Every rank creates every group (torch's rule), in the same order, and keeps its own.
            mine: list[dist.ProcessGroup] = []
            for shard in range(self.per_node):
                ranks = [node * self.per_node + shard for node in range(nodes)]
                groups = [dist.new_group(ranks, timeout=timeout, backend=backend) for _ in range(2)]
                if global_rank in ranks:
                    mine = groups
            self.exchange = OverlappedExchange(self.powersgd, *mine, bucket_cap_mb=self.bucket_cap_mb)
        self._time = [0.0, 0]  # timed per fit, like the compressor's own counters
        if self.exchange is None:
            return []
        return [functools.partial(dist.destroy_process_group, g) for g in (self.exchange.p_group, self.exchange.q_group)]

    def attach(self, module: nn.Module, block_names: Sequence[str], replicated: list[nn.Parameter]) -> None:
        """Learn the model: what goes uncompressed, the rank for ``compression``, the overlapped buckets."""
        assert self.powersgd is not None
        embeddings = embedding_param_names(module)
        self.uncompressed = embeddings | {n for n, _ in module.named_parameters()
                                          if any(fnmatch.fnmatchcase(n, p) for p in self.uncompressed_patterns)}
        self.replicated = replicated
        if self.compression is not None:
            shapes = [local_shard(p).shape for n, p in module.named_parameters()
                      if p.requires_grad and n not in self.uncompressed]
            self.powersgd.rank = rank_for_compression(shapes, self.compression, self.powersgd.min_compression)
        if self.exchange is not None:
            self.exchange.attach(module, block_names, self.uncompressed, embeddings, replicated)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(trainer)`` after ``fit``, as under ``ddp``) without what holds process groups: the
        compressor and the exchange are made again by the next :meth:`setup`; the last fit's figures are kept."""
        state = dict(self.__dict__)
        state.update(powersgd=None, exchange=None, replicated=[])
        return state

    def detach(self) -> None:
        if self.exchange is not None:
            self.exchange.detach()  # a later fit (or Trainer) attaches again to the model it then has

    # ------------------------------------------------------------------ one step

    def begin_backward(self, *, synchronised: bool, module: nn.Module | None, precision: Any,
                       every_unit_ran_once: bool) -> ExchangePath:
        """When this backward's gradients cross between nodes (:func:`exchange_path`, with this part's world and
        overlap); the overlapped exchange's hooks armed for it (idle unless it takes the overlapped path), with a
        loss-scaling precision's ``unscale_group`` applied to each group before it is sent."""
        path = exchange_path(synchronised=synchronised, world_size=self.world_size,
                             automatic_optimization=module is not None and bool(getattr(module, "automatic_optimization", True)),
                             precision=precision, can_overlap=self.exchange is not None and self.choice.overlap_now(),
                             every_unit_ran_once=every_unit_ran_once)
        if self.exchange is not None:
            unscale = precision.unscale_group if isinstance(precision, GroupUnscalingPrecision) else None
            self.exchange.begin(active=path is ExchangePath.OVERLAPPED, unscale=unscale)
        return path

    def reduce(self, module: nn.Module, device: torch.device, since: float | None = None) -> bool:
        """Average every local gradient shard over the replicate axis; False means skip the step (every rank).

        Called once per optimizer step after the (final) backward. ``since``: when the step's exchange began
        (the backward's start, for the overlapped path), for the failure message.
        """
        assert self.powersgd is not None
        start = time.perf_counter()
        try:
            ok = self._reduce(module, device)
        except (RuntimeError, dist.DistError) as error:
            if not lost_peer(error):
                raise  # a bug (an out-of-memory in the compression, ...) keeps its type and traceback
            raise PeerLost(self.failure(error, time.perf_counter() - min(since or start, start))) from error
        if self.powersgd.stats.steps + self.powersgd.stats.skipped_steps > 1:  # the first allocates its buffers
            self._time[0] += time.perf_counter() - start
            self._time[1] += 1
        return ok

    def _reduce(self, module: nn.Module, device: torch.device) -> bool:
        assert self.powersgd is not None
        if self.exchange is not None and self.exchange.active:
            return self.exchange.finish()  # the backward has sent most of it already
        params = list(module.parameters())
        flags = agree_step_flags([local_shard(p.grad) for p in params if p.grad is not None],
                                 whole=[p for p in params if p.requires_grad and not hasattr(p, "to_local")], device=device)
        finite = flags.finite and average_whole(self.replicated)
        replicated = {id(p) for p in self.replicated}
        named = [(name, local_shard(p.grad)) for name, p in module.named_parameters()
                 if p.grad is not None and id(p) not in replicated]
        # The skip decision was agreed above over every rank, which is PowerSGD's skip group (WORLD).
        return self.powersgd.reduce([(n, g) for n, g in named if g.numel()], uncompressed=self.uncompressed,
                                    finite=finite)

    def failure(self, error: BaseException, seconds: float) -> str:
        """One line for a failed exchange between nodes: which collective, with which nodes, after how long."""
        nodes = sorted({r // self.per_node for r in range(self.world_size)} - {self.global_rank // self.per_node})
        if isinstance(error, ExchangeError):
            what, first = error.waiting_on, error.reason
        else:
            what = "the inter-node gradient exchange"
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        timeout = self.timeout.total_seconds() if self.timeout is not None else None
        return (f"node {self.global_rank // self.per_node} (rank {self.global_rank}): {what} with node(s) {nodes} "
                f"failed after {seconds:.1f} s (timeout {timeout:g} s): {first}; "
                "the link or a peer node is down")

    # ------------------------------------------------------------------ figures

    def log_stats(self, trainer: pl.Trainer | None) -> None:
        """The compressor's counters to the trainer's loggers, every ``log_every_n_steps``."""
        if trainer is None or not trainer.loggers or self.powersgd is None:
            return
        step = trainer.global_step
        if step % max(int(getattr(trainer, "log_every_n_steps", 1)), 1):
            return
        stats = self.powersgd.stats
        metrics = {
            "powersgd/inter_node_bytes_per_rank": float(stats.bytes_sent_last_step),
            "powersgd/uncompressed_bytes_per_rank": float(stats.uncompressed_bytes_last_step),
            "powersgd/compression_ratio": float(stats.compression_ratio),
            "powersgd/skipped_steps": float(stats.skipped_steps),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def keep_figures(self) -> None:
        """At the end of a fit: the figures a run reports, kept past a later ``validate`` (a fresh compressor)."""
        if self.powersgd is None:
            return
        stats = self.powersgd.stats
        self.figures = {"powersgd/inter_node_bytes_per_rank": float(stats.bytes_sent_last_step),
                        "powersgd/uncompressed_bytes_per_rank": float(stats.uncompressed_bytes_last_step)}
        seconds, calls = self._time
        if calls:
            self.figures["strategy/reduce_ms_per_step"] = 1e3 * seconds / calls
        if self.exchange is not None and self.choice.chosen is not None:
            self.figures["strategy/overlapped"] = float(self.choice.chosen)
        if self.choice.medians_ms is not None:
            overlapped_ms, end_ms = self.choice.medians_ms
            self.figures["strategy/trial_update_ms_overlapped"] = overlapped_ms
            self.figures["strategy/trial_update_ms_end_of_backward"] = end_ms


@torch.no_grad()
def replica_divergence(module: nn.Module, replicate: DeviceMesh, world_size: int) -> float:
    """Collective: the largest absolute difference between any shard and its copy on node 0 (0.0 when the
    nodes train one model, as they must)."""
    flat = torch.cat([local_shard(p).detach().reshape(-1).float() for p in module.parameters()])
    first = flat.clone()
    if replicate.size() > 1:
        dist.broadcast(first, group=replicate.get_group(), group_src=0)
    worst = (flat - first).abs().max().reshape(1) if flat.numel() else flat.new_zeros(1)
    if world_size > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())
