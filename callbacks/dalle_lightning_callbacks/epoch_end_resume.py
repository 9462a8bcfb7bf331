"""Resuming from a checkpoint taken after the last batch of an epoch, when the training loader has no length.

A streamed (iterable) data set cannot say how many batches an epoch has, so Lightning's ``num_training_batches``
is infinite. Resuming from a checkpoint taken after an update (``ModelCheckpoint(every_n_train_steps=...)``) that
happened to end an epoch, Lightning moves on to the next epoch, as it should, but it only resets the epoch's batch
counters when the finished epoch's count reaches ``num_training_batches``: never, here. The new epoch then starts
at batch index N (the finished epoch's length), its gradient accumulation windows are shifted by N, and the epoch's
start hooks are skipped. An uninterrupted run starts the epoch at batch 0.

This callback finishes the restart as Lightning does for a loader with a length: at the start of the resumed fit
it completes the last batch, resets the epoch's batch, scheduler and optimizer counters, and clears the restart
stages so the new epoch starts (and counts itself, and calls its hooks) like any other.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from typing_extensions import override


class EpochEndResume(pl.Callback):
    """Resume from an epoch's last batch at the next epoch's first, with an unsized training loader."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        at_epoch_end = epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch
        if not (at_epoch_end and fit_loop.restarted_mid_epoch and math.isinf(trainer.num_training_batches)):
            return
        # What Lightning's epoch loop does when ``batch_progress.current.completed >= num_training_batches``.
        epoch_loop.batch_progress.increment_completed()
        epoch_loop.batch_progress.reset_on_run()
        epoch_loop.scheduler_progress.reset_on_run()
        epoch_loop.automatic_optimization.optim_progress.reset_on_run()
        epoch_loop.val_loop.batch_progress.total.reset()
        # The fit loop has already moved to the next epoch: start it as a fresh one, not as a restarted one.
        epoch_loop.reset_restart_stage()
        fit_loop.reset_restart_stage()
