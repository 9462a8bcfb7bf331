"""Training throughput as a metric: optimizer updates per second, validation and start-up excluded.

Lightning's ``ThroughputMonitor`` needs a batch-size function and FLOP counts; this one only counts updates,
so any stage can report its rate from config alone (printed as a JSON line at the end of training, and as
``time/updates_per_s`` among the trainer's metrics until the next validation resets them):
``+callbacks.step_timer._target_=dalle_lightning_callbacks.step_timer.StepTimer``.

It also keeps a *loss timeline*: at every validation, the update count, the training seconds since the first
update (validation excluded) and the validation loss, printed as one JSON line at the end (``timeline``), so a
benchmark can read the wall time a run needed to reach a given loss.
"""

from __future__ import annotations

import json
import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


class StepTimer(pl.Callback):
    """Seconds per update after ``skip`` warm-up updates, with time spent in validation subtracted."""

    def __init__(self, skip: int = 20, loss_key: str = "val/loss") -> None:
        if skip < 0:
            raise ValueError(f"skip={skip}, expected a non-negative number of warm-up updates")
        self.skip = skip
        self._start: float | None = None
        self._start_step = 0
        self._paused = 0.0
        self._val_start: float | None = None
        self.updates_per_s: float | None = None
        self.loss_key = loss_key
        self.timeline: list[dict[str, float]] = []  # {"step", "train_s", "loss"} at each validation
        self._fit_start: float | None = None
        self._fit_paused = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start, self._fit_paused, self.timeline = time.perf_counter(), 0.0, []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is None and trainer.global_step >= self.skip:
            self._start, self._start_step, self._paused = time.perf_counter(), trainer.global_step, 0.0

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None:
            spent = time.perf_counter() - self._val_start
            if self._start is not None:
                self._paused += spent
            if self._fit_start is not None and not trainer.sanity_checking:
                self._fit_paused += spent
                loss = trainer.callback_metrics.get(self.loss_key)
                if loss is not None:
                    self.timeline.append({"step": trainer.global_step, "loss": float(loss),
                                          "train_s": self._val_start - self._fit_start - self._fit_paused + spent})
        self._val_start = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.timeline:
            print(json.dumps({"timeline": [{k: round(v, 4) for k, v in point.items()} for point in self.timeline]}))
        if self._start is None or trainer.global_step <= self._start_step:
            return
        seconds = time.perf_counter() - self._start - self._paused
        rate = (trainer.global_step - self._start_step) / max(seconds, 1e-9)
        self.updates_per_s = rate
        trainer.callback_metrics["time/updates_per_s"] = torch.tensor(rate)
        if trainer.is_global_zero:
            print(json.dumps({"updates_per_s": round(rate, 3), "updates": trainer.global_step - self._start_step}))
