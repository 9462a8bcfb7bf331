"""Checkpoints paced by time as well as by updates, with no collective per update.

A restarted run loses the work since its last checkpoint, so the interval that matters is wall time: 500 updates
are minutes on a GPU and an hour on 2 CPU cores. Lightning's ``ModelCheckpoint(train_time_interval=...)`` paces by
time but broadcasts rank 0's decision after every update (one collective per update over the slow link between
nodes, which ``strategy=local_steps`` exists to avoid), and refuses to combine with ``every_n_train_steps``.

:class:`PacedCheckpoint` is ``ModelCheckpoint`` with ``every_n_minutes`` besides ``every_n_train_steps``. The ranks
decide together only at *decision updates*, known to all: at one, rank 0 broadcasts whether the interval has
passed since the last checkpoint and how many updates from now the next decision falls (the time left over its
measured time per update). A steady run makes a few decisions per interval, and a checkpoint by time lands within
one update of its time. Every rank writes its own shards under the sharded strategies (no gather), as every save
of ``ModelCheckpoint`` does there.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class PacedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves once ``every_n_minutes`` of training passed since its last save.

    ``every_n_minutes``: None (or 0) paces by updates only, as ``ModelCheckpoint``. Every other argument is
    ``ModelCheckpoint``'s (``train_time_interval`` excepted: this replaces it).
    """

    MARGIN = 0.8  # a decision plans this share of the time left: about 4 decisions per interval at a steady rate

    def __init__(self, *args: Any, every_n_minutes: float | None = None, **kwargs: Any) -> None:
        if kwargs.get("train_time_interval") is not None:
            raise ValueError("PacedCheckpoint(train_time_interval=...); expected every_n_minutes (it paces without a "
                             "collective per update, and combines with every_n_train_steps)")
        if every_n_minutes is not None and (not isinstance(every_n_minutes, (int, float)) or every_n_minutes < 0):
            raise ValueError(f"every_n_minutes={every_n_minutes!r}; expected null or a number of minutes >= 0")
        super().__init__(*args, **kwargs)
        self.every_n_minutes = float(every_n_minutes) if every_n_minutes else None
        self._next_decision: int | None = None  # the update at which the ranks decide next
        self._decided_at: tuple[int, float] | None = None  # (update, time) of the last decision, rank 0's clock
        self._saved_at = time.monotonic()  # rank 0's clock: the last save, or the start of this fit

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._saved_at = time.monotonic()  # a resumed run starts at its checkpoint: no work to lose yet
        self._next_decision = trainer.global_step + 1  # the first decision measures one update
        self._decided_at = (trainer.global_step, self._saved_at)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        before = self._last_global_step_saved
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved != before:  # saved by updates: the time interval starts again
            self._saved_at = time.monotonic()
        if self.every_n_minutes is None or self._next_decision is None or trainer.global_step < self._next_decision:
            return
        save, gap = trainer.strategy.broadcast(self._decide(trainer.global_step))
        self._next_decision = trainer.global_step + gap
        if save and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.monitor is None or self.monitor in candidates:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._saved_at = time.monotonic()

    def _decide(self, step: int) -> tuple[bool, int]:
        """Rank 0's decision at update ``step``: save now, and the updates until the next decision (at least 1;
        ``MARGIN`` of the updates that fit in the time left at the rate since the last decision, so a run that
        slows down is caught near the end of the interval)."""
        now = time.monotonic()
        assert self.every_n_minutes is not None and self._decided_at is not None
        last_step, last_time = self._decided_at
        per_update = max((now - last_time) / max(step - last_step, 1), 1e-6)
        self._decided_at = (step, now)
        interval = self.every_n_minutes * 60.0
        save = now - self._saved_at >= interval
        left = interval if save else interval - (now - self._saved_at)
        return save, max(1, math.floor(left / per_update * self.MARGIN))
