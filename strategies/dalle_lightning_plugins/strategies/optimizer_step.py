"""The optimizer step of the sharding strategies: the inter-node average between the backward and the update.

A mixin of :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy` (it reads the
strategy's ``inter_node``, ``precision_plugin``, ``lightning_module`` and the step's flags ``_reduced``,
``_overlapped`` and ``_backward_start``, which its ``backward`` sets). Lightning runs the closure (forward and
backward) inside the precision plugin's ``optimizer_step``; here it runs first, so that the average over the nodes
(PowerSGD) and the skip decision sit between the backward and the update, for each of the three kinds of precision:
Lightning's ``MixedPrecision`` with a ``GradScaler``, a plugin that unscales per group (``UnscalingPrecision``),
and any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.protocol import UnscalingPrecision

if TYPE_CHECKING:
    import lightning.pytorch as pl


class AveragedOptimizerStep:
    """``optimizer_step`` with the inter-node average and the skip of a non-finite update (see the module)."""

    inter_node: Any
    _exchange: Any
    _reduced: bool | None
    _overlapped: bool
    _backward_start: float

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        start = time.perf_counter()
        output = self._optimizer_step(optimizer, closure, model, **kwargs)
        if self._exchange is not None:  # overlap="auto": every update's time, for the choice of path
            self.inter_node.choice.record(time.perf_counter() - start, self._overlapped, self.root_device)
        return output

    def _optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                        model: pl.LightningModule | nn.Module | None, **kwargs: Any) -> Any:
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
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)  # type: ignore[misc]
        if not self._take_reduction():
            optimizer.zero_grad(set_to_none=True)
            return result
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)  # type: ignore[misc]

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
            compat.mark_scaler_overflow(scaler, optimizer)
        compat.after_closure(precision, model, optimizer)  # on_before_optimizer_step and clipping, unscaled
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return output

    def reduce_gradients(self) -> bool:
        """Average every local gradient shard over the replicate axis; False means skip the step (every rank).

        Called once per optimizer step after the (final) backward, when FSDP has already averaged over the node.
        """
        assert self.lightning_module is not None
        ok = self.inter_node.reduce(self.lightning_module, self.root_device, since=self._backward_start)
        self.inter_node.log_stats(self.lightning_module.trainer)
        return ok

    def _take_reduction(self) -> bool:
        """The result of this step's inter-node average: the one the backward ran, or run it now."""
        reduced, self._reduced = self._reduced, None
        return self.reduce_gradients() if reduced is None else reduced
