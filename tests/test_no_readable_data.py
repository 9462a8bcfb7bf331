"""Zero readable samples of a split a stage needs is a one-line error with a non-zero exit, for every stage that
reads data (tokenizer, dvae, clip, prior, dalle-encode), found before any training or encoding (each split's first
samples are read first), and nothing is written under the output's name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import run_app
from tests.resume_utils import QUIET, STAGES

pytestmark = pytest.mark.usefixtures("one_thread")


def _unreadable(folder: Path) -> None:
    """Three shards nothing can be read from: empty, not a tar, and a run of zero bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "000100.tar").write_bytes(b"")
    (folder / "000101.tar").write_text("not a tar at all\n")
    (folder / "000102.tar").write_bytes(b"\0" * 100)


def _error(capsys: pytest.CaptureFixture, main, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *overrides)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in errors if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def _work(resume_work: Path, tmp_path: Path) -> Path:
    """A copy of the tiny pipeline's artifacts (tokenizer, dVAE, token and image shards) to break one split of."""
    work = tmp_path / "work"
    shutil.copytree(resume_work, work, ignore=shutil.ignore_patterns("runs"))
    return work


def test_tokenizer_without_a_readable_caption(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    _unreadable(tmp_path / "world" / "train")
    line = _error(capsys, train.main, "stage=tokenizer", f"paths.work_dir={tmp_path}")
    assert "the tokenizer's training data yielded no caption from its 3 shard(s)" in line
    assert "unreadable shard: 3" in line
    assert not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize("stage,split", [("dvae", "val"), ("clip", "train"), ("prior", "val")])
def test_training_stage_without_a_readable_sample(resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  stage: str, split: str) -> None:
    from dalle_lightning.cli import train

    work = _work(resume_work, tmp_path)
    data = work / ("tokens" if stage == "prior" else "world") / split
    shutil.rmtree(data)
    _unreadable(data)
    line = _error(capsys, train.main, *STAGES[stage], f"paths.work_dir={work}", "trainer.max_steps=2", *QUIET,
                  f"output={work / 'new.pt'}")
    # Found by the probe before any training: the split's key, its shards and what was skipped.
    unit = "token sample" if stage == "prior" else "image-caption sample"
    assert line.startswith(f"error: data.{split}_shards='auto' ({data})"), line
    assert f"no readable {unit} in its 3 shard(s)" in line and "unreadable shard: 3" in line
    assert not (work / "new.pt").exists()


def test_encode_without_a_readable_sample(resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode

    work = _work(resume_work, tmp_path)
    shutil.rmtree(work / "world" / "val")
    _unreadable(work / "world" / "val")
    before = sorted(p.name for p in (work / "tokens" / "val").iterdir())
    line = _error(capsys, encode.main, f"paths.work_dir={work}", "batch_size=16", "num_workers=0", "force=true")
    # Refused before the train split is encoded: every split is probed first.
    assert "splits.val='auto'" in line and "no readable image-caption sample in its 3 shard(s)" in line
    assert "unreadable shard: 3" in line
    assert sorted(p.name for p in (work / "tokens" / "val").iterdir()) == before  # the old split is kept
    assert not [p for p in (work / "tokens").iterdir() if p.name.startswith(".")]  # no temporary left
