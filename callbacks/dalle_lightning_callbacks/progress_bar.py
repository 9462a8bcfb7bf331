"""Lightning's progress bar showing training values read back at the logging interval, not at every update.

A value logged with ``prog_bar=True`` is turned into a Python number (``.item()``) by Lightning at the end of every
training batch, whether or not the bar redraws: one host read per value per update, and on a GPU each read waits
for the device's queue to drain. So the training steps log their values for the loggers only, and this bar shows
the ``show`` keys among them, reading them back on the updates where Lightning also writes the loggers
(``log_every_n_steps``) and keeping them until the next interval. Validation values keep ``prog_bar=True``: they
are epoch means, read once at the epoch's end. ``IntervalProgressBar(...)`` is the kind Lightning would pick itself
(Rich where it is installed, tqdm elsewhere).

What it shows: a run bounded by ``max_steps`` counts updates, ``global_step/max_steps`` over the whole run (a
streamed data set has no length, so an epoch's total is unknown, and ``max_epochs=-1`` is no total either), as
``Epoch N`` (``/M`` only where ``max_epochs`` bounds the run); the logger's version (``v_num``) is left out.

Where standard output is not a terminal (a log file, a batch job: ``lines=None``), the bar is off, since a file
gets its redraws as carriage returns (and Rich's nothing until the end), and each logging interval
(``trainer.log_every_n_steps``) prints one line instead,
``step 120/1000 | train/loss 0.123 | 3.4 updates/s | eta 4m``, with the values the bar would read there; each
validation prints its ``val/`` values in one line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n

DEFAULT_SHOW = ("train/loss", "train/acc", "train/neg_acc")


def max_steps(trainer: pl.Trainer) -> int | None:
    """The run's length in updates where ``max_steps`` bounds it, else None."""
    steps = trainer.max_steps
    return steps if steps is not None and steps > 0 else None


def duration(seconds: float) -> str:
    """``45s``, ``4m``, ``2h05m``."""
    if round(seconds) < 60:
        return f"{round(seconds)}s"
    if round(seconds / 60) < 60:
        return f"{round(seconds / 60)}m"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


class _ShowAtLogInterval:
    """``get_metrics`` of a Lightning bar plus the ``show`` keys, read back only at the logging interval; the lines
    that replace the bar where standard output is not a terminal."""

    def _init_show(self, show: Sequence[str], lines: bool | None = None) -> None:
        self.show = tuple(show)
        self.lines = lines  # None: where standard output is not a terminal
        self._lines = False
        self._shown: dict[str, float] = {}
        self._step_at_batch_start = -1
        self._last_line: tuple[int, float] = (0, 0.0)  # (update, time) of the last line, or of the start
        self._fit_start: tuple[int, float] = (0, 0.0)  # (update, time) where this fit's training began

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        metrics.pop("v_num", None)  # the logger's version: not a value of the run
        if not trainer.training or trainer._logger_connector.should_update_logs or not self._shown:
            self._read_shown(trainer)
        return {**self._shown, **metrics}

    def _read_shown(self, trainer: pl.Trainer) -> None:
        values = trainer.callback_metrics
        self._shown = {key: float(values[key]) for key in self.show if key in values}

    @property
    def total_train_batches(self) -> int | float:
        """The run's ``max_steps`` where it bounds the run (the bar counts updates), else Lightning's total."""
        steps = max_steps(self.trainer)  # type: ignore[attr-defined]
        return steps if steps is not None else super().total_train_batches  # type: ignore[misc]

    def _description(self, trainer: pl.Trainer) -> str:
        bounded = trainer.max_epochs is not None and trainer.max_epochs > 0
        return f"Epoch {trainer.current_epoch}" + (f"/{trainer.max_epochs - 1}" if bounded else "")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        self._lines = not sys.stdout.isatty() if self.lines is None else bool(self.lines)
        if self._lines:
            self.disable()  # type: ignore[attr-defined]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]
        self._last_line = self._fit_start = (trainer.global_step, time.monotonic())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)  # type: ignore[misc]
        self._step_at_batch_start = trainer.global_step

    def _after_train_batch(self, trainer: pl.Trainer) -> None:
        """The line of a logging interval: at the update that ends it (not inside an accumulation window); and at
        the fit's first update a line that reads nothing, so that a log shows at once that training runs."""
        if not (self._lines and trainer.is_global_zero and trainer.global_step != self._step_at_batch_start):
            return
        if trainer._logger_connector.should_update_logs:
            self._read_shown(trainer)
            self._print_line(trainer)
        elif self._step_at_batch_start == self._last_line[0] == self._fit_start[0]:
            total = max_steps(trainer)
            print(f"step {trainer.global_step}" + (f"/{total}" if total else "") + " | first update done, "
                  f"{duration(time.monotonic() - self._fit_start[1])} after training started", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        if self._lines and trainer.is_global_zero and trainer.global_step != self._last_line[0]:
            self._read_shown(trainer)  # the run's last values, once
            self._print_line(trainer)

    def _print_line(self, trainer: pl.Trainer) -> None:
        step, now = trainer.global_step, time.monotonic()
        last_step, last_time = self._last_line
        total = max_steps(trainer)
        parts = [f"step {step}/{total}" if total else f"step {step} (epoch {trainer.current_epoch})"]
        parts += [f"{key} {value:.4g}" for key, value in self._shown.items()]
        rate = (step - last_step) / (now - last_time) if step > last_step and now > last_time else None
        if rate:
            parts.append(f"{rate:.3g} updates/s")
            if total and total > step:
                parts.append(f"eta {duration((total - step) / rate)}")
        self._last_line = (step, now)
        print(" | ".join(parts), flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)  # type: ignore[misc]
        if not self._lines or not trainer.is_global_zero or trainer.sanity_checking:
            return
        values = {k: v for k, v in trainer.callback_metrics.items()
                  if k.startswith("val/") and (not hasattr(v, "numel") or v.numel() == 1)}
        if values:  # epoch means, read once per validation
            print(" | ".join([f"validation at step {trainer.global_step}"]
                             + [f"{k} {float(v):.4g}" for k, v in values.items()]), flush=True)


class IntervalTQDMProgressBar(_ShowAtLogInterval, TQDMProgressBar):
    """``TQDMProgressBar`` showing ``show`` at the logging interval, counting updates in a step-bounded run."""

    def __init__(self, show: Sequence[str] = DEFAULT_SHOW, lines: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_show(show, lines)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        total = max_steps(trainer)
        if total is None:
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if bar.total != total:  # the fit's first epoch: one bar over all its updates, kept over the epochs
            bar.reset(total=total)
            bar.initial = 0
            _update_n(bar, trainer.global_step)
        bar.set_description(self._description(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if max_steps(trainer) is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif self.train_progress_bar is not None and self._should_update(trainer.global_step,
                                                                         self.train_progress_bar.total):
            _update_n(self.train_progress_bar, trainer.global_step)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        self._after_train_batch(trainer)


class IntervalRichProgressBar(_ShowAtLogInterval, RichProgressBar):
    """``RichProgressBar`` showing ``show`` at the logging interval, counting updates in a step-bounded run."""

    def __init__(self, show: Sequence[str] = DEFAULT_SHOW, lines: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_show(show, lines)

    def _get_train_description(self, current_epoch: int) -> str:
        description = self._description(self.trainer)
        return f"{description:{len(self.validation_description)}}"  # as wide as Validation: no flicker

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if max_steps(trainer) is None:
            super().on_train_epoch_start(trainer, pl_module)
            return
        if self.is_disabled or self.progress is None:
            return
        description = self._get_train_description(trainer.current_epoch)
        if self.train_progress_bar_id is None:  # one task over all the fit's updates, kept over the epochs
            self.train_progress_bar_id = self._add_task(self.total_train_batches, description)
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
        else:
            styled = f"[{self.theme.description}]{description}" if self.theme.description else description
            self.progress.update(self.train_progress_bar_id, description=styled)
        self.refresh()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if max_steps(trainer) is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif not self.is_disabled:
            if self.train_progress_bar_id is None:  # a fit resumed in the middle of an epoch
                self._initialize_train_progress_bar_id()
                self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
            self._update(self.train_progress_bar_id, trainer.global_step)
            self._update_metrics(trainer, pl_module)
            self.refresh()
        self._after_train_batch(trainer)


def IntervalProgressBar(  # noqa: N802 - a class in configs
        show: Sequence[str] = DEFAULT_SHOW, lines: bool | None = None, **kwargs: Any) -> ProgressBar:
    """The bar Lightning would pick (Rich where installed, else tqdm), showing ``show`` at the logging interval;
    ``lines`` (None: where standard output is not a terminal) prints a line per logging interval instead."""
    cls = IntervalRichProgressBar if _RICH_AVAILABLE else IntervalTQDMProgressBar
    return cls(show, lines, **kwargs)
