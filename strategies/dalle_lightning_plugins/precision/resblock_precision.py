"""Lightning Precision plugin: per-resblock dynamic gradient scales with non-finite filtering (DALL-E paper).

Why not one global loss scale: activation gradients shrink from later to earlier resblocks, so one scale that
keeps the largest block from overflowing fp16 lets the smallest ones underflow to zero. Here every resblock
(residual branch) computes in 16-bit with its own scale, applied at the branch's boundaries
(:mod:`dalle_lightning_plugins.precision.grad_filter`), while the identity path, embeddings, gains outside the branches and
the output layer stay fp32. The scales follow the paper's rules (:mod:`dalle_lightning_plugins.precision.scale_rules`).

Lifecycle inside a Lightning step:

1. ``convert_module`` (called by every Lightning strategy in ``setup``, before DDP wrapping / device moves, and
   after ``configure_model`` has applied FSDP2 ``fully_shard``) finds the resblocks and installs the hooks.
2. The closure runs forward and backward; gradients inside each branch carry its scale; the filter flags blocks.
3. ``optimizer_step`` divides each block's parameter gradients by its scale (all micro-batches of a gradient
   accumulation share one scale, so dividing the sum once is exact), flags non-finite ones, agrees on the flags
   across ranks with ONE all-reduce (MAX), then either steps and grows every scale, or skips the update
   (parameters and optimizer state untouched, gradients zeroed) and backs off only the flagged blocks.

Gradients may be DTensors (FSDP2 / sharded strategies): only their local shards are touched, no full shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.dtypes import resolve_dtype
from dalle_lightning_plugins.precision.grad_filter import BranchBoundaries, unscale_and_flag
from dalle_lightning_plugins.strategies.mesh import local_shard
from dalle_lightning_plugins.protocol import find_resblocks, resolve_block_class
from dalle_lightning_plugins.precision.scale_rules import BlockScales, ScaleRules

# The branch compute dtypes, and the Lightning precision name each corresponds to.
_LIGHTNING_NAMES: dict[torch.dtype, str] = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}
GRADIENT_REDUCTION_ATTR = "gradient_reduction"  # "mean" (default) or "sum": how a strategy reduces gradients


class ResblockScalingPrecision(Precision):
    """Per-resblock gradient scales ``M * 2**x`` with 16-bit residual branches and an fp32 identity path.

    Args:
        dtype: "fp16" or "bf16" (or the torch dtype), the compute dtype inside residual branches.
        block_classes / block_patterns: which modules are resblocks (classes or dotted paths; fnmatch patterns on
            qualified names). Default: the model's ``resblocks()`` (see :mod:`dalle_lightning_plugins.protocol`).
        replicas: ``M``; default derived from how the strategy reduces gradients: 1 where it averages them
            (every Lightning strategy), its world size where it declares ``gradient_reduction = "sum"``.
        init_scale_log2, growth_factor, backoff_factor, cooldown, min_scale_log2, max_scale_log2: the paper's
            scale rules (see ``ScaleRules``).
        log_every_n_steps: how often per-block log2 scales go to the trainer's loggers; default the trainer's.
        fused_boundaries: each branch boundary's backward as one compiled kernel (True), as separate eager passes
            (False), or compiled where the activations are on CUDA (None, the default; see
            :mod:`dalle_lightning_plugins.precision.boundary_kernels`). The values are the same either way.
    """

    def __init__(
        self,
        dtype: str | torch.dtype = "fp16",
        block_classes: Sequence[type[nn.Module] | str] | None = None,
        block_patterns: Sequence[str] | None = None,
        replicas: int | None = None,
        init_scale_log2: float = 13.0,
        growth_factor: float = 2 ** (1 / 1000),
        backoff_factor: float = 2**-0.5,
        cooldown: int = 125,
        min_scale_log2: float = 7.0,
        max_scale_log2: float = 24.0,
        log_every_n_steps: int | None = None,
        fused_boundaries: bool | None = None,
    ) -> None:
        super().__init__()
        branch_dtype = resolve_dtype(dtype, allowed=_LIGHTNING_NAMES, what="dtype")
        if replicas is not None and (int(replicas) != replicas or replicas < 1):
            raise ValueError(f"replicas={replicas}, expected a positive integer or None (= data-parallel size)")
        self.precision = _LIGHTNING_NAMES[branch_dtype]  # type: ignore[assignment]
        self.dtype = branch_dtype
        self.block_classes = [resolve_block_class(c) for c in block_classes or ()]
        self.block_patterns = list(block_patterns or ())
        self.replicas = replicas
        self.rules = ScaleRules(
            init_log2=init_scale_log2,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            cooldown=cooldown,
            min_log2=min_scale_log2,
            max_log2=max_scale_log2,
        )
        self.log_every_n_steps = log_every_n_steps
        if fused_boundaries not in (True, False, None):
            raise ValueError(f"fused_boundaries={fused_boundaries!r}, expected true, false or null (compiled on CUDA)")
        self.fused_boundaries = fused_boundaries
        self.scales: BlockScales | None = None
        self._boundaries: BranchBoundaries | None = None
        self._root: nn.Module | None = None
        self._blocks: list[nn.Module] = []
        self._pending_state: dict[str, Any] | None = None
        self._agreed: Tensor | None = None  # flags from unscale_and_flag, consumed by the next optimizer_step
        self._groups: tuple[tuple[int, ...], list[list[tuple[list[Tensor], bool]]]] | None = None  # see _parameter_groups
        self._block_of: dict[int, int] | None = None  # parameter id -> block index, for unscale_group
        self._unscaled: set[int] = set()  # parameters unscale_group already unscaled this step

    # ----------------------------------------------------------------------------------------------- setup
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Find the resblocks and install the branch boundaries; parameters stay fp32 and untouched."""
        blocks = find_resblocks(module, self.block_classes or None, self.block_patterns or None)
        names = [name for name, _ in blocks]
        replicas = self.replicas or self._infer_replicas(module)
        if self.scales is None or self.scales.names != names:
            self.scales = BlockScales(names, self.rules, replicas)
        self.scales.replicas = replicas
        if self._pending_state is not None:
            self.scales.load_state_dict(self._pending_state)
            self._pending_state = None
        if self._boundaries is not None:
            self._boundaries.remove()
        self._boundaries = BranchBoundaries(self.dtype, len(blocks), self.fused_boundaries)
        self._boundaries.install([mod for _, mod in blocks])
        self._sync_device_scales()
        # Keep modules, not parameters: FSDP2's fully_shard (possibly applied after this call) swaps in new
        # DTensor parameters, so the per-block lists are built from the optimizer's parameters at its first step
        # (and again whenever those change; see _parameter_groups).
        self._root, self._blocks = module, [mod for _, mod in blocks]
        self._groups = self._block_of = None
        return module

    @staticmethod
    def _infer_replicas(module: nn.Module) -> int:
        """``M`` as the paper means it: how many times larger the reduced gradient is than one replica's.

        The paper's range ``M * 2^7 .. M * 2^24`` is for gradients *summed* over ``M`` replicas. Lightning's
        strategies (DDP, FSDP, ``ShardedPowerSGDStrategy``) and torch's DDP / FSDP *average* them, which keeps
        gradient magnitudes independent of the replica count: there ``M`` is 1, or every scale would sit
        log2(M) too high (10 powers of two at 1,024 GPUs). A strategy that sums declares it with the attribute
        ``gradient_reduction = "sum"`` (protocol of this plugin); then ``M`` is its world size.
        """
        trainer = compat.attached_trainer(module)
        strategy = getattr(trainer, "strategy", None)
        reduction = getattr(strategy, GRADIENT_REDUCTION_ATTR, "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{type(strategy).__name__}.{GRADIENT_REDUCTION_ATTR}={reduction!r}, expected 'mean' or 'sum'")
        if reduction == "mean":
            return 1
        return int(strategy.world_size) if strategy is not None else 1

    @override
    def teardown(self) -> None:
        """Leave the model as found: remove the hooks and let go of the stage's modules (a later ``setup``
        reinstalls them, keeping the scales). A sharding strategy's stage modules are FSDP2 units, which
        ``torch.save(trainer)`` after ``fit`` cannot pickle (FSDP2's per-process classes): under ``ddp`` and under
        the plugins' strategies alike, the plugin after a stage holds its scales and settings only."""
        if self._boundaries is not None:
            self._boundaries.remove()
        self._boundaries, self._root, self._blocks = None, None, []
        self._groups = self._block_of = None
        super().teardown()

    # ------------------------------------------------------------------------------------------------ step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule | nn.Module,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scales is None or self._boundaries is None:
            raise RuntimeError("ResblockScalingPrecision.optimizer_step before convert_module(model): no resblocks")
        if isinstance(optimizer, LBFGS):
            raise TypeError("optimizer=LBFGS, expected an optimizer that steps once per closure call")
        closure_result = closure()
        lightning = model if isinstance(model, pl.LightningModule) and compat.attached_trainer(model) is not None else None
        if closure_result is None and lightning is not None and lightning.automatic_optimization:
            self._agreed = None
            self._unscaled.clear()
            return None  # training_step returned None: no backward ran, nothing to step (as Lightning's AMP)

        flags = self._agreed if self._agreed is not None else self._agree(self._unscale_and_check(optimizer))
        self._agreed = None
        if lightning is not None:
            self._after_closure(lightning, optimizer)  # on_before_optimizer_step hooks and clipping see true grads
        step = self.scales.update(flags[:-1] > 0, other_nonfinite=bool(flags[-1] > 0))
        output = optimizer.step(**kwargs) if step else optimizer.zero_grad()
        self._boundaries.flags.zero_()
        self._sync_device_scales()
        if lightning is not None:
            self._log(lightning)
        return output if step else closure_result

    # ------------------------------------------------------------------------- protocol for strategies
    @torch.no_grad()
    def unscale_and_flag(self, optimizer: Optimizer) -> bool:
        """Unscale every block's gradients now and agree on the non-finite flags across ranks; True if all finite.

        For strategies that must see true gradients between the backward and the update, such as
        ``ShardedPowerSGDStrategy``, which compresses them between nodes: it calls this first, so that its error
        feedback holds unscaled values and an overflow backs off the block it came from instead of being lost
        in the strategy's own skip. The next ``optimizer_step`` reuses these flags instead of unscaling again.
        """
        self._agreed = self._agree(self._unscale_and_check(optimizer))
        return not bool((self._agreed > 0).any())

    @torch.no_grad()
    def unscale_group(self, params: Sequence[Tensor]) -> None:
        """Unscale these parameters' gradients now, each by its block's scale, and record their flags.

        For a strategy that sends each group of gradients during the backward (``GroupUnscalingPrecision``);
        the scales change only in ``optimizer_step``, so a group unscaled now is unscaled exactly as it would be
        at the step, which then leaves it alone.
        """
        assert self._boundaries is not None
        if self._block_of is None:
            self._block_of = {id(p): i for i, block in enumerate(self._blocks) for p in block.parameters()}
        outside = len(self._blocks)
        by_block: dict[int, list[Tensor]] = {}
        for p in params:
            if p.grad is not None and id(p) not in self._unscaled:
                by_block.setdefault(self._block_of.get(id(p), outside), []).append(p)
        flag_of, inv_scale_of = self._boundaries.flag_of, self._boundaries.inv_scale_of
        for index, members in by_block.items():
            for group, sharded in _buckets(members):
                grads = [p.grad for p in group]
                unscale_and_flag([local_shard(g) for g in grads] if sharded else grads,
                                 inv_scale_of[index], flag_of[index])
            self._unscaled.update(id(p) for p in members)

    def mark_nonfinite(self) -> None:
        """The strategy found a non-finite value after ``unscale_and_flag`` (e.g. in its inter-node sum):
        skip the coming update as for any non-finite gradient outside the blocks (no scale backs off)."""
        if self._agreed is None:
            raise RuntimeError("mark_nonfinite() before unscale_and_flag(optimizer): no flags of this step to mark")
        self._agreed[-1] = 1.0

    @staticmethod
    def _agree(flags: Tensor) -> Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the one collective: every rank skips together
        return flags.cpu()  # the one host sync of the step

    @torch.no_grad()
    def _unscale_and_check(self, optimizer: Optimizer) -> Tensor:
        """Divide each block's gradients by its scale in place; return the per-block (+ other) non-finite flags."""
        assert self._boundaries is not None
        boundaries = self._boundaries  # the last flag and reciprocal: the parameters outside the blocks
        for index, buckets in enumerate(self._parameter_groups(optimizer)):
            for params, sharded in buckets:
                grads = [p.grad for p in params if p.grad is not None and id(p) not in self._unscaled]
                if grads:
                    unscale_and_flag([local_shard(g) for g in grads] if sharded else grads,
                                     boundaries.inv_scale_of[index], boundaries.flag_of[index])
        self._unscaled.clear()
        return boundaries.flags.clone()

    def _parameter_groups(self, optimizer: Optimizer) -> list[list[tuple[list[Tensor], bool]]]:
        """The optimizer's parameters of each block, then those outside every block, each split into buckets of
        one device and dtype (what the fused kernel takes; a gradient always has its parameter's) with a flag for
        DTensor shards. Rebuilt only when the optimizer's parameters change (a new optimizer, or FSDP2 sharding
        applied after ``convert_module``): walking every module's parameters, or sorting gradients by kind, each
        step costs as much as a small model's unscale."""
        assert self._root is not None
        key = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
        if self._groups is None or self._groups[0] != key:
            stepped = set(key)
            per_block = [list(block.parameters()) for block in self._blocks]
            in_blocks = {id(p) for params in per_block for p in params}
            groups = [[p for p in params if id(p) in stepped] for params in per_block]
            groups.append([p for p in self._root.parameters() if id(p) in stepped and id(p) not in in_blocks])
            self._groups = (key, [_buckets(params) for params in groups])
        return self._groups[1]

    def _sync_device_scales(self) -> None:
        assert self.scales is not None and self._boundaries is not None
        self._boundaries.set_scales(self.scales.scales().to(torch.float32))

    def _log(self, model: pl.LightningModule) -> None:
        """Per-block log2 scales and the skipped-update count, straight to the loggers every n steps (cheap)."""
        assert self.scales is not None
        trainer = model.trainer
        every = int(self.log_every_n_steps or getattr(trainer, "log_every_n_steps", None) or 50)
        if not trainer.loggers or trainer.global_step % every:
            return
        offset = math.log2(self.scales.replicas)
        log2 = self.scales.log2.tolist()
        metrics = {f"precision/log2_scale/{n}": x + offset for n, x in zip(self.scales.names, log2)}
        metrics["precision/skipped_updates"] = float(self.scales.skipped)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ----------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.scales is None:
            return dict(self._pending_state or {})
        return self.scales.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scales and counters; before ``convert_module`` the state waits until the blocks are known."""
        if not state_dict:
            return
        if self.scales is None:
            self._pending_state = dict(state_dict)
        else:
            self.scales.load_state_dict(state_dict)
            if self._boundaries is not None:
                self._sync_device_scales()


def _buckets(params: list[Tensor]) -> list[tuple[list[Tensor], bool]]:
    """``params`` split by (device, dtype, is a DTensor), in first-seen order."""
    buckets: dict[tuple[torch.device, torch.dtype, bool], list[Tensor]] = {}
    for p in params:
        local = local_shard(p)
        buckets.setdefault((local.device, local.dtype, local is not p), []).append(p)
    return [(members, sharded) for (_, _, sharded), members in buckets.items()]
