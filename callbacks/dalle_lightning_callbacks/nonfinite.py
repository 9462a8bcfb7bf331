"""Skip updates whose loss or gradients are NaN or Inf, count them, and stop a run that mostly skips.

Without it one NaN batch under ``bf16-mixed`` or ``32-true`` turns every parameter into NaN: AdamW applies the NaN
gradient, and the run ends normally with a NaN model. Lightning's own AMP scaler skips such updates only under
``16-mixed``.

How the skip works: ``on_before_optimizer_step`` runs after the (last) backward and before ``optimizer.step`` under
every built-in precision (inside the optimizer's closure for ``32-true``). A flagged update has its gradients set
to ``None``, and torch optimizers leave parameters without a gradient untouched: no step, no moment update, no
weight decay. The decision is agreed across ranks, so sharded gradients skip together.

A precision plugin that skips non-finite updates itself (``dalle_lightning_plugins.precision.resblock_precision``: ``scales.skipped`` out
of ``scales.updates``) is read instead of checked again; so is a strategy's own count of skipped reductions
(``powersgd.stats.skipped_steps``), which never reaches ``on_before_optimizer_step``.

A run whose skipped share exceeds ``max_skipped_share`` (after ``min_attempts`` updates, and at the end of training)
raises :class:`TrainingDiverged` with one line: most of its updates were lost, so its weights are not a trained
model. The counts are logged as ``train/skipped_updates`` and kept in checkpoints.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override


class TrainingDiverged(FloatingPointError):
    """Too many updates had non-finite losses or gradients: the run's weights are not a trained model."""


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def nonfinite_flag(tensors: list[Tensor], device: torch.device | None = None) -> Tensor:
    """A 0-d bool tensor (on ``device``, else the first tensor's), True if some tensor holds NaN or Inf: one norm
    per device and dtype group, no host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    target = device or (tensors[0].device if tensors else torch.device("cpu"))
    flag = torch.zeros((), dtype=torch.bool, device=target)
    for ts in groups.values():
        flag = flag | (~torch.stack(torch._foreach_norm(ts)).isfinite().all()).to(target)
    return flag


def _plugin_counts(trainer: pl.Trainer) -> tuple[int, int] | None:
    """(skipped, attempts) of a precision plugin that filters non-finite updates itself, else None."""
    scales = getattr(trainer.precision_plugin, "scales", None)
    if scales is None or not hasattr(scales, "skipped") or not hasattr(scales, "updates"):
        return None
    return int(scales.skipped), int(scales.updates)


def _strategy_skips(trainer: pl.Trainer) -> int:
    """Updates a strategy skipped before the precision plugin saw them (PowerSGD's non-finite reductions)."""
    stats = getattr(getattr(trainer.strategy, "powersgd", None), "stats", None)
    return int(getattr(stats, "skipped_steps", 0) or 0)


class NonFiniteGuard(pl.Callback):
    """Skips and counts updates with a non-finite loss or gradient; stops when they exceed a share of the run."""

    def __init__(self, max_skipped_share: float = 0.5, min_attempts: int = 20) -> None:
        if not 0.0 <= max_skipped_share <= 1.0:
            raise ValueError(f"max_skipped_share={max_skipped_share}; expected a share in [0, 1]")
        if min_attempts < 1:
            raise ValueError(f"min_attempts={min_attempts}; expected a positive number of updates")
        self.max_skipped_share, self.min_attempts = max_skipped_share, min_attempts
        self.skipped = 0  # updates this callback skipped, plus those the strategy skipped itself
        self.attempts = 0  # optimizer steps tried
        self._bad_loss: Tensor | None = None
        self._last_step = 0
        self._strategy_seen = 0

    def counts(self, trainer: pl.Trainer) -> tuple[int, int]:
        """(skipped, attempts) so far, from the precision plugin when it keeps them."""
        return _plugin_counts(trainer) or (self.skipped, self.attempts)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._strategy_seen = _strategy_skips(trainer)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()  # kept on the device: checked once per update, not per batch
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        bad_loss, self._bad_loss = self._bad_loss, None
        if _plugin_counts(trainer) is not None or getattr(trainer.strategy, "skips_nonfinite_updates", False):
            return  # the plugin or the strategy has checked (and skips) this update
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        flag = nonfinite_flag([_local(p.grad) for p in params], bad_loss.device if bad_loss is not None else None)
        bad = bool(flag | bad_loss if bad_loss is not None else flag)  # the update's one host read
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            for p in params:
                p.grad = None
            self.skipped += 1

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # inside a gradient accumulation window: no update was tried
        self._bad_loss = None  # this window is over, also when a strategy skipped it before our check ran
        self.attempts += trainer.global_step - self._last_step
        self._last_step = trainer.global_step
        strategy_skips = _strategy_skips(trainer)
        self.skipped += strategy_skips - self._strategy_seen
        self._strategy_seen = strategy_skips
        skipped, attempts = self.counts(trainer)
        pl_module.log("train/skipped_updates", float(skipped), on_step=True, on_epoch=False, rank_zero_only=True)
        if attempts >= self.min_attempts:
            self._check(skipped, attempts)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        skipped, attempts = self.counts(trainer)
        if attempts:
            self._check(skipped, attempts)

    def _check(self, skipped: int, attempts: int) -> None:
        if skipped / attempts > self.max_skipped_share:
            raise TrainingDiverged(
                f"{skipped} of {attempts} updates had a NaN or Inf loss or gradient and were skipped, more than "
                f"max_skipped_share={self.max_skipped_share}; expected a stable run (lower the learning rate, "
                f"check the data)"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "attempts": self.attempts}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.attempts = int(state_dict.get("attempts", 0))
