"""Lightning's progress bar showing training values read back at the logging interval, not at every update.

A value logged with ``prog_bar=True`` is turned into a Python number (``.item()``) by Lightning at the end of every
training batch, whether or not the bar redraws: one host read per value per update, and on a GPU each read waits
for the device's queue to drain. So the training steps log their values for the loggers only, and this bar shows
the ``show`` keys among them, reading them back on the updates where Lightning also writes the loggers
(``log_every_n_steps``) and keeping them until the next interval. Validation values keep ``prog_bar=True``: they
are epoch means, read once at the epoch's end. ``IntervalProgressBar(...)`` is the kind Lightning would pick itself
(Rich where it is installed, tqdm elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

DEFAULT_SHOW = ("train/loss", "train/acc", "train/neg_acc")


class _ShowAtLogInterval:
    """``get_metrics`` of a Lightning bar plus the ``show`` keys, read back only at the logging interval."""

    def _init_show(self, show: Sequence[str]) -> None:
        self.show = tuple(show)
        self._shown: dict[str, float] = {}

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        if not trainer.training or trainer._logger_connector.should_update_logs or not self._shown:
            values = trainer.callback_metrics
            self._shown = {key: float(values[key]) for key in self.show if key in values}
        return {**self._shown, **metrics}


class IntervalTQDMProgressBar(_ShowAtLogInterval, TQDMProgressBar):
    """``TQDMProgressBar`` showing ``show`` at the logging interval."""

    def __init__(self, show: Sequence[str] = DEFAULT_SHOW, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_show(show)


class IntervalRichProgressBar(_ShowAtLogInterval, RichProgressBar):
    """``RichProgressBar`` showing ``show`` at the logging interval."""

    def __init__(self, show: Sequence[str] = DEFAULT_SHOW, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_show(show)


def IntervalProgressBar(show: Sequence[str] = DEFAULT_SHOW, **kwargs: Any) -> ProgressBar:  # noqa: N802 - a class in configs
    """The bar Lightning would pick (Rich where installed, else tqdm), showing ``show`` at the logging interval."""
    cls = IntervalRichProgressBar if _RICH_AVAILABLE else IntervalTQDMProgressBar
    return cls(show, **kwargs)
