"""The optimizer step of the sharding strategies: the inter-node average between the backward and the update.

A part :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy` holds (it owns the
step's flags, which the strategy's ``backward`` sets, and is handed the rest). Lightning runs the closure (forward and
backward) inside the precision plugin's ``optimizer_step``; here it runs first, so that the average over the nodes
(PowerSGD) and the skip decision sit between the backward and the update, for each of the three kinds of precision:
Lightning's ``MixedPrecision`` with a ``GradScaler``, a plugin that unscales per group (``UnscalingPrecision``),
and any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
import torch
from torch import nn
from torch.optim import Optimizer

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies.mixed_lists import MixedLists
from dalle_lightning_plugins.protocol import UnscalingPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl


# Optimizers whose ``step`` evaluates the closure more than once (a line search): here the closure's forward and
# backward run once, before the inter-node average, so a second evaluation would see the first one's gradients;
# and they read each gradient whole (LBFGS's ``p.grad.view(-1)``), which a sharded gradient is not.
REEVALUATING_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


def refuse_reevaluating_optimizers(optimizers: list[Optimizer], strategy: str) -> None:
    """One line at setup, before any step, for an optimizer that re-evaluates its closure (:data:`REEVALUATING_OPTIMIZERS`)."""
    for optimizer in optimizers:
        if isinstance(optimizer, REEVALUATING_OPTIMIZERS):
            raise ValueError(
                f"{strategy}: configure_optimizers returned {type(optimizer).__name__}, which evaluates its closure "
                "several times per step and reads each gradient whole, while this strategy runs forward and backward "
                "once per step, before the inter-node average, and holds gradients as shards; expected an optimizer "
                "that evaluates the closure once (SGD, Adam, AdamW, ...), or strategy='ddp' for "
                f"{type(optimizer).__name__}")


def _once(result: Any, optimizer: Optimizer) -> Callable[[], Any]:
    """The closure the optimizer gets after forward and backward already ran: their result, once. A second call
    (an optimizer that re-evaluates, e.g. sharpness-aware minimisation) would get stale gradients: one line instead."""
    called = False

    def closure() -> Any:
        nonlocal called
        if called:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step evaluated its closure a second time; under this strategy forward "
                "and backward run once per step, before the inter-node average, so a second evaluation would reuse "
                "the first one's gradients; expected an optimizer that evaluates the closure once, or strategy='ddp'")
        called = True
        return result

    return closure


class AveragedStep:
    """``optimizer_step`` with the inter-node average and the skip of a non-finite update (see the module).

    It owns the step's flags, which the strategy's ``backward`` reports (:meth:`begin_backward`,
    :meth:`end_backward`): ``reduced`` (the result of the average of the
    last backward's gradients, once the backward or a step ran it; None until then), ``overlapped`` (the last
    synchronised backward took the overlapped path) and ``backward_start``. The strategy hands it the precision
    plugin, Lightning's own step (``base_step``) and its ``reduce_gradients`` (which a subclass may change), so
    nothing is read back from the strategy."""

    def __init__(self) -> None:
        self.reduced: bool | None = None
        self.overlapped = False
        self.backward_start = 0.0

    def begin_backward(self, start: float, overlapped: bool | None) -> None:
        """A backward started at ``start`` (``time.perf_counter()``); ``overlapped``: whether this synchronised
        backward takes the overlapped path (None: a micro-batch that reduces nothing, which leaves the last one's)."""
        self.backward_start = start
        if overlapped is not None:
            self.overlapped = overlapped

    def end_backward(self, reduced: bool | None) -> None:
        """The backward's gradients: averaged over the nodes with this result, or None (the first step that takes
        them averages them, :meth:`take_reduction`)."""
        self.reduced = reduced

    def step(self, optimizer: Optimizer, closure: Callable[[], Any], model: pl.LightningModule | nn.Module | None,
             *, precision: Any, module: pl.LightningModule | None, base_step: Callable[..., Any],
             reduce: Callable[[], bool], **kwargs: Any) -> Any:
        """Run forward/backward first, so the inter-node average (and the skip decision) sits between the backward
        and the optimizer's update; the precision plugin then sees a closure that only returns."""
        if module is None or module.automatic_optimization:
            self.reduced = None  # the closure runs this update's backward (none: training_step returned None)
        result = closure()
        with MixedLists():  # the update's foreach calls: plain parameters beside shards (mixed_lists)
            return self._update(optimizer, result, model, precision=precision, module=module, base_step=base_step,
                                reduce=reduce, **kwargs)

    def _update(self, optimizer: Optimizer, result: Any, model: pl.LightningModule | nn.Module | None, *,
                precision: Any, module: pl.LightningModule | None, base_step: Callable[..., Any],
                reduce: Callable[[], bool], **kwargs: Any) -> Any:
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            return self._scaled_step(precision, optimizer, result, model or module, reduce, **kwargs)
        if isinstance(precision, UnscalingPrecision):
            # A precision plugin with per-block loss scales (``ResblockScalingPrecision``): unscale before PowerSGD,
            # so error feedback holds true gradients, and let the plugin decide the skip, so an overflow backs off
            # the block it came from. Non-finite flags are agreed on every rank, so either all ranks run PowerSGD's
            # collectives or none does.
            if precision.unscale_and_flag(optimizer) and not self.take_reduction(reduce):
                precision.mark_nonfinite()
            return base_step(optimizer, _once(result, optimizer), model, **kwargs)
        if not self.take_reduction(reduce):
            optimizer.zero_grad(set_to_none=True)
            return result
        return base_step(optimizer, _once(result, optimizer), model, **kwargs)

    def _scaled_step(self, precision: MixedPrecision, optimizer: Optimizer, result: Any,
                     model: pl.LightningModule | nn.Module | None, reduce: Callable[[], bool], **kwargs: Any) -> Any:
        """Lightning's ``MixedPrecision`` step with its ``GradScaler``, the inter-node average in the middle.

        Unscaling comes first, so PowerSGD and its error feedback see true gradients; a step skipped for a
        non-finite gradient on any rank still goes through ``scaler.step`` and ``scaler.update``, with the
        overflow recorded on every rank, so the scale backs off (and later grows) alike everywhere, as under ``ddp``.
        """
        assert isinstance(model, LightningModule) and precision.scaler is not None
        if result is None and model.automatic_optimization:  # training_step returned None: no backward ran
            return result
        scaler = precision.scaler
        scaler.unscale_(optimizer)
        if not self.take_reduction(reduce):
            compat.mark_scaler_overflow(scaler, optimizer)
        compat.after_closure(precision, model, optimizer)  # on_before_optimizer_step and clipping, unscaled
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    def take_reduction(self, reduce: Callable[[], bool]) -> bool:
        """The result of the inter-node average of the last backward's gradients: the one the backward (or an
        earlier step) ran, or run it now. Once per set of gradients, as ``ddp`` averages once per backward: under
        manual optimization the steps after one ``manual_backward`` (two optimizers, or one stepped twice) share
        it, and several ``manual_backward`` before a step are averaged once, summed."""
        if self.reduced is None:
            self.reduced = reduce()
        return self.reduced
