"""Log the data module's skipped shards and samples as metrics, summed over ranks.

Protocol: the data module has ``skip_counts() -> dict[str, int]`` with the same reasons, in the same order, on every
rank (the counts of that rank's process and its loader workers). Every ``every_n_steps`` updates and at the end of
training the counts are summed over ranks (one all-reduce; every rank takes part, at the same update) and rank 0
logs ``data/skipped/<reason>`` and ``data/skipped_total``: a skip never stops training, but it shows in the logs.
A data module that also has ``conversion_counts() -> dict[str, int]`` (images decoded with a conversion: alpha
composited, EXIF-turned, ...) gets ``data/converted/<name>`` logged the same way. The last totals stay in
``totals`` for the run's summary.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


def metric_name(reason: str, group: str = "skipped") -> str:
    """``"caption is not UTF-8"`` -> ``"data/skipped/caption_is_not_utf_8"``."""
    return f"data/{group}/" + re.sub(r"\W+", "_", reason.lower()).strip("_")


class SkippedSampleMetrics(pl.Callback):
    """Sums ``trainer.datamodule.skip_counts()`` over ranks and logs it (rank 0) every ``every_n_steps`` updates."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}; expected a positive number of updates or null")
        self.every_n_steps = every_n_steps
        self._logged_step = -1
        self.totals: dict[str, float] = {}  # the last metrics logged (rank 0), for the run's summary

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        counts_of = getattr(trainer.datamodule, "skip_counts", None)
        if not callable(counts_of) or trainer.global_step == self._logged_step:
            return
        self._logged_step = trainer.global_step
        counts: dict[str, int] = counts_of()
        names = [metric_name(k) for k in counts]
        values = list(counts.values())
        converted_of = getattr(trainer.datamodule, "conversion_counts", None)
        if callable(converted_of):
            converted: dict[str, int] = converted_of()
            names += [metric_name(k, "converted") for k in converted]
            values += list(converted.values())
        local = torch.tensor(values, dtype=torch.float64, device=pl_module.device)
        total = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        if not trainer.is_global_zero:
            return
        metrics: dict[str, Any] = dict(zip(names, total.tolist()))
        metrics["data/skipped_total"] = float(total[: len(counts)].sum())
        self.totals = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps or 50
        if trainer.global_step % every == 0:
            self._log(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)
