"""A test-only callback that holds a run at a chosen update until the test lets it go: it creates ``<flag>.paused``
and waits for ``<flag>.go`` (at most ``timeout_s``), so that a test can start a second run while the first one is
live. Passed as ``+callbacks.pause._target_=tests.pause_at.PauseAt +callbacks.pause.flag=/tmp/x``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class PauseAt(pl.Callback):
    def __init__(self, flag: str, update: int = 1, timeout_s: float = 120.0) -> None:
        self.flag, self.update, self.timeout_s = Path(flag), update, timeout_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self.update:
            return
        self.flag.with_suffix(".paused").touch()
        deadline = time.monotonic() + self.timeout_s
        while not self.flag.with_suffix(".go").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
