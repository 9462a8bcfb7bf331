"""Checkpoint writes that never leave a bad file under the final name: a disk that fills up during a checkpoint
fails the run with one line, keeps the previous checkpoint loadable and leaves no temporary file; the sharded (DCP)
writer removes its temporary directory on failure and writes its completion marker last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dalle_lightning_plugins.io.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError, checkpoint_problem
from dalle_lightning_plugins.io.dcp_checkpoint import COMPLETE_MARKER, METADATA_FILENAME, save_sharded
from tests.resume_utils import QUIET, STAGES

ROOT = Path(__file__).resolve().parents[1]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_previous(resume_work: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*STAGES["dvae"], f"paths.work_dir={resume_work}", "trainer.max_steps=6", "data.batch_size=8", *QUIET,
            "callbacks.checkpoint.every_n_train_steps=2", f"hydra.run.dir={run_dir}", f"output={tmp_path / 'dvae.pt'}",
            "+callbacks.disk_full._target_=tests.disk_limit.DiskFullAt", "+callbacks.disk_full.update=3"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dalle_lightning.cli.train", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert errors[0].startswith(f"error: could not write checkpoint '{last}' (File too large)")
    assert "the previous checkpoint is kept" in errors[0]
    assert checkpoint_problem(last) is None
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 2  # the one before the full disk
    assert _leftovers(run_dir / "checkpoints") == []
    assert not (tmp_path / "dvae.pt").exists()


def test_checkpoint_io_writes_beside_the_target_and_fails_whole(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, target)
    assert torch.load(target, weights_only=True) == {"step": 1}

    class Unpicklable:
        def __reduce__(self):
            raise OSError(28, "No space left on device")  # fails part-way through the write, like a full disk

    with pytest.raises(CheckpointWriteError, match=rf"could not write checkpoint '{target}' \(No space left on device\)"):
        io.save_checkpoint({"step": 2, "big": torch.zeros(1000), "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=True) == {"step": 1} and _leftovers(tmp_path) == []


def test_sharded_writer_marks_completion_last_and_cleans_up_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    save_sharded(target, {"w": torch.arange(4.0)}, {"global_step": 1})
    assert {".metadata", COMPLETE_MARKER, METADATA_FILENAME} <= {p.name for p in target.iterdir()}
    marker, others = target / COMPLETE_MARKER, [p for p in target.iterdir() if p.name != COMPLETE_MARKER]
    assert all(marker.stat().st_mtime_ns >= p.stat().st_mtime_ns for p in others)
    assert checkpoint_problem(target) is None

    class Unpicklable:
        def __reduce__(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        save_sharded(target, {"w": torch.arange(4.0) + 1}, {"global_step": 2, "bad": Unpicklable()})
    assert _leftovers(tmp_path) == []  # no temporary directory
    loaded = {"w": torch.zeros(4)}
    from dalle_lightning_plugins.io.dcp_checkpoint import load_sharded

    assert load_sharded(target, loaded)["global_step"] == 1 and torch.equal(loaded["w"], torch.arange(4.0))


def test_strategy_writes_checkpoints_atomically_unless_given_another_writer() -> None:
    """A project that passes only ``strategy=ShardedPowerSGDStrategy()`` gets the atomic writer; one it passes
    itself (or wraps, as ``AsyncCheckpointIO`` does) is kept."""
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    assert type(ShardedPowerSGDStrategy().checkpoint_io) is AtomicCheckpointIO
    given = ShardedPowerSGDStrategy()
    given.checkpoint_io = TorchCheckpointIO()
    assert type(given.checkpoint_io) is TorchCheckpointIO
    wrapped = ShardedPowerSGDStrategy()
    wrapped.checkpoint_io = AsyncCheckpointIO()
    assert type(wrapped.checkpoint_io.checkpoint_io) is AtomicCheckpointIO
