"""A resumed run starts every rank from rank 0's buffers, as every ``ddp`` rank loads rank 0's file: batch-norm
running statistics follow each rank's own batches, so the ranks' copies differ when the checkpoint is written, and
DCP alone keeps one copy of a key that every rank saves, not necessarily rank 0's.

2 simulated nodes x 2 devices; a tiny residual model with a batch norm; each rank reads its own samples.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer

DATA = token_dataset(n=4 * 2 * 3)  # 4 ranks x batch 2 x 3 steps


class NormedResNet(TinyResNet):
    """TinyResNet with a batch norm over the width before the head: running statistics in buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(self.head.in_features)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


def _fit(rank: int, seed: int, checkpoint: str, ckpt_path: str | None = None):
    torch.manual_seed(seed)
    module = TinyModule(NormedResNet(), functools.partial(torch.optim.SGD, lr=0.1))
    fmt = "sharded" if checkpoint == "dcp" else "full"
    fit_trainer = trainer(ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=1, checkpoint_format=fmt),
                          max_epochs=1)
    fit_trainer.fit(module, loader(DATA, rank), ckpt_path=ckpt_path)
    return fit_trainer, module


def _worker(rank: int, world_size: int, ckpt: str, checkpoint: str) -> dict[str, torch.Tensor]:
    external_launch_env(rank)
    first, module = _fit(rank, 0, checkpoint)
    first.save_checkpoint(ckpt)
    saved = {n: b.clone() for n, b in module.named_buffers()}
    _, resumed = _fit(rank, 1, checkpoint, ckpt_path=ckpt)  # nothing left to train: only the load runs
    return {"saved": saved, "resumed": {n: b.clone() for n, b in resumed.named_buffers()}}


@pytest.mark.slow  # spawns gloo processes
@pytest.mark.distributed
@pytest.mark.parametrize("checkpoint", ["ckpt", "dcp"])
def test_every_rank_resumes_from_rank_0s_buffers(tmp_path: Path, checkpoint: str) -> None:
    results = run_distributed(_worker, 4, str(tmp_path / "ckpt"), checkpoint, timeout=240)
    mean = "model.norm.running_mean"
    assert not torch.equal(results[0]["saved"][mean], results[1]["saved"][mean]), "ranks saw the same batches"
    for rank, r in enumerate(results):
        for name, want in results[0]["saved"].items():
            assert torch.equal(r["resumed"][name], want), f"rank {rank}: {name}"
