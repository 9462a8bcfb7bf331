"""Sharded DCP checkpoints: save after epoch 1, resume, and land exactly where an uninterrupted run lands.

2 simulated nodes x 2 devices, PowerSGD rank 1 (so error buffers carry real state) and SGD with momentum (so the
optimizer carries state too). The resumed run starts from a *different* random init, so only a working load can
make it match. Also checks the logged inter-node statistics and the offline export of a full state dict.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import pytest
import torch
from tests.helpers.distributed import run_distributed
from lightning.pytorch.loggers import CSVLogger
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer

from dalle_lightning_plugins.io.dcp_checkpoint import checkpoint_to_full_state_dict
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

STEPS_PER_EPOCH = 3
DATA = token_dataset(n=4 * 2 * STEPS_PER_EPOCH)  # 4 ranks x batch 2 x 3 steps


def _fit(rank: int, seed: int, epochs: int, ckpt_path: str | None = None, logger: CSVLogger | None = None,
         fmt: str = "sharded", per_node: int = 2):
    torch.manual_seed(seed)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9))
    strategy = ShardedPowerSGDStrategy(devices_per_node=per_node, powersgd_rank=1, checkpoint_format=fmt)
    extra = dict(logger=logger, log_every_n_steps=1) if logger else {}
    fit_trainer = trainer(strategy, max_epochs=epochs, **extra)
    fit_trainer.fit(module, loader(DATA, rank), ckpt_path=ckpt_path)
    return fit_trainer, strategy


def _worker(rank: int, world_size: int, ckpt: str, log_dir: str, fmt: str, per_node: int) -> dict:
    external_launch_env(rank)
    _, straight = _fit(rank, seed=0, epochs=2, logger=CSVLogger(log_dir, name="", version=0), fmt=fmt, per_node=per_node)
    uninterrupted = straight.full_state_dict()

    first, half = _fit(rank, seed=0, epochs=1, fmt=fmt, per_node=per_node)
    first.save_checkpoint(ckpt)
    saved = half.full_state_dict()

    _, resumed = _fit(rank, seed=123, epochs=2, ckpt_path=ckpt, fmt=fmt, per_node=per_node)
    return {
        "uninterrupted": uninterrupted,
        "saved": saved,
        "resumed": resumed.full_state_dict(),
        "psgd_steps": resumed.powersgd.stats.steps,
    }


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
@pytest.mark.parametrize(("fmt", "per_node"), [("sharded", 2), ("full", 2), ("full", 1)])
def test_resume_matches_uninterrupted_run(tmp_path: Path, fmt: str, per_node: int) -> None:
    """2 nodes x 2 devices, or 4 nodes x 1 (the demo's layout), at PowerSGD rank 1: error buffers matter."""
    ckpt = tmp_path / "epoch1.ckpt"
    results = run_distributed(_worker, 4, str(ckpt), str(tmp_path / "logs"), fmt, per_node, timeout=240)
    r0 = results[0]

    assert set(r0["resumed"]) == set(r0["uninterrupted"])
    for name, want in r0["uninterrupted"].items():
        assert torch.equal(r0["resumed"][name], want), f"{name} differs after resume"
    assert any(not torch.equal(r0["saved"][n], r0["uninterrupted"][n]) for n in r0["saved"]), "epoch 2 changed nothing"
    assert [r["psgd_steps"] for r in results] == [2 * STEPS_PER_EPOCH] * 4  # PowerSGD's own state came back too

    # atomic write: the final directory (or file) only, no temporary leftovers
    assert sorted(p.name for p in tmp_path.iterdir() if "epoch1" in p.name) == ["epoch1.ckpt"]
    # the offline export reads the sharded checkpoint in this (non-distributed) process; a full one is a plain file
    exported = checkpoint_to_full_state_dict(ckpt) if fmt == "sharded" else torch.load(ckpt)["state_dict"]
    assert ckpt.is_dir() == (fmt == "sharded")
    assert set(exported) == set(r0["saved"])
    for name, want in r0["saved"].items():
        assert torch.equal(exported[name], want), name
    plain = TinyResNet()
    plain.load_state_dict({k.removeprefix("model."): v for k, v in exported.items()})

    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    sent = [float(r["powersgd/inter_node_bytes_per_rank"]) for r in rows if r.get("powersgd/inter_node_bytes_per_rank")]
    full = [float(r["powersgd/uncompressed_bytes_per_rank"]) for r in rows if r.get("powersgd/uncompressed_bytes_per_rank")]
    assert len(sent) == 2 * STEPS_PER_EPOCH
    assert all(0 < s < f for s, f in zip(sent, full)), (sent, full)
    print(f"rank-0 inter-node bytes per step: {sent[-1]:.0f} sent vs {full[-1]:.0f} uncompressed")
