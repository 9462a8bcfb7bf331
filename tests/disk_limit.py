"""A test-only callback that makes the disk "full" for its own process from a chosen update on: it lowers the
process's file-size limit (``RLIMIT_FSIZE``) so that the kernel fails every write past ``max_bytes`` of a file, as a
full disk fails a write (``EFBIG`` instead of ``ENOSPC``; ``SIGXFSZ`` ignored, so the write returns the error).

Passed on the command line as ``+callbacks.disk_full._target_=tests.disk_limit.DiskFullAt +callbacks.disk_full.update=3``.
"""

from __future__ import annotations

import resource
import signal
from typing import Any

import lightning.pytorch as pl


class DiskFullAt(pl.Callback):
    """From the end of update ``update`` on, no file of this process can grow past ``max_bytes``."""

    def __init__(self, update: int, max_bytes: int = 4096) -> None:
        self.update, self.max_bytes = update, max_bytes

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.update:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
