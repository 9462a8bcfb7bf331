"""Bytes this node put on its network interface per update: the link's own count, the same for every strategy.

Reads ``/sys/class/net/<interface>/statistics/tx_bytes`` (headers included, as the link carries them) over the
updates after ``skip`` warm-up ones, validation included only when it runs in that window (benchmarks switch it
off). The interface defaults to ``GLOO_SOCKET_IFNAME``, the one gloo talks over. Kept as
``totals = {"link/tx_bytes_per_update": ...}`` at the end of training (``dalle-train`` adds it to metrics.json).

A tool to diagnose a link between nodes (docs/plugins.md): set against the strategy's own count of gradient bytes, it
shows what the link carries besides them. ``benchmarks/two_nodes.py`` adds it to every run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


def tx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


class LinkBytes(pl.Callback):
    def __init__(self, interface: str | None = None, skip: int = 20) -> None:
        self.interface = interface or os.environ.get("GLOO_SOCKET_IFNAME")
        if not self.interface or not Path(f"/sys/class/net/{self.interface}").exists():
            raise ValueError(f"interface={self.interface!r}: expected a network interface of this host "
                             "(set it, or GLOO_SOCKET_IFNAME)")
        self.skip = skip
        self._start: tuple[int, int] | None = None
        self.totals: dict[str, float] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is None and trainer.global_step >= self.skip:
            self._start = (trainer.global_step, tx_bytes(self.interface))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is None or trainer.global_step <= self._start[0]:
            return
        per_update = (tx_bytes(self.interface) - self._start[1]) / (trainer.global_step - self._start[0])
        self.totals = {"link/tx_bytes_per_update": per_update}
