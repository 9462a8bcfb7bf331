"""Gradient clipping that works with fused optimizers under Lightning's mixed precision.

The stage configs use ``torch.optim.AdamW(fused=True)``: one kernel for every parameter instead of a dozen
per-tensor operations, a visible share of a small model's step. Lightning's ``MixedPrecision`` plugin
(``bf16-mixed`` and ``16-mixed``) refuses to clip for any optimizer that can unscale gradients inside its step,
because under a ``GradScaler`` the gradients it would clip are still scaled. Unscaling them first (as
``GradScaler.unscale_`` allows; the fused step then skips its own unscale) makes clipping exact again, and with no
scaler (bf16) there is nothing to unscale at all.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override


class FusedOptimizerClipping(pl.LightningModule):
    """Mixin for LightningModules whose optimizer may be fused: clip the true gradients under ``MixedPrecision``."""

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        precision = self.trainer.precision_plugin
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)  # Lightning left its gradients scaled
        if not gradient_clip_val or not fused or not isinstance(precision, MixedPrecision):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if precision.scaler is not None:
            precision.scaler.unscale_(optimizer)
        # The gradients are true now: Lightning's own clipping, without MixedPrecision's refusal in front of it.
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        Precision.clip_gradients(precision, optimizer, gradient_clip_val, algorithm)
