"""``dalle-train resume=...``: which checkpoint a run continues from, and one-line errors when there is none."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import torch

from dalle_lightning.run.resume import newest_checkpoint, resume_checkpoint
from dalle_lightning_plugins.io.dcp_checkpoint import COMPLETE_MARKER
from tests.conftest import CONF, run_app


def _checkpoint(runs: Path, stage: str, run: str, mtime: float, sharded: bool = False, name: str = "last.ckpt") -> Path:
    """A complete checkpoint: a torch.save file, or a DCP directory with its completion marker (as
    strategy=sharded_powersgd writes)."""
    path = runs / stage / run / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if sharded:
        path.mkdir()
        (path / ".metadata").write_bytes(b"")
        (path / COMPLETE_MARKER).write_text("")
    else:
        torch.save({"global_step": 1, "state_dict": {}}, path)
    os.utime(path, (mtime, mtime))
    return path


def _truncate(path: Path) -> Path:
    mtime = path.stat().st_mtime
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # what a full disk during a copy leaves
    os.utime(path, (mtime, mtime))
    return path


def _cfg(work: Path, stage: str = "dvae", resume: object = "auto"):
    return OmegaConf.create({"resume": resume, "stage": {"name": stage}, "paths": {"runs": str(work / "runs")}})


def test_auto_is_the_newest_last_checkpoint_of_the_stage_not_of_this_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"  # run directories are named by their start (${run_id:}); file times do not count
    _checkpoint(runs, "dvae", "2026-01-01_10-00-00_a", 100)
    newest = _checkpoint(runs, "dvae", "2026-01-01_12-00-00_b", 100, sharded=True)
    _checkpoint(runs, "dvae", "2026-01-01_11-00-00_c", 300)
    _checkpoint(runs, "prior", "2026-01-01_13-00-00_d", 400)  # another stage
    own = _checkpoint(runs, "dvae", "2026-01-01_14-00-00_now", 500)  # this run's own directory (it has just begun)
    assert newest_checkpoint(runs, "dvae", exclude=own.parents[1]) == newest
    assert resume_checkpoint(_cfg(tmp_path), run_dir=own.parents[1]) == str(newest)
    assert resume_checkpoint(_cfg(tmp_path, resume=None)) is None
    assert resume_checkpoint(_cfg(tmp_path, resume=str(own))) == str(own)


@pytest.mark.parametrize(("stage", "resume", "message"), [
    ("dvae", "auto", "resume=auto found no complete checkpoint"),
    ("dvae", "nowhere/last.ckpt", "resume=nowhere/last.ckpt: no such checkpoint"),
    ("dvae", 3, "resume=3; expected null, auto, or the path of a checkpoint"),
    ("tokenizer", "auto", "resume=auto with stage=tokenizer; expected resume=null"),
])
def test_a_resume_that_names_no_checkpoint_is_an_error(tmp_path: Path, stage: str, resume: object, message: str) -> None:
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        resume_checkpoint(_cfg(tmp_path, stage, resume))


def test_resume_is_a_train_option_off_by_default(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.work_dir={tmp_path}"])
    assert cfg.resume is None


def test_resume_auto_without_a_run_is_one_line_from_the_app(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, "stage=dvae", f"paths.work_dir={tmp_path}", "resume=auto")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and errors[0].startswith("error: resume=auto found no complete checkpoint")
    assert str(tmp_path / "runs" / "dvae") in errors[0]


def test_auto_skips_truncated_and_incomplete_checkpoints_and_says_which(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    runs = tmp_path / "runs"
    good = _checkpoint(runs, "dvae", "a", 100)
    periodic = _checkpoint(runs, "dvae", "b", 200, name="epoch=0-step=4.ckpt")
    cut = _truncate(_checkpoint(runs, "dvae", "b", 300))
    unfinished = _checkpoint(runs, "dvae", "c", 400, sharded=True)
    (unfinished / COMPLETE_MARKER).unlink()
    with caplog.at_level("WARNING", logger="dalle_lightning"):
        assert resume_checkpoint(_cfg(tmp_path)) == str(periodic)
    (line,) = [r.getMessage() for r in caplog.records if "resume=auto" in r.getMessage()]
    assert f"skipped {unfinished} (an incomplete sharded checkpoint" in line and f"{cut} (truncated" in line
    assert line.endswith(f"resuming from {periodic}") and str(good) not in line


def test_auto_with_only_incomplete_checkpoints_is_one_line(tmp_path: Path) -> None:
    cut = _truncate(_checkpoint(tmp_path / "runs", "dvae", "a", 100))
    with pytest.raises(FileNotFoundError, match=rf"found no complete checkpoint .*every one is incomplete: {cut} \(truncated"):
        resume_checkpoint(_cfg(tmp_path))


def test_resume_path_to_a_truncated_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    cut = _truncate(_checkpoint(tmp_path / "runs", "dvae", "a", 100))
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, "stage=dvae", f"paths.work_dir={tmp_path}", f"resume={cut}")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and errors[0].startswith(f"error: resume={cut}: truncated or not a checkpoint"), errors
