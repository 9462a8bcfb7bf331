"""Paths a command writes are checked before Hydra makes its run directory: an unwritable, read-only or
under-a-file ``paths.work_dir``, ``out_dir`` or ``output`` is one line naming it, exit code 2, nothing created.
Also: a prompts file that is not UTF-8 is named, and loading the project's CLIP logs no warning."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.conftest import run_app

APPS = {"train": "dalle_lightning.cli.train", "encode": "dalle_lightning.cli.encode", "data": "dalle_lightning.cli.data",
        "generate": "dalle_lightning.cli.generate", "eval": "dalle_lightning.cli.evaluate"}


def _main(app: str):
    import importlib

    return importlib.import_module(APPS[app]).main


def _one_line(capsys: pytest.CaptureFixture, app: str, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_app(_main(app), *overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("app", sorted(APPS))
def test_work_dir_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture, app: str) -> None:
    (tmp_path / "afile").write_text("x")
    line = _one_line(capsys, app, f"paths.work_dir={tmp_path / 'afile' / 'work'}")
    assert f"paths.work_dir='{tmp_path / 'afile' / 'work'}'" in line and f"'{tmp_path / 'afile'}' is a file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("args,named", [
    (["paths.work_dir=/proc/dalle-work"], "paths.work_dir='/proc/dalle-work'"),
    (["paths.work_dir=/sys/dalle-work"], "paths.work_dir='/sys/dalle-work'; expected a writable location ('/sys': Permission denied)"),  # even root
    (["output={tmp}/afile/dvae.pt"], "output='{tmp}/afile/dvae.pt'"),
    (["-m", "paths.work_dir=/proc/dalle-work", "seed=1,2"], "paths.work_dir='/proc/dalle-work'"),  # a sweep too
])
def test_train_paths(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], named: str) -> None:
    (tmp_path / "afile").write_text("x")
    work = [] if any(a.startswith("paths.work_dir") for a in args) else [f"paths.work_dir={tmp_path / 'work'}"]
    line = _one_line(capsys, "train", *[a.format(tmp=tmp_path) for a in args], *work)
    assert named.format(tmp=tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no run directory, no work_dir


@pytest.mark.parametrize("app,key", [("encode", "out_dir"), ("data", "out_dir"), ("generate", "out_dir"),
                                     ("eval", "out")])
def test_outputs_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture, app: str, key: str) -> None:
    (tmp_path / "afile").write_text("x")
    line = _one_line(capsys, app, f"paths.work_dir={tmp_path / 'work'}", f"{key}={tmp_path / 'afile' / 'out'}")
    assert line.startswith(f"error: {key}='{tmp_path / 'afile' / 'out'}'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_work_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    work = tmp_path / "ro"
    work.mkdir()
    work.chmod(0o555)
    try:
        line = _one_line(capsys, "train", f"paths.work_dir={work}")
    finally:
        work.chmod(0o755)
    assert f"paths.work_dir='{work}'" in line and "Permission denied" in line
    assert not any(work.iterdir())


def test_read_prompts_not_utf8_names_the_file(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from dalle_lightning.cli.generate import read_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red square\n\xff\xfe\n")
    with pytest.raises(ValueError, match=rf"prompts_file '{prompts}' is not UTF-8 text \(byte 13 is 0xff\)"):
        read_prompts(OmegaConf.create({"prompts_file": str(prompts)}))


def test_clip_load_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    from dalle_lightning.models import clip

    with caplog.at_level(logging.INFO):
        clip.create()  # the project's own CLIP, weights from its checkpoint or training: nothing to warn about
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
