"""Shared pieces of the strategy tests: a tiny residual model, its LightningModule, and process setup.

Every distributed test runs real gloo processes on 127.0.0.1 through ``tests/helpers/distributed.py``; inside
them Lightning sees ``LOCAL_RANK``/``NODE_RANK`` and treats the processes as externally launched (one
Lightning node of 4 devices), while the strategy's ``devices_per_node=2`` makes the mesh 2 simulated nodes x 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, WIDTH, SEQ = 11, 6, 4


class Branch(nn.Module):
    """A residual branch: the parent adds its output to the identity path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TinyResNet(nn.Module):
    """Embedding -> n residual branches -> unembedding; declares its branches through ``resblocks()``."""

    def __init__(self, n_blocks: int = 3, vocab: int = VOCAB, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Branch(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, vocab)

    def resblocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def token_dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


class TinyModule(L.LightningModule):
    """The project's convention: the plain model and an optimizer factory come in through the constructor."""

    def __init__(self, model: nn.Module, optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.model, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())


def external_launch_env(rank: int) -> None:
    """What a cluster launcher would set: Lightning then joins the existing process group instead of spawning."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")


def trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def loader(dataset: TensorDataset, rank: int, batch_size: int = 2, world_size: int = 4) -> DataLoader:
    """Rank ``rank`` reads items rank, rank + world_size, ... in order (Lightning's own sampler would shuffle)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def reference_sgd(steps: int, lr: float, world_size: int, batch_size: int = 2) -> dict[str, torch.Tensor]:
    """Exact data parallelism in one process: SGD on the union of every rank's batches (``loader`` gives rank r
    the items r, r + world_size, ...), from ``torch.manual_seed(0)``'s ``TinyResNet``; named as in ``TinyModule``."""
    torch.manual_seed(0)
    model = TinyResNet()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tokens, targets = token_dataset().tensors
    per_step = batch_size * world_size
    for step in range(steps):
        idx = torch.arange(step * per_step, (step + 1) * per_step)
        opt.zero_grad()
        loss_fn(model, tokens[idx], targets[idx]).backward()
        opt.step()
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def layout_strategy(layout: str, world: int = 4) -> Any:
    """``ddp`` (gloo), the strategy at one node of ``world`` ("one node"), or at 2 devices per node with PowerSGD at
    full rank for this file's models (every matrix has a side of at most ``2 * WIDTH``), the overlapped exchange
    forced ("overlap") or chosen ("auto")."""
    from lightning.pytorch.strategies import DDPStrategy

    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    if layout == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if layout == "one node":
        return ShardedPowerSGDStrategy(devices_per_node=world, timeout=120)
    return ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=2 * WIDTH, min_compression=0.0, timeout=120,
                                   overlap=True if layout == "overlap" else "auto")
