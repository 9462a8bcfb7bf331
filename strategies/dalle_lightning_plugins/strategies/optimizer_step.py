"""The optimizer step of the sharding strategies: the inter-node average between the backward and the update.

A part :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy` holds (it owns the
step's flags, which the strategy's ``backward`` reports, and is handed the precision plugin). Lightning runs the closure (forward and
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
    """``optimizer_step`` with the inter-node average and the skip of a non-finite update (see the module), in
    the calls the strategy makes in order: :meth:`run_closure`, :meth:`unscale`, then (the average run by the
    strategy where :meth:`due`, its result given back with :meth:`averaged`) :meth:`update`.

    It owns the step's flags, which the strategy's ``backward`` reports (:meth:`begin_backward`, :meth:`averaged`):
    ``reduced`` (the result of the average of the last backward's gradients, once the backward or a step ran it;
    None until then), ``overlapped`` (the last synchronised backward took the overlapped path) and
    ``backward_start``. It calls no method of the strategy's: the precision plugin is handed to it."""

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

    def averaged(self, reduced: bool | None) -> None:
        """The last backward's gradients: averaged over the nodes with this result (False: every rank skips the
        update), or None (not yet: the first step that takes them averages them, where :meth:`due`). Once per set of
        gradients, as ``ddp`` averages once per backward: under manual optimization the steps after one
        ``manual_backward`` (two optimizers, or one stepped twice) share it, and several ``manual_backward`` before a
        step are averaged once, summed."""
        self.reduced = reduced

    def run_closure(self, closure: Callable[[], Any], module: pl.LightningModule | None) -> Any:
        """Forward and backward first, so the inter-node average (and the skip decision) sits between the backward
        and the optimizer's update; the precision plugin then sees a closure that only returns (:func:`_once`)."""
        if module is None or module.automatic_optimization:
            self.reduced = None  # the closure runs this update's backward (none: training_step returned None)
        return closure()

    def unscale(self, optimizer: Optimizer, precision: Any, result: Any, model: Any) -> bool:
        """Unscale the gradients the precision plugin scaled, so PowerSGD and its error feedback see true values;
        False where no average is to run: no backward ran, or a plugin that unscales per group found a non-finite
        gradient (it skips the update and backs off that block itself)."""
        with MixedLists():  # its foreach calls, as the update's
            if isinstance(precision, MixedPrecision) and precision.scaler is not None:
                if result is None and model.automatic_optimization:  # training_step returned None: no backward ran
                    return False
                precision.scaler.unscale_(optimizer)
                return True
            if isinstance(precision, UnscalingPrecision):
                # Per-block loss scales (``ResblockScalingPrecision``): non-finite flags are agreed on every rank,
                # so either all ranks run PowerSGD's collectives or none does.
                return precision.unscale_and_flag(optimizer)
            return True

    def due(self, finite: bool) -> bool:
        """Whether the strategy is to average the gradients over the nodes now: finite, and not averaged yet."""
        return finite and self.reduced is None

    def update(self, optimizer: Optimizer, result: Any, model: Any, precision: Any, finite: bool, **kwargs: Any) -> Any:
        """The update on the averaged gradients through the precision plugin, or every rank's skip of it."""
        with MixedLists():  # the update's foreach calls: plain parameters beside shards (mixed_lists)
            if isinstance(precision, MixedPrecision) and precision.scaler is not None:
                return self._scaled_update(precision, optimizer, result, model, finite, **kwargs)
            if isinstance(precision, UnscalingPrecision):
                if finite and not self.reduced:
                    precision.mark_nonfinite()  # the plugin skips the update and backs off, as for its own overflow
                return precision.optimizer_step(optimizer, model=model, closure=_once(result, optimizer), **kwargs)
            if not self.reduced:
                optimizer.zero_grad(set_to_none=True)
                return result
            return precision.optimizer_step(optimizer, model=model, closure=_once(result, optimizer), **kwargs)

    def _scaled_update(self, precision: MixedPrecision, optimizer: Optimizer, result: Any, model: Any, finite: bool,
                       **kwargs: Any) -> Any:
        """Lightning's ``MixedPrecision`` step with its ``GradScaler``, after :meth:`unscale` and the average.

        A step skipped for a non-finite gradient on any rank still goes through ``scaler.step`` and
        ``scaler.update``, with the overflow recorded on every rank, so the scale backs off (and later grows) alike
        everywhere, as under ``ddp``."""
        assert isinstance(model, LightningModule) and precision.scaler is not None
        if not finite:  # no backward ran
            return result
        scaler = precision.scaler
        if not self.reduced:
            compat.mark_scaler_overflow(scaler, optimizer)
        compat.after_closure(precision, model, optimizer)  # on_before_optimizer_step and clipping, unscaled
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output
