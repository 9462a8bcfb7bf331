"""A Lightning Strategy that shards parameters within a node (FSDP2) and averages between nodes with PowerSGD: the
paper's recipe for a model that does not fit one GPU, on machines joined by slow links.

Processes form a ``("replicate", "shard")`` mesh, nodes x devices per node. Each block is an FSDP2 unit on the
``"shard"`` axis; FSDP2's reduce-scatter averages over the node, then PowerSGD averages each gradient shard with its
replicas on the other nodes, during the backward where it can. A LightningModule trains as under ``ddp``, or is
refused in one line. This module is Lightning's hook order, calling the parts the strategy holds (each owns its
state; docs/plugins.md draws a fit's flow through them).

``Trainer(strategy=ShardedPowerSGDStrategy(devices_per_node=8))``, ``strategy="sharded_powersgd"`` (after ``import
dalle_lightning_plugins``), or Hydra's ``conf/strategy/sharded_powersgd.yaml``. Two nodes on one machine:
``Trainer(accelerator="cpu", devices=4, strategy=ShardedPowerSGDStrategy(devices_per_node=2))``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies import in_place, sharded_root
from dalle_lightning_plugins.strategies.optimizer_step import AveragedStep
from dalle_lightning_plugins.strategies.parallel_base import ShardedParallelStrategy
from dalle_lightning_plugins.dtypes import resolve_dtype
from dalle_lightning_plugins.compression.exchange import ExchangeError
from dalle_lightning_plugins.strategies.buffer_sync import BufferBroadcasts
from dalle_lightning_plugins.strategies.collective_failures import CollectiveFailures
from dalle_lightning_plugins.strategies.carried import SHARDED_ROOT_ATTR, carried
from dalle_lightning_plugins.compression.inter_node import ExchangePath, InterNodeReduction, replica_divergence
from dalle_lightning_plugins.strategies.mesh import build_mesh
from dalle_lightning_plugins.compression.powersgd import PowerSGD
from dalle_lightning_plugins.protocol import resolve_block_class
from dalle_lightning_plugins.io.checkpoint_io import PathLike
from dalle_lightning_plugins.io.strategy_checkpoints import OVERLAP_CHOICE_KEY, Ranks, StrategyCheckpoints
from dalle_lightning_plugins.strategies.stage_model import ShardedModel
from dalle_lightning_plugins.strategies.whole_weights import WholeWeights, refuse_whole_copy_callbacks

if TYPE_CHECKING:
    import lightning.pytorch as pl

STRATEGY_NAME = "sharded_powersgd"


class ShardedPowerSGDStrategy(ShardedParallelStrategy):
    """FSDP2 within a node, PowerSGD between nodes, sharded DCP checkpoints. See the module docstring. Its parts:
    ``stage`` (stage_model.py), ``whole_weights``, ``inter_node``, ``averaged_step`` (optimizer_step.py),
    ``checkpoints`` (io/strategy_checkpoints.py); the base's ``collective_failures`` and ``dtensor_collectives``.

    Args:
        devices_per_node: the ``"shard"`` axis (default: the trainer's devices per node); nodes = world size //
            devices_per_node. A smaller world (the same code on one device) is one node, said in one line.
        block_classes, block_patterns: module classes (or dotted paths) and fnmatch patterns on qualified names
            that become FSDP units; by default the model's ``resblocks()``, else its ``nn.ModuleList``s' entries.
        reshard_after_forward: free gathered block parameters after forward (re-gather in backward).
        prefetch_depth: blocks gathered ahead in forward and behind in backward (0: FSDP's default).
        activation_checkpointing: recompute each block's activations in backward.
        param_dtype / reduce_dtype: FSDP ``MixedPrecisionPolicy`` (``None`` keeps the parameters' dtype).
        powersgd_rank: PowerSGD's rank r per gradient shard; or ``compression``, the share of the compressed
            matrices' fp32 bytes to save (the paper's figure, e.g. 0.86), from which the rank is derived once the
            model is known. Not both; neither: PowerSGD's ``DEFAULT_RANK``.
        overlap: ``True``: each bucket's inter-node exchange starts in the backward once its gradients are ready
            (``compression/exchange.py``); ``False``: the whole exchange after the backward; ``"auto"``: time both
            on the first updates, keep the faster (``compression/path_choice.py``). The same update either way.
        bucket_cap_mb: consecutive resblocks share one overlapped bucket while their parameters fit in this many
            MiB (0: one bucket per resblock).
        start_step, warm_start, error_feedback, comm_dtype, min_compression, seed, eps: passed to
            :class:`~dalle_lightning_plugins.compression.powersgd.PowerSGD`.
        uncompressed_patterns: fnmatch patterns of parameter names all-reduced uncompressed (in addition to
            embeddings and 1-D parameters), e.g. the unembedding.
        process_group_backend: ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: collective timeout of every process group, so a dead peer ends the run instead of hanging it.
        checkpoint_format: ``"full"``: one file as ``ddp`` writes it (gathered on rank 0), which
            ``load_from_checkpoint`` reads; ``"sharded"``: a DCP directory, every rank its own shards (for models
            that do not fit one process). Either form, or a ``ddp`` file, resumes a run.
        full_weights_after: after each stage the module holds whole plain tensors, as under ``ddp`` (``True``), or
            stays this rank's DTensor shards (``False``: models that do not fit one rank); ``"auto"``: whole when
            the model takes at most ``FULL_WEIGHTS_MEMORY_SHARE`` of each rank's free memory, said in one line.
    """

    strategy_name = STRATEGY_NAME
    gradient_reduction = "mean"  # averaged, never summed: the precision plugin sets the paper's M from it
    # Non-finite gradients are agreed on by the ranks sharing an update, which skip it (``powersgd.stats``): a
    # callback need not all-reduce the decision again (under LocalStepsStrategy, across the slow link each update).
    skips_nonfinite_updates = True

    def __init__(
        self,
        devices_per_node: int | None = None,
        *,
        block_classes: Sequence[type[nn.Module] | str] | None = None,
        block_patterns: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        prefetch_depth: int = 1,
        activation_checkpointing: bool = False,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        powersgd_rank: int | None = None,
        compression: float | None = None,
        overlap: bool | str = "auto",
        bucket_cap_mb: float = 1.0,
        start_step: int = 0,
        warm_start: bool = False,
        error_feedback: bool = True,
        comm_dtype: torch.dtype | str = torch.float32,
        min_compression: float = 2.0,
        seed: int = 0,
        eps: float = 1e-7,
        uncompressed_patterns: Sequence[str] = (),
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(minutes=30),
        checkpoint_format: str = "full",
        full_weights_after: bool | str = "auto",
    ) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if devices_per_node is not None and (not isinstance(devices_per_node, int) or devices_per_node < 1):
            raise ValueError(f"devices_per_node={devices_per_node!r}, expected a positive integer or None")
        self.checkpoints = StrategyCheckpoints(checkpoint_format)
        self.whole_weights = WholeWeights(full_weights_after, type(self).__name__)
        self.devices_per_node = devices_per_node
        self.inter_node = InterNodeReduction(
            dict(rank=powersgd_rank, start_step=start_step, warm_start=warm_start, error_feedback=error_feedback,
                 comm_dtype=comm_dtype, min_compression=min_compression, seed=seed, eps=eps),
            compression=compression, overlap=overlap, bucket_cap_mb=bucket_cap_mb,
            uncompressed_patterns=uncompressed_patterns)
        self.collective_failures = CollectiveFailures(self.inter_node.failure)  # names the nodes it waited for
        self.stage = ShardedModel(  # the sharded root, kept across fit -> validate: FSDP2 shards a module only once
            [resolve_block_class(c) for c in block_classes or ()], block_patterns or (),
            activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward,
            prefetch_depth=prefetch_depth, owner=type(self).__name__,
            mp_policy=MixedPrecisionPolicy(param_dtype=resolve_dtype(param_dtype), reduce_dtype=resolve_dtype(reduce_dtype)))
        self._synchronised_step = True  # False inside block_backward_sync: a micro-batch that reduces nothing
        self.averaged_step = AveragedStep()
        self.buffer_broadcasts = BufferBroadcasts()  # rank 0's, as ddp's

    @property
    def powersgd(self) -> PowerSGD | None:
        """This rank's compressor (its settings, error buffers and counters); None before ``setup_environment``."""
        return self.inter_node.powersgd

    @property  # the parts' state under the names callers, tests and benchmarks read on the strategy
    def block_names(self) -> list[str]:
        """The names of the blocks the last stage made FSDP units."""
        return self.stage.block_names

    # ------------------------------------------------------------------ environment and mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Both mesh axes are data parallel: every rank reads its own part of the data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        per_node, backend = self._start_processes(self.devices_per_node or self.num_processes)
        self._device_mesh = build_mesh(self.root_device.type, self.world_size, per_node, backend, self._timeout)
        assert self.lightning_module is not None
        compat.set_module_device_mesh(self.lightning_module, self._device_mesh)
        for undo in self.inter_node.setup(self._device_mesh, self.global_rank, self.world_size, per_node, backend,
                                          self._timeout):
            self.until_teardown(undo)
        if per_node > 1:  # a module's own torch.distributed.all_reduce on a sharded gradient, as under ddp
            self.until_teardown(self.dtensor_collectives.raw_collectives_for_stage(self._device_mesh))
            self.whole_weights.roll_call.begin(self._device_mesh["shard"].mesh.flatten().tolist())  # after an error

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        refuse_whole_copy_callbacks(trainer, self.device_mesh["shard"].size())
        self.accelerator.setup(trainer)
        assert self.lightning_module is not None
        module: nn.Module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.stage.begin(module)  # this stage's activation checkpointing; the last stage's root if it is module's
        self.buffer_broadcasts.begin_stage()  # its first forward starts from rank 0's buffers, as a fresh ddp's
        shard_size = self.device_mesh["shard"].size()
        if (known := carried(module, SHARDED_ROOT_ATTR)) is not None:  # left sharded by full_weights_after=False
            self.model = self.stage.reuse(module, known, shard_size, self.precision_plugin, fitting)
        else:  # whole for validate, test and predict on a model that fits whole (full_weights_after), as ddp runs them
            whole = not fitting and shard_size > 1 and self.whole_weights.whole_stage(
                module, trainer.state.fn.value, self.root_device, self.num_processes)
            self.model = self.stage.build(module, self.precision_plugin, self.device_mesh, self.root_device,
                                          self.world_size, fitting=fitting, whole=whole)
        if fitting and (undo := self.stage.shard_averages(trainer, module)) is not None:
            self.until_teardown(undo)  # Lightning's WeightAveraging: its copy sharded as the module
        if self.model is not module:  # validate/test/predict on the whole module need no inter-node exchange
            self.inter_node.attach(module, self.stage.block_names, sharded_root.replicated_parameters(module, shard_size > 1))
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
            in_place.remap_optimizers(self.optimizers, self.stage.root)  # groups built before the stage: FSDP2's
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Collective: every parameter whole on every rank for the duration (the callbacks' protocol)."""
        with sharded_root.full_parameters(self.model, self.stage.reshard_after_forward):
            yield None

    # ------------------------------------------------------------------ the step

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's ``Strategy.backward``, with the inter-node average before ``on_after_backward`` (the precision
        # plugin's ``post_backward``), so that hook sees averaged gradients as under ``ddp``.
        shard = self.device_mesh["shard"]  # units that did not run exactly once, and gradients to leave as they were
        irregular, untouched = ([], []) if shard.size() == 1 else self.stage.before_backward(
            closure_loss, shard.get_group(), self.root_device)
        step, start = self.averaged_step, time.perf_counter()
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        path = self.inter_node.begin_backward(synchronised=self._synchronised_step, module=module,
                                              precision=self.precision_plugin, every_unit_ran_once=not irregular)
        step.begin_backward(start, path is ExchangePath.OVERLAPPED if self._synchronised_step else None)
        try:
            with self.stage.shards_read():  # manual_backward inside training_step: FSDP2's hooks meet the shards
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        except ExchangeError as error:  # a bucket's collective, issued from a gradient hook, failed
            raise RuntimeError(self.inter_node.failure(error, time.perf_counter() - step.backward_start)) from error
        for p in untouched:
            p.grad = None
        # new gradients: averaged here, or once by the first optimizer step that takes them (AveragedStep)
        step.averaged(self.reduce_gradients() if path in (ExchangePath.OVERLAPPED, ExchangePath.AFTER_BACKWARD)
                      else None)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on non-final micro-batches: no reduce-scatter and no exchange between nodes there
        (at one device per node the model is no FSDP unit: only the exchange is held back)."""
        sharded = isinstance(self.model, FSDPModule)
        self._synchronised_step = False
        try:
            if sharded:
                self.model.set_requires_gradient_sync(False)
            yield None
        finally:
            if sharded:
                self.model.set_requires_gradient_sync(True)
            self._synchronised_step = True

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | nn.Module | None = None, **kwargs: Any) -> Any:
        # Lightning's step through the precision plugin, with the closure run first so that the average over the
        # nodes (and the skip decision) sits between the backward and the update (``optimizer_step.py``).
        start, step, precision, module = time.perf_counter(), self.averaged_step, self.precision_plugin, self.lightning_module
        model = model or module
        assert isinstance(model, LightningModule)  # as Lightning's Strategy.optimizer_step
        with self.stage.shards_read():  # opt.step() inside training_step (manual optimization) updates the shards
            result = step.run_closure(closure, module)
            finite = step.unscale(optimizer, precision, result, model)
            if step.due(finite):
                step.averaged(self.reduce_gradients())
            output = step.update(optimizer, result, model, precision, finite, **kwargs)
        if self.inter_node.exchange is not None:  # overlap="auto": every update's time, for the choice of path
            self.inter_node.choice.record(time.perf_counter() - start, step.overlapped, self.root_device)
        return output

    def reduce_gradients(self) -> bool:
        """Average every gradient shard over the nodes, once per update; False: every rank skips the step."""
        assert self.lightning_module is not None
        ok = self.inter_node.reduce(self.lightning_module, self.root_device, since=self.averaged_step.backward_start)
        self.inter_node.log_stats(self.lightning_module.trainer)
        return ok

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:  # ddp's wrapper runs it only while fitting
            self.buffer_broadcasts.before_forward(self.lightning_module, self._synchronised_step, self._buffer_scope())
        output = super().validation_step(*args, **kwargs)
        self.stage.after_validation_step()
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.buffer_broadcasts.before_forward(self.lightning_module, self._synchronised_step, self._buffer_scope())
        self.stage.new_step()  # (buffers: as ddp's wrapper) forwards from here count, not validation's
        return super().training_step(*args, **kwargs)

    def _buffer_scope(self) -> tuple[dist.ProcessGroup | None, int]:
        """The ranks that share rank 0's buffers (as ddp's, and after a resume), and how many: every rank."""
        return None, self.world_size

    def replica_divergence(self) -> float:
        """Collective: the largest absolute difference between any shard and its copy on node 0: 0.0 unless the
        nodes train different models (every node holds a full copy, split over its own devices)."""
        assert self.lightning_module is not None
        return replica_divergence(self.lightning_module, self.device_mesh["replicate"], self.world_size)

    @override
    def __getstate__(self) -> dict:
        """``torch.save(trainer)`` after ``fit``, as under ``ddp``: without the launcher's processes (and locks)."""
        state = super().__getstate__()
        state["_launcher"] = None
        state["stage"] = self.stage.pickled()  # without the sharded root, whose classes pickle cannot name
        return state

    @override
    def teardown(self) -> None:
        try:
            self.inter_node.detach()  # a later fit (or Trainer) attaches again to the model it then has
            self.stage.remove_checkpointing()  # the blocks' own forward again
            if self.lightning_module is not None:  # as ddp leaves it (WholeWeights.leave), the model from then on
                shard_size = 1 if self._device_mesh is None else self.device_mesh["shard"].size()  # None: unsharded
                model = self.whole_weights.leave(self.lightning_module, self.stage, shard_size, self.root_device,
                                                 self.num_processes)
                self.model = self.model if model is None else model
        finally:
            super().teardown()  # the stage's own installs are undone even if the weights could not be made whole

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.whole_weights.on_exception(exception)  # a failed collective: no gather at teardown

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.inter_node.keep_figures()  # kept: a later trainer.validate() sets up a fresh compressor

    # ------------------------------------------------------------------ checkpoints (io/strategy_checkpoints.py)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self.checkpoints.module_state(self.lightning_module, self.stage.root)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return self.checkpoints.optimizer_state(self.lightning_module, self.stage.root, optimizer)

    def _rank_state(self) -> dict[str, Any]:
        """What each rank keeps of its own in a checkpoint besides the model, optimizer and buffers (the exchange's
        state); a subclass adds its own keys."""
        return self.inter_node.rank_state(OVERLAP_CHOICE_KEY)

    def _load_rank_state(self, state: dict[str, Any]) -> None:
        self.inter_node.load_rank_state(state, OVERLAP_CHOICE_KEY)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported; got {storage_options!r}")
        assert self.powersgd is not None and self.lightning_module is not None
        path = self.broadcast(filepath)
        with self.collective_failures.named("a checkpoint's write"):
            self.checkpoints.save(checkpoint, path, module=self.lightning_module, root=self.stage.root,
                                  io=self.checkpoint_io, ranks=Ranks(self.global_rank, self.world_size),
                                  rank_state=self._rank_state())
        self.barrier("save_checkpoint")  # rank 0's file is written before any rank goes on

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Either form, or a ``ddp`` file (:meth:`StrategyCheckpoints.load`); then this rank's own state, and rank 0's
        buffers everywhere, as every ``ddp`` rank loads its file."""
        assert self.lightning_module is not None and self.powersgd is not None
        path = self.broadcast(checkpoint_path)
        loaded, own = self.checkpoints.load(path, weights_only, module=self.lightning_module, optimizers=self.optimizers,
                                            io=self.checkpoint_io, ranks=Ranks(self.global_rank, self.world_size))
        if own is not None:
            self._load_rank_state(own)
        self.buffer_broadcasts.share(self.lightning_module, self._buffer_scope())
        return loaded

    def exchange_figures(self) -> dict[str, float]:
        """The last fit's exchange for a run's report: bytes sent between nodes per step against uncompressed, time."""
        return dict(self.inter_node.figures)


if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(
        STRATEGY_NAME,
        ShardedPowerSGDStrategy,
        description="FSDP2 sharding within a node, PowerSGD gradient averaging between nodes, sharded DCP checkpoints",
    )
