"""A Lightning Strategy that shards parameters within a node (FSDP2) and averages between nodes with PowerSGD.

This is the paper's recipe for training a model that does not fit one GPU on machines joined by slow links:

* a 2-D mesh ``("replicate", "shard")`` = nodes x devices per node (:mod:`dalle_lightning_plugins.mesh`);
* every resblock (or configured block) is one FSDP2 unit on the 1-D ``"shard"`` mesh, the LightningModule's
  remaining parameters form the root unit; the next blocks are prefetched explicitly
  (:mod:`dalle_lightning_plugins.prefetch`);
* FSDP's reduce-scatter averages gradients over the node; then each rank averages its *local shard* of every
  gradient with its replicas on the other nodes through :class:`dalle_lightning_plugins.powersgd.PowerSGD` (not FSDP's HSDP
  all-reduce, which cannot be compressed). If PowerSGD reports a non-finite gradient anywhere, every rank skips
  the optimizer step. A precision plugin that offers ``unscale_and_flag(optimizer) -> bool`` and
  ``mark_nonfinite()`` (:class:`dalle_lightning_plugins.resblock_precision.ResblockScalingPrecision`) unscales the gradients
  before PowerSGD and owns the skip decision;
* checkpoints are one file as ``ddp`` writes them (``checkpoint_format="full"``: Lightning's loaders read it) or
  sharded DCP directories (``"sharded"``, :mod:`dalle_lightning_plugins.dcp_checkpoint`), holding the model, the optimizer and
  each rank's PowerSGD state and buffers, so a resumed run continues exactly; either form, or a ``ddp`` file,
  resumes a run;
* a LightningModule trains as under ``ddp``, behaviour by behaviour (``tests/test_strategy_conformance.py``,
  ``docs/plugins.md``), or the strategy says in one line what it cannot do.

Use it as ``Trainer(strategy=ShardedPowerSGDStrategy(devices_per_node=8))``, as ``strategy="sharded_powersgd"``
(after ``import dalle_lightning_plugins``), or from Hydra with ``conf/strategy/sharded_powersgd.yaml``. Simulating two nodes
on one machine: ``Trainer(accelerator="cpu", devices=4, strategy=ShardedPowerSGDStrategy(devices_per_node=2))``.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.init import _materialize_distributed_module, _materialize_meta_tensors
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from dalle_lightning_plugins.checkpoint_io import AtomicCheckpointIO
from dalle_lightning_plugins.dtypes import resolve_dtype
from dalle_lightning_plugins.exchange import ExchangeError, OverlappedExchange
from dalle_lightning_plugins.mesh import build_mesh, local_shard
from dalle_lightning_plugins.powersgd import DEFAULT_RANK, PowerSGD, finite_per_tensor, rank_for_compression
from dalle_lightning_plugins.prefetch import apply_prefetch
from dalle_lightning_plugins.protocol import (
    GroupUnscalingPrecision,
    UnscalingPrecision,
    find_resblocks,
    resolve_block_class,
)
from dalle_lightning_plugins.strategy_checkpoints import ShardedCheckpointing

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

STRATEGY_NAME = "sharded_powersgd"
CHECKPOINT_FORMATS = ("full", "sharded")


class ShardedRoot(nn.Module):
    """The FSDP root around the LightningModule.

    Lightning calls ``training_step``, not ``forward``; FSDP's root hooks (lazy init, unsharding the root's own
    parameters, the end-of-backward callback) live on ``forward``. Lightning's forward redirection routes
    ``training_step`` through this module's ``forward``, so the hooks run, while the LightningModule itself
    stays a plain module (its own ``self(x)`` calls are not re-entrant FSDP calls).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.units_ran: dict[str, bool] = {}  # block unit -> ran forward since the last check (see the strategy)
        self.gathered_outside = False  # gathered again after a backward resharded it (see gather_root_before_forward)

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


# Attribute of a sharded LightningModule: (its ShardedRoot, shard-axis size). FSDP2 shards a module only once, so
# a later fit of the same Trainer, or a new Trainer, reuses the units made for it.
SHARDED_ROOT_ATTR = "_sharded_powersgd_root"


def reshard_all(root: nn.Module) -> None:
    """Return every FSDP unit under ``root`` to its shards (a no-op for sharded ones).

    A forward without backward (validation, a metric under ``no_grad``) leaves the root unit gathered: its
    registered parameters are then the gathered copies, which an optimizer built now would update in vain.
    """
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def gather_root_before_forward(root: ShardedRoot) -> None:
    """Gather the root unit before any forward of a module owning its parameters, not only ``training_step``.

    FSDP2 gathers the root unit in ``ShardedRoot.forward`` (around ``training_step``) and reshards it after each
    backward; a second forward in the same step (after ``manual_backward``, with a second optimizer, a metric on
    the updated model) would meet sharded parameters. Gathering again there reads the current shards, so it also
    sees the update an optimizer made in between, as under ``ddp``. A no-op when the unit is gathered.
    """
    block_params = {id(p) for m in root.modules() if isinstance(m, FSDPModule) and m is not root for p in m.parameters()}
    owned = [(m, n) for m in root.module.modules() for n, p in m.named_parameters(recurse=False)
             if id(p) not in block_params]
    if not owned:
        return  # the root unit holds no parameters
    probe = owned[0]  # FSDP2 swaps the registered parameter: a DTensor while the unit is sharded
    for owner in {id(m): m for m in [root.module, *(m for m, _ in owned)]}.values():
        owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root, probe))


def _gather_if_sharded(root: ShardedRoot, probe: tuple[nn.Module, str], *_: Any) -> None:
    owner, name = probe
    if isinstance(owner._parameters[name], DTensor):
        root.unshard()  # type: ignore[operator]
        root.gathered_outside = True


def embedding_param_names(module: nn.Module) -> set[str]:
    """Names of the parameters owned by ``nn.Embedding`` modules: the paper all-reduces those uncompressed."""
    return {
        f"{mod_name}.{p_name}" if mod_name else p_name
        for mod_name, mod in module.named_modules()
        if isinstance(mod, nn.Embedding)
        for p_name, _ in mod.named_parameters(recurse=False)
    }


def prepare_for_sharding(module: nn.Module) -> set[nn.Parameter]:
    """Convert what FSDP2 cannot shard at the boundary; return the parameters it must leave alone.

    * Parameters in another memory format (channels-last convolution weights, which FSDP2 refuses as
      non-contiguous) are made contiguous. The activations keep their format: a convolution with a
      channels-last input still runs channels-last, and FSDP2 all-gathers every weight into a contiguous
      buffer anyway. Single-process runs never come here and keep channels-last weights.
    * Scalar (0-d) parameters, such as CLIP's ``logit_scale``, cannot be sharded on dim 0: they stay whole on
      every rank (``ignored_params``) and the strategy averages their gradients over all ranks itself.
    """
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    return {p for p in module.parameters() if p.dim() == 0}


def shard_module(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch_depth: int = 1,
    activation_checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> ShardedRoot:
    """Make each block an FSDP2 unit on the 1-D ``mesh`` (bottom-up), then wrap ``module`` in the root unit."""
    policy = mp_policy or MixedPrecisionPolicy()
    ignored = prepare_for_sharding(module)
    for block in blocks:
        if activation_checkpointing:
            checkpoint_activations(block)  # hook-based: keeps parameter names unchanged
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, ignored_params=ignored)
    root = ShardedRoot(module)
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    # ddp(find_unused_parameters=True): a parameter without a gradient on this rank (a branch only some ranks
    # take) joins the reduce-scatter with zeros, so every rank sends the same buffers.
    root.set_reduce_scatter_unused_params(True)
    gather_root_before_forward(root)
    apply_prefetch(list(blocks), prefetch_depth)  # type: ignore[arg-type]
    return root


class ShardedPowerSGDStrategy(ShardedCheckpointing, ModelParallelStrategy):
    """FSDP2 within a node, PowerSGD between nodes, sharded DCP checkpoints. See the module docstring.

    Args:
        devices_per_node: size of the ``"shard"`` axis; default the trainer's devices per node. The world size
            must be a multiple of it; nodes = world size // devices_per_node.
        block_classes: module classes (or dotted paths) that become FSDP units; with ``block_patterns`` they
            override the model's ``resblocks()`` declaration.
        block_patterns: fnmatch patterns on qualified module names that become FSDP units.
        reshard_after_forward: free gathered block parameters after forward (re-gather in backward).
        prefetch_depth: number of blocks gathered ahead in forward and behind in backward (0: FSDP default).
        activation_checkpointing: recompute each block's activations in backward.
        param_dtype / reduce_dtype: FSDP ``MixedPrecisionPolicy`` (``None`` keeps the parameters' dtype).
        powersgd_rank: PowerSGD's rank r per gradient shard; or ``compression``, the share of the compressed
            matrices' fp32 bytes to save (the paper's figure, e.g. 0.86), from which the rank is derived once the
            model is known. Not both; neither: rank ``DEFAULT_RANK``.
        overlap: start each bucket's inter-node exchange during the backward, as soon as its gradients are
            ready (:mod:`dalle_lightning_plugins.exchange`; one device per node); off: the whole exchange after the backward.
        bucket_cap_mb: consecutive resblocks share one overlapped bucket while their parameters fit in this many
            MiB (0: one bucket per resblock).
        start_step, warm_start, error_feedback, comm_dtype, min_compression, seed, eps: passed to
            :class:`~dalle_lightning_plugins.powersgd.PowerSGD`.
        uncompressed_patterns: fnmatch patterns of parameter names all-reduced uncompressed (in addition to
            embeddings and 1-D parameters), e.g. the unembedding.
        process_group_backend: ``None`` picks gloo on CPU, nccl on CUDA.
        timeout: collective timeout of every process group, so a dead peer ends the run instead of hanging it.
        checkpoint_format: ``"full"`` writes one file as ``ddp`` does (the model gathered on rank 0; for models that
            fit one process's memory), which ``load_from_checkpoint`` reads; ``"sharded"`` writes a DCP directory,
            every rank its own shards (for models that do not). Either form, or a ``ddp`` file, resumes a run.
    """

    strategy_name = STRATEGY_NAME
    # Gradients are averaged (FSDP's reduce-scatter, then PowerSGD's mean), never summed: the precision plugin
    # reads this to set the paper's M (see ``ResblockScalingPrecision``).
    gradient_reduction = "mean"

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
        overlap: bool = True,
        bucket_cap_mb: float = 1.0,
        start_step: int = 0,
        warm_start: bool = False,
        error_feedback: bool = True,
        comm_dtype: torch.dtype | str = torch.float32,
        min_compression: float = 2.0,
        seed: int = 0,
        eps: float = 1e-6,
        uncompressed_patterns: Sequence[str] = (),
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = timedelta(minutes=30),
        checkpoint_format: str = "full",
    ) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if devices_per_node is not None and (not isinstance(devices_per_node, int) or devices_per_node < 1):
            raise ValueError(f"devices_per_node={devices_per_node!r}, expected a positive integer or None")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth={prefetch_depth!r}, expected a non-negative integer")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format={checkpoint_format!r}, expected one of {CHECKPOINT_FORMATS}")
        self.checkpoint_format = checkpoint_format
        self.devices_per_node = devices_per_node
        self.block_classes = [resolve_block_class(c) for c in block_classes or ()]
        self.block_patterns = list(block_patterns or ())
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_depth = prefetch_depth
        self.activation_checkpointing = activation_checkpointing
        self.mp_policy = MixedPrecisionPolicy(param_dtype=resolve_dtype(param_dtype), reduce_dtype=resolve_dtype(reduce_dtype))
        self.uncompressed_patterns = list(uncompressed_patterns)
        if powersgd_rank is not None and compression is not None:
            raise ValueError(f"powersgd_rank={powersgd_rank!r} and compression={compression!r} both given; "
                             "set one: the rank, or the share of bytes to save from which the rank follows")
        if compression is not None and not 0 < compression < 1:
            raise ValueError(f"compression={compression!r}, expected a share of bytes saved between 0 and 1 (e.g. 0.86)")
        if powersgd_rank is not None and (not isinstance(powersgd_rank, int) or powersgd_rank < 1):
            raise ValueError(f"powersgd_rank={powersgd_rank!r}, expected a positive integer")
        self.compression = compression
        self.overlap = overlap
        if not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}, expected a non-negative size in MiB")
        self.bucket_cap_mb = bucket_cap_mb
        if powersgd_rank is None:
            powersgd_rank = DEFAULT_RANK
        self._powersgd_kwargs: dict[str, Any] = dict(
            rank=powersgd_rank, start_step=start_step, warm_start=warm_start, error_feedback=error_feedback,
            comm_dtype=comm_dtype, min_compression=min_compression, seed=seed, eps=eps,
        )
        self.powersgd: PowerSGD | None = None
        self.block_names: list[str] = []
        self._blocks: dict[str, nn.Module] = {}
        self._root: ShardedRoot | None = None  # kept across fit -> validate: FSDP2 shards a module only once
        self._replicated: list[nn.Parameter] = []  # parameters FSDP2 leaves whole (see prepare_for_sharding)
        self._uncompressed: set[str] = set()
        self._synchronised_step = True  # False inside block_backward_sync: a micro-batch that reduces nothing
        self._reduced: bool | None = None  # the inter-node average's result when the backward ran it
        self._reduce_time = [0.0, 0]  # seconds in reduce_gradients and its calls (after the first), for the stats
        self._exchange_figures: dict[str, float] = {}  # the last fit's, see exchange_figures()
        self._exchange: OverlappedExchange | None = None  # the overlapped path (one device per node, several nodes)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Unless one is given (``plugins=[...]``), checkpoint files are written by :class:`AtomicCheckpointIO`: a
        temporary file beside the target, renamed over it, so an interrupted or failed save never leaves a
        truncated ``last.ckpt`` for a resumed run to pick (Lightning's default writes in place)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif getattr(self._checkpoint_io, "checkpoint_io", False) is None:  # a wrapper (AsyncCheckpointIO) of nothing yet
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()  # type: ignore[attr-defined]
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    # ------------------------------------------------------------------ environment and mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Both mesh axes are data parallel: every rank reads its own part of the data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        # As every Lightning strategy: select this rank's device first (``torch.cuda.set_device`` on CUDA), so
        # ``devices=[2, 3]`` or an already initialised CUDA context cannot put two ranks on one GPU. The parent's
        # setup_environment is skipped on purpose: it would build ModelParallelStrategy's own (TP) mesh.
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Lightning's launcher divides the cores among its processes only in the process that launches the
            # others (after starting them): every other rank would run as many threads as there are cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, self.num_processes)))
        self._setup_distributed()
        backend = self._get_process_group_backend()
        per_node = self.devices_per_node or self.num_processes
        self._device_mesh = build_mesh(self.root_device.type, self.world_size, per_node, backend, self._timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        self.powersgd = PowerSGD(self._device_mesh["replicate"].get_group(), dense_with_p=True, **self._powersgd_kwargs)
        self._exchange = None
        if self.overlap and per_node == 1 and self.world_size > 1:
            # Two more groups over the same ranks: P's and Q''s are issued at different moments on each rank, so
            # each kind needs a group of its own to keep the order of issue equal everywhere (strategies/exchange.py).
            groups = [dist.new_group(list(range(self.world_size)), timeout=self._timeout, backend=backend)
                      for _ in range(2)]
            self._exchange = OverlappedExchange(self.powersgd, *groups, bucket_cap_mb=self.bucket_cap_mb)
        self._reduce_time = [0.0, 0]  # timed per fit, like the compressor's own counters

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.lightning_module is not None
        module: nn.Module = self.precision_plugin.convert_module(self.lightning_module)
        known: tuple[ShardedRoot, int] | None = getattr(module, SHARDED_ROOT_ATTR, None)
        shard_size = self.device_mesh["shard"].size()
        if known is not None:
            # A later stage or fit of the same Trainer, or a new Trainer on the same model: FSDP2 shards a module
            # only once, so the units made then are reused; they must be on a mesh of the same shape.
            root, size = known
            if size != shard_size:
                raise ValueError(
                    f"{type(module).__name__} was sharded over {size} devices per node by an earlier Trainer, "
                    f"this one has devices_per_node={shard_size}; build a new model (or keep devices_per_node)"
                )
            reshard_all(root)
            self._plan(module)
            self.model = self._root = root
            self._set_replicated(module)
        else:
            self.model = self._root = self._shard(module)
            # not a submodule (no parameters counted twice): a plain attribute the module carries to later Trainers
            object.__setattr__(module, SHARDED_ROOT_ATTR, (self._root, shard_size))
        self._resolve_rank(module)
        if self._exchange is not None:
            self._exchange.attach(module, self.block_names, self._uncompressed, embedding_param_names(module))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _resolve_rank(self, module: nn.Module) -> None:
        """With ``compression`` set: the rank that saves that share of the compressed matrices' bytes."""
        if self.compression is None or self.powersgd is None:
            return
        shapes = [local_shard(p).shape for n, p in module.named_parameters()
                  if p.requires_grad and n not in self._uncompressed]
        self.powersgd.rank = rank_for_compression(shapes, self.compression, self.powersgd.min_compression)

    def _plan(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The blocks that become FSDP units; records their names and the parameters PowerSGD leaves dense."""
        blocks = find_resblocks(module, self.block_classes or None, self.block_patterns or None)
        self.block_names = [name for name, _ in blocks]
        self._blocks = dict(blocks)
        self._uncompressed = embedding_param_names(module) | {
            n for n, _ in module.named_parameters() if any(fnmatch.fnmatchcase(n, p) for p in self.uncompressed_patterns)
        }
        return blocks

    def _shard(self, module: nn.Module) -> ShardedRoot:
        blocks = self._plan(module)
        if self.device_mesh["shard"].size() == 1:
            # One device per node: nothing to shard within a node. FSDP2 over a group of one would only add
            # copies and DTensor dispatch to every step; the model stays whole and PowerSGD does all the averaging.
            if self.activation_checkpointing:
                for _, block in blocks:
                    checkpoint_activations(block)
            _materialize_meta_tensors(module, self.root_device)  # ``init_module(empty_init=True)``
            module.to(self.root_device)
            self._replicated = []
            self._broadcast_replicas(module)
            return ShardedRoot(module)
        root = shard_module(
            module,
            [b for _, b in blocks],
            self.device_mesh["shard"],
            reshard_after_forward=self.reshard_after_forward,
            prefetch_depth=self.prefetch_depth,
            activation_checkpointing=self.activation_checkpointing,
            mp_policy=self.mp_policy,
        )
        _materialize_distributed_module(root, self.root_device)
        for name, block in blocks:
            block.register_forward_pre_hook(functools.partial(_mark_ran, root.units_ran, name))
        self._set_replicated(module)
        self._broadcast_replicas(module)
        return root

    def _set_replicated(self, module: nn.Module) -> None:
        sharded = self.device_mesh["shard"].size() > 1
        self._replicated = [p for p in module.parameters() if sharded and not hasattr(p, "to_local")]

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Collective: every parameter whole on every rank for the duration (protocol of ``callbacks/``).

        For code that reaches a sharded model outside its ``forward`` (sampling with a key/value cache, a
        decoder's ``decode`` method, image grids): FSDP2 only gathers a unit's parameters around its
        ``forward``. Inside, no unit reshards after its forward; on exit every unit returns to its shards.
        Memory: the whole model on every rank, as in a single-device run.
        """
        root = self.model
        if not isinstance(root, FSDPModule):
            yield None
            return
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.unshard()
        try:
            yield None
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(self.reshard_after_forward and unit is not root, recurse=False)

    @torch.no_grad()
    def _broadcast_replicas(self, module: nn.Module) -> None:
        """Make every node start from node 0's shards, and every rank from rank 0's buffers.

        Each process initialises its own copy; without this, replicas of one shard would start (and stay)
        different whenever the seeds differ.
        """
        replicate = self.device_mesh["replicate"]
        if replicate.size() > 1:
            locals_ = [p.to_local() for p in module.parameters() if hasattr(p, "to_local")]
            _broadcast_flat(locals_, replicate.get_group())
        whole = [p.data for p in module.parameters() if not hasattr(p, "to_local")]  # parameters left whole
        if whole and self.world_size > 1:
            _broadcast_flat(whole, None)
        if self.world_size > 1:
            self._broadcast_buffers()

    # ------------------------------------------------------------------ the step

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's ``Strategy.backward``, with the inter-node average between the backward and
        # ``on_after_backward`` (the precision plugin's ``post_backward``), so that hook sees averaged gradients as
        # under ``ddp``.
        untouched = self._before_backward(closure_loss)
        self._backward_start = time.perf_counter()
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        overlapped = self._exchange is not None and self._reduces_in_backward(overlapped=True)
        if self._exchange is not None:
            precision = self.precision_plugin
            unscale = precision.unscale_group if isinstance(precision, GroupUnscalingPrecision) else None
            self._exchange.begin(active=overlapped, unscale=unscale)
        try:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        except ExchangeError as error:  # a bucket's collective, issued from a gradient hook, failed
            raise RuntimeError(self._exchange_failure(error, time.perf_counter() - self._backward_start)) from error
        for p in untouched:
            p.grad = None
        if overlapped or self._reduces_in_backward():
            self._reduced = self.reduce_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _before_backward(self, closure_loss: torch.Tensor) -> list[nn.Parameter]:
        """Checks and hooks a node of several devices needs before its backward; returns the parameters whose
        gradients must stay as they were (those of units no rank ran)."""
        if self.device_mesh["shard"].size() == 1:
            return []
        idle = self._check_units_ran()
        # A unit no rank ran since the last backward takes no part in this one; FSDP2 would still hand its
        # parameters zero gradients (``reduce_scatter_unused_params``), and momentum or weight decay would then
        # move them. As under ddp, their gradients stay as they were (None after ``zero_grad``).
        untouched = [p for name in idle for p in self._blocks[name].parameters() if p.grad is None]
        assert self._root is not None
        if self._root.gathered_outside:
            # A loss from a forward outside ShardedRoot.forward (a second update through the embedding and
            # head only) carries no FSDP2 root hook: without one the root unit's gradients are never
            # reduce-scattered. The root's own pre-backward hook on the loss queues that reduction.
            self._root.gathered_outside = False
            self._root._get_fsdp_state()._register_pre_backward_hook(closure_loss)  # type: ignore[operator]
        return untouched

    def _reduces_in_backward(self, overlapped: bool = False) -> bool:
        """Whether this backward ends with the inter-node average (else ``optimizer_step`` runs it).

        Only the last micro-batch of an automatic step averages (``block_backward_sync`` covers the others). Under
        manual optimisation the step may follow several backwards, and PowerSGD must compress their sum once.
        Under a loss-scaling precision (``GradScaler``, per-block scales) the gradients must be unscaled before
        compression, which Lightning does only in the step: there the average waits for it, and
        ``on_after_backward`` sees this node's scaled gradients (they are scaled under ``ddp`` too). The overlapped
        exchange (``overlapped``) instead has a ``GroupUnscalingPrecision`` unscale each group as it is sent.
        """
        module = self.lightning_module
        precision = self.precision_plugin
        scaled = (isinstance(precision, UnscalingPrecision) and not (overlapped and isinstance(precision, GroupUnscalingPrecision))
                  or getattr(precision, "scaler", None) is not None)
        return (self._synchronised_step and self.world_size > 1 and module is not None
                and module.automatic_optimization and not scaled)

    def _take_reduction(self) -> bool:
        """The result of this step's inter-node average: the one the backward ran, or run it now."""
        reduced, self._reduced = self._reduced, None
        return self.reduce_gradients() if reduced is None else reduced

    def _check_units_ran(self) -> list[str]:
        """Collective over the node: every FSDP unit must have run forward on every rank before a backward.

        A block only some ranks run (layer drop decided per rank) leaves FSDP2's gathers and reduce-scatters
        unmatched between the ranks of a node, which hangs or mixes up buffers. One small all-reduce turns that
        into an error on every rank before the backward's collectives start. Returns the units no rank ran.
        """
        assert self._root is not None
        ran = torch.tensor([self._root.units_ran.get(n, False) for n in self.block_names], dtype=torch.float32,
                           device=self.root_device)
        self._root.units_ran.clear()
        both = torch.stack([ran, -ran])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.device_mesh["shard"].get_group())
        highs, lows = both[0].tolist(), (-both[1]).tolist()
        uneven = [n for n, hi, lo in zip(self.block_names, highs, lows) if hi != lo]
        if uneven:
            raise RuntimeError(
                f"block {uneven[0]} ran forward on some ranks of a node only; ShardedPowerSGDStrategy needs every "
                f"FSDP unit in every rank's forward at devices_per_node > 1: run it everywhere (scale its output "
                f"by 0 where skipped), or leave it out of the units (block_patterns/block_classes) or use devices_per_node=1"
            )
        return [n for n, hi in zip(self.block_names, highs) if not hi]  # units no rank ran

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on non-final micro-batches: no reduce-scatter and no PowerSGD there."""
        root = self.model
        if not isinstance(root, FSDPModule):
            yield None
            return
        root.set_requires_gradient_sync(False)
        self._synchronised_step = False
        try:
            yield None
        finally:
            root.set_requires_gradient_sync(True)
            self._synchronised_step = True

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # As ddp (``broadcast_buffers=True``): every rank starts a synchronised forward from rank 0's buffers, so
        # batch-norm running statistics stay one model's rather than drifting apart per rank.
        if self._synchronised_step and torch.is_grad_enabled() and self.world_size > 1:
            self._broadcast_buffers()
        if self._root is not None:
            self._root.units_ran.clear()  # forwards outside training (validation) do not count
        return super().training_step(*args, **kwargs)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        assert self.lightning_module is not None
        buffers = [b for b in self.lightning_module.buffers()
                   if not isinstance(b, DTensor) and (b.is_floating_point() or b.dtype in (torch.int64, torch.int32))]
        if buffers:
            _broadcast_flat(buffers, None)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        # Run forward/backward first, so the inter-node average (and the skip decision) sits between the
        # backward and the optimizer's update; the precision plugin then sees a closure that only returns.
        self._reduced = None
        result = closure()
        precision = self.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            return self._scaled_optimizer_step(precision, optimizer, result, model, **kwargs)
        if isinstance(precision, UnscalingPrecision):
            # A precision plugin with per-block loss scales (``ResblockScalingPrecision``): unscale before PowerSGD,
            # so error feedback holds true gradients, and let the plugin decide the skip, so an overflow backs off
            # the block it came from. Non-finite flags are agreed on every rank, so either all ranks run PowerSGD's
            # collectives or none does.
            if precision.unscale_and_flag(optimizer) and not self._take_reduction():
                precision.mark_nonfinite()
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        if not self._take_reduction():
            optimizer.zero_grad(set_to_none=True)
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    def _scaled_optimizer_step(self, precision: MixedPrecision, optimizer: Optimizer, result: Any,
                               model: pl.LightningModule | nn.Module | None, **kwargs: Any) -> Any:
        """Lightning's ``MixedPrecision`` step with its ``GradScaler``, the inter-node average in the middle.

        Unscaling comes first, so PowerSGD and its error feedback see true gradients; a step skipped for a
        non-finite gradient on any rank still goes through ``scaler.step`` and ``scaler.update``, with the
        overflow recorded on every rank, so the scale backs off (and later grows) alike everywhere, as under ``ddp``.
        """
        model = model or self.lightning_module
        assert isinstance(model, LightningModule) and precision.scaler is not None
        if result is None and model.automatic_optimization:  # training_step returned None: no backward ran
            return result
        scaler = precision.scaler
        scaler.unscale_(optimizer)
        if not self._take_reduction():
            for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found_inf.fill_(1.0)
        precision._after_closure(model, optimizer)  # on_before_optimizer_step and clipping, on unscaled gradients
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    def reduce_gradients(self) -> bool:
        """Average every local gradient shard over the replicate axis with PowerSGD; False means skip the step.

        Called once per optimizer step after the (final) backward, when FSDP has already averaged over the node.
        """
        assert self.powersgd is not None and self.lightning_module is not None
        start = time.perf_counter()
        try:
            ok = self._reduce_gradients()
        except (RuntimeError, dist.DistError) as error:
            since = getattr(self, "_backward_start", start)  # the overlapped exchange started in the backward
            raise RuntimeError(self._exchange_failure(error, time.perf_counter() - min(since, start))) from error
        if self.powersgd.stats.steps + self.powersgd.stats.skipped_steps > 1:  # the first allocates its buffers
            self._reduce_time[0] += time.perf_counter() - start
            self._reduce_time[1] += 1
        self._log_stats()
        return ok

    def _exchange_failure(self, error: BaseException, seconds: float) -> str:
        """One line for a failed exchange between nodes: which collective, with which nodes, after how long."""
        per_node = self.device_mesh["shard"].size()
        nodes = sorted({r // per_node for r in range(self.world_size)} - {self.global_rank // per_node})
        if isinstance(error, ExchangeError):
            what, first = error.waiting_on, error.reason
        else:
            what = "the inter-node gradient exchange"
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        return (f"node {self.global_rank // per_node} (rank {self.global_rank}): {what} with node(s) {nodes} failed "
                f"{seconds:.1f} s into the step's exchange (timeout {timeout:g} s): {first}; the link or a peer node is down")

    def _reduce_gradients(self) -> bool:
        assert self.powersgd is not None and self.lightning_module is not None
        if self._exchange is not None and self._exchange.active:
            return self._exchange.finish()  # the backward has sent most of it already
        finite = self._agree_flags()
        if finite and not self._average_replicated():
            finite = False
        replicated = {id(p) for p in self._replicated}
        named = []
        for name, p in self.lightning_module.named_parameters():
            if p.grad is None or id(p) in replicated:
                continue
            local = local_shard(p.grad)
            if local.numel():
                named.append((name, local))
        # The skip decision was agreed above over every rank, which is PowerSGD's skip group (WORLD).
        return self.powersgd.reduce(named, uncompressed=self._uncompressed, finite=finite)

    @torch.no_grad()
    def replica_divergence(self) -> float:
        """Collective: the largest absolute difference between any shard and its copy on node 0.

        Every node holds a full copy of the model, split over its own devices; PowerSGD must leave the copies
        of each shard identical (0.0), or the nodes are training different models.
        """
        module = self.lightning_module
        assert module is not None
        flat = torch.cat([local_shard(p).detach().reshape(-1).float()
                          for p in module.parameters()])
        first = flat.clone()
        if self.device_mesh["replicate"].size() > 1:
            dist.broadcast(first, group=self.device_mesh["replicate"].get_group(), group_src=0)
        worst = (flat - first).abs().max().reshape(1) if flat.numel() else flat.new_zeros(1)
        if self.world_size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst.item())

    @torch.no_grad()
    def _agree_flags(self) -> bool:
        """One MAX all-reduce over every rank for two answers; returns whether every gradient everywhere is finite.

        - ``ddp(find_unused_parameters=True)``: a whole parameter another rank has a gradient for gets zeros here.
          Every rank must then pass the same gradients to the collectives (a branch only some ranks take would
          otherwise mismatch them); one that no rank used keeps ``grad=None``, so the optimizer leaves it alone,
          as under ``ddp``. Sharded parameters get the same treatment from FSDP2 (``reduce_scatter_unused_params``).
        - The skip decision: PowerSGD's own would cost a second collective at the same point.
        """
        assert self.lightning_module is not None
        params = list(self.lightning_module.parameters())
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
        device = self.root_device
        bad = (~finite_per_tensor(grads).all()).reshape(1) if grads else torch.zeros(1, dtype=torch.bool, device=device)
        whole = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
        if self.world_size == 1:
            return not bool(bad.item())
        used = torch.tensor([p.grad is not None for p in whole], dtype=torch.float32, device=device)
        flags = torch.cat([used, bad.to(device=device, dtype=torch.float32)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        *anywhere_used, anywhere_bad = flags.tolist()
        for p, was_used in zip(whole, anywhere_used):
            if was_used and p.grad is None:
                p.grad = torch.zeros_like(p)
        return not anywhere_bad

    @torch.no_grad()
    def _average_replicated(self) -> bool:
        """Average the gradients of the parameters FSDP2 left whole over every rank (one small all-reduce);
        False if one is non-finite (the same answer on every rank, as the values are then equal)."""
        grads = [p.grad for p in self._replicated if p.grad is not None]
        if not grads:
            return True
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if self.world_size > 1:
            dist.all_reduce(flat)
            flat.div_(self.world_size)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view(g.shape))
        return bool(finite_per_tensor([flat]).all())

    @override
    def teardown(self) -> None:
        if self._exchange is not None:
            self._exchange.detach()  # a later fit (or Trainer) attaches again to the model it then has
        super().teardown()

    def _log_stats(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
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

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.powersgd is None:
            return
        # Kept here: a later trainer.validate() sets the strategy up again with a fresh compressor.
        stats = self.powersgd.stats
        self._exchange_figures = {"powersgd/inter_node_bytes_per_rank": float(stats.bytes_sent_last_step),
                                  "powersgd/uncompressed_bytes_per_rank": float(stats.uncompressed_bytes_last_step)}
        seconds, calls = self._reduce_time
        if calls:
            self._exchange_figures["strategy/reduce_ms_per_step"] = 1e3 * seconds / calls

    def exchange_figures(self) -> dict[str, float]:
        """The last fit's gradient exchange, for a run's report: bytes this rank sent between nodes in the last
        step, against the uncompressed gradient, and the wall time of the exchange per step (the inter-node
        average, replicated parameters, unused-gradient flags), which against the step time is the share of the
        step that is communication."""
        return dict(self._exchange_figures)

def _mark_ran(ran: dict[str, bool], name: str, *_: Any) -> None:
    ran[name] = True


def _broadcast_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Broadcast from the group's first rank in one collective per dtype instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if group is None:
            dist.broadcast(flat, src=0)
        else:
            dist.broadcast(flat, group=group, group_src=0)
        for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(chunk.view(t.shape))


if STRATEGY_NAME not in StrategyRegistry:
    StrategyRegistry.register(
        STRATEGY_NAME,
        ShardedPowerSGDStrategy,
        description="FSDP2 sharding within a node, PowerSGD gradient averaging between nodes, sharded DCP checkpoints",
    )
