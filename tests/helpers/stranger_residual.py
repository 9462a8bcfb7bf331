"""A stranger's residual model, as a Lightning user writes one: plain ``nn.Module`` blocks ``x + f(x)`` in a
LightningModule, nothing of this project's. It imports torch and Lightning only, so a process that cannot import
the plugins can unpickle it (``tests/test_strategy_leaves_module.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 16


class Block(nn.Module):
    """``x + f(x)``."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class Residual(L.LightningModule):
    """Three residual blocks between an input and an output layer; ``gain`` holds one number, which ``test_step``
    reads outside any forward (``self.gain.weight.item()``), as Lightning users do."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.out = nn.Linear(WIDTH, 1)
        self.gain = nn.Linear(1, 1, bias=False)
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain(self.out(self.blocks(self.inp(x))))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0]), batch[1])

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.seen.append(self.gain.weight.item())
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
