"""The project's own stages trained from the command line under the Strategy and the Precision plugin.

Each stage runs as a user types it: ``python -m dalle_lightning.cli.train stage=... strategy=sharded_powersgd
precision=resblock16 trainer.devices=4 strategy.devices_per_node=2`` (4 gloo processes = 2 simulated nodes x 2
devices, PowerSGD between the nodes), with every callback of its stage config (EMA, schedules, grids, FID and
contrastive score, checkpoints). The artifacts must be full state dicts that load into the plain models, and
``dalle-generate`` must use them unchanged.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_app

PLUGINS = ["strategy=sharded_powersgd", "strategy.devices_per_node=2", "trainer.devices=4", "precision=resblock16",
           "strategy.timeout=300", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
           "trainer.log_every_n_steps=2"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def train(work: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_lightning.cli.train", f"paths.work_dir={work}", *PLUGINS, *overrides],
        capture_output=True, text=True, timeout=600, env=env, cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def plain_artifact(path: Path) -> dict[str, torch.Tensor]:
    """The saved state dict: whole tensors (no DTensor, no shard), loadable by the plain model."""
    from dalle_lightning.artifacts import load_model, read_file

    state = read_file(path)["state_dict"]
    assert all(type(v) is torch.Tensor and torch.isfinite(v).all() for v in state.values())
    model = load_model(path)
    assert set(model.state_dict()) == set(state)
    return state


@pytest.mark.slow
@pytest.mark.distributed
def test_every_stage_trains_under_the_strategy_and_the_precision_plugin(tmp_path: Path) -> None:
    from dalle_lightning.cli import data, encode, generate
    from dalle_lightning.cli import train as train_app

    work = tmp_path
    run_app(data.main, f"paths.work_dir={work}", "n_train=128", "n_val=32", "n_zeroshot=8", "shard_size=64")
    run_app(train_app.main, "stage=tokenizer", f"paths.work_dir={work}")

    # dVAE in bf16: channels-last convolutions, the temperature and KL schedules, the EMA, reconstruction grids.
    train(work, "stage=dvae", "precision.dtype=bf16", "model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16",
          "data.batch_size=4", "trainer.max_steps=10", "callbacks.ema.update_starting_at_step=4",
          "callbacks.kl_weight.steps=5")
    dvae = plain_artifact(work / "dvae.pt")
    assert any(v.dim() == 4 for v in dvae.values())
    runs = sorted((work / "runs" / "dvae").iterdir())
    assert list(runs[-1].rglob("recon_*.png")), "no reconstruction grid"
    assert (runs[-1] / "checkpoints" / "last.ckpt" / ".metadata").is_file()  # a sharded checkpoint
    logged = (runs[-1] / "logs").rglob("metrics.csv")
    header = next(iter(logged)).read_text().splitlines()[0]
    assert "schedule/temperature" in header and "schedule/kl_weight" in header and "precision/skipped_updates" in header

    # The EMA vector-quantised dVAE: one codebook across the 4 processes (VQVAE.share_codebook), its own output.
    train(work, "stage=dvae", "model=dvae_vq", f"output={work / 'dvae_vq.pt'}", "precision.dtype=bf16",
          "model.n_hid=8", "model.vocab_size=32", "model.block_min_hidden=0", "data.batch_size=4",
          "trainer.max_steps=10", "callbacks.ema.update_starting_at_step=4")
    assert "quantizer._codebook.embed" in plain_artifact(work / "dvae_vq.pt")

    run_app(encode.main, f"paths.work_dir={work}", "batch_size=32")

    # CLIP in fp16: open_clip's scalar logit_scale stays whole on every rank.
    train(work, "stage=clip", "precision.dtype=fp16", "data.batch_size=4", "trainer.max_steps=4")
    plain_artifact(work / "clip.pt")

    # Prior in bf16: FID and the contrastive score of cached samples, the EMA.
    train(work, "stage=prior", "precision.dtype=bf16", "model.n_layer=2", "model.n_head=2", "model.d_head=8",
          "data.batch_size=4", "trainer.max_steps=6", "callbacks.ema.update_starting_at_step=2",
          "callbacks.fid.num_images=8")
    plain_artifact(work / "prior.pt")
    metrics = (sorted((work / "runs" / "prior").iterdir())[-1] / "metrics.json").read_text()
    assert "fid_clip" in metrics and "clip_score" in metrics

    run_app(generate.main, f"paths.work_dir={work}", "num_candidates=2", "prompts=[a red square]")
    assert (work / "samples" / "grid.png").is_file()
