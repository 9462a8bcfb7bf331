"""A test-only callback that SIGKILLs its own process at a chosen point of training, as a crash or a preemption
would: no exception, no teardown, no last checkpoint. Every rank of a distributed run kills itself at the same
point (ranks train in lockstep), and never its process group, which may hold the test itself.

Passed on the command line as ``+callbacks.killer._target_=tests.kill_at.KillAt +callbacks.killer.update=7``;
``rank`` kills that global rank only, ``attempt`` only in that attempt of a restarting launcher (torchrun's
``TORCHELASTIC_RESTART_COUNT``), so the restarted worker lives.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl


class KillAt(pl.Callback):
    """SIGKILL before micro-batch ``micro_batch`` (0-based) of the accumulation window that follows update
    ``update``: ``micro_batch=1`` with ``accumulate_grad_batches=2`` dies with a half-accumulated gradient."""

    def __init__(self, update: int, micro_batch: int = 0, rank: int | None = None, attempt: int | None = None) -> None:
        self.update, self.micro_batch, self.rank, self.attempt = update, micro_batch, rank, attempt

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if self.attempt is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.attempt:
            return  # a worker torchrun restarted runs past the point its predecessor died at
        in_window = (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % trainer.accumulate_grad_batches
        if trainer.global_step == self.update and in_window == self.micro_batch:
            os.kill(os.getpid(), signal.SIGKILL)
