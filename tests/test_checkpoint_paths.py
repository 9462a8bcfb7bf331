"""Paths in a checkpoint stay inside their folder: a ``last.ckpt`` whose callback state names a file outside the
run's checkpoint directory (``<ckpt dir>/../../FILE``) is refused by ``dalle-train resume=`` in one line naming the
key, with exit code 2 and ``FILE`` still there; the project's checkpoint callback deletes only inside its own
resolved ``dirpath``; and a stored interpolation in a checkpoint's hyper-parameters is refused unresolved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dalle_lightning.run.resume import check_data
from dalle_lightning_callbacks.paced_checkpoint import PacedCheckpoint
from tests.conftest import run_app
from tests.resume_utils import QUIET, STAGES

SECRET = "s3cr3t-value-7d1f"


def _args(work: Path, run_dir: Path, output: Path, *extra: str) -> list[str]:
    return [*STAGES["dvae"], f"paths.work_dir={work}", "data.batch_size=8", *QUIET, f"hydra.run.dir={run_dir}",
            f"output={output}", *extra]


@pytest.fixture(scope="module")
def tiny_checkpoint(resume_work: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``last.ckpt`` of a real two-update dVAE run."""
    from dalle_lightning.cli import train

    root = tmp_path_factory.mktemp("paths")
    run_app(train.main, *_args(resume_work, root / "run", root / "dvae.pt", "trainer.max_steps=2"))
    return root / "run" / "checkpoints" / "last.ckpt"


def _callback_state(saved: dict[str, Any]) -> dict[str, Any]:
    (state,) = [s for name, s in saved["callbacks"].items() if name.startswith("PacedCheckpoint")]
    return state


def _crafted(source: Path, target: Path, **changes: Any) -> Path:
    saved = torch.load(source, map_location="cpu", weights_only=True)
    _callback_state(saved).update(changes)
    torch.save(saved, target)
    return target


@pytest.mark.parametrize("key", ["last_model_path", "best_model_path", "kth_best_model_path", "best_k_models"])
@pytest.mark.usefixtures("one_thread")
def test_resume_of_a_checkpoint_naming_a_file_outside_its_folder_is_refused_and_deletes_nothing(
        key: str, tiny_checkpoint: Path, resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    run_dir = tmp_path / "runs" / "dvae" / "resumed"  # the resumed run's own directory, where Lightning would delete
    ckpt_dir = os.path.realpath(run_dir / "checkpoints")  # as ModelCheckpoint stores its dirpath
    victim = run_dir.parent / "FILE"  # <ckpt dir>/../../FILE: beside the run, outside it
    victim.parent.mkdir(parents=True)
    victim.write_text("not a checkpoint")
    outside = f"{ckpt_dir}/../../FILE"
    value: Any = {outside: torch.tensor(0.0)} if key == "best_k_models" else outside
    own = {"dirpath": ckpt_dir, "best_model_path": f"{ckpt_dir}/step=2.ckpt", "last_model_path": f"{ckpt_dir}/last.ckpt",
           "kth_best_model_path": "", "best_k_models": {}}  # as if written there, but for the one key
    crafted = _crafted(tiny_checkpoint, tmp_path / "last.ckpt", **{**own, key: value})
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, *_args(resume_work, run_dir, tmp_path / "out.pt", "trainer.max_steps=4",
                                   f"resume={crafted}"))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(errors) == 1 and errors[0].startswith(f"error: resume={crafted}: checkpoint "), errors
    assert f".{key}" in errors[0] and "nothing was deleted" in errors[0], errors
    assert victim.read_text() == "not a checkpoint" and not (tmp_path / "out.pt").exists()


def test_a_resolved_path_outside_the_named_directory_is_refused_a_copied_checkpoint_is_not(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    state = _callback_state(torch.load(tiny_checkpoint, map_location="cpu", weights_only=True))
    assert state["last_model_path"] == str(tiny_checkpoint.resolve())  # what Lightning writes: a real path
    copy = Path(shutil.copy(tiny_checkpoint, tmp_path / "copied.ckpt"))  # its paths still name its old folder
    check_data(copy, "resume")
    (tmp_path / "link").symlink_to(tmp_path.parent)  # no '..' written, but it resolves outside
    linked = _crafted(tiny_checkpoint, tmp_path / "linked.ckpt", dirpath=str(tmp_path),
                      last_model_path=str(tmp_path / "link" / "FILE"))
    with pytest.raises(ValueError, match=r"last_model_path is .* outside its checkpoint directory") as info:
        check_data(linked, "resume")
    assert len(str(info.value).splitlines()) == 1
    whole = _crafted(tiny_checkpoint, tmp_path / "whole.ckpt", dirpath=str(tmp_path), best_model_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"best_model_path is .* outside its checkpoint directory"):
        check_data(whole, "resume")  # Lightning would remove the folder itself (recursively)
    relative = _crafted(tiny_checkpoint, tmp_path / "relative.ckpt", last_model_path="FILE")
    with pytest.raises(ValueError, match=r"last_model_path is 'FILE', which Lightning never writes"):
        check_data(relative, "resume")


def test_a_stored_interpolation_in_the_hyper_parameters_is_refused_unresolved(
        tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", SECRET)
    saved = torch.load(tiny_checkpoint, map_location="cpu", weights_only=True)
    saved["hyper_parameters"]["lr"] = "${oc.env:SECRET_TOKEN}"
    torch.save(saved, tmp_path / "hp.ckpt")
    with pytest.raises(ValueError) as info:
        check_data(tmp_path / "hp.ckpt", "resume")
    line = str(info.value)
    assert len(line.splitlines()) == 1 and "hyper_parameters.lr holds an interpolation" in line
    assert SECRET not in line and "oc.env" not in line


def test_the_checkpoint_callback_deletes_only_inside_its_resolved_dirpath(tmp_path: Path) -> None:
    """Lightning's own check (``Path.absolute()``) counts ``<dirpath>/../FILE`` as inside; the callback does not."""
    dirpath = tmp_path / "run" / "checkpoints"
    dirpath.mkdir(parents=True)
    inside, outside = dirpath / "old.ckpt", tmp_path / "FILE"
    inside.write_text("old")
    outside.write_text("keep")
    callback = PacedCheckpoint(dirpath=str(dirpath), every_n_minutes=None)
    trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False)
    crafted = f"{dirpath}/../../FILE"
    assert callback._should_remove_checkpoint(trainer, crafted, str(dirpath / "last.ckpt"))  # Lightning would
    with pytest.warns(UserWarning, match="kept .* outside its checkpoint directory"):
        callback._remove_checkpoint(trainer, crafted)
    callback._remove_checkpoint(trainer, str(inside))
    assert outside.read_text() == "keep" and not inside.exists()


@pytest.mark.usefixtures("one_thread")
def test_resume_auto_refuses_the_newest_checkpoint_when_it_names_a_file_outside(
        tiny_checkpoint: Path, resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    runs = tmp_path / "runs"
    earlier = runs / "dvae" / "2026-01-01_00-00-00_abcd" / "checkpoints"  # an earlier run: what auto takes
    earlier.mkdir(parents=True)
    victim = runs / "FILE"
    victim.write_text("not a checkpoint")
    ckpt_dir = os.path.realpath(earlier)
    _crafted(tiny_checkpoint, earlier / "last.ckpt", dirpath=ckpt_dir, best_model_path="", kth_best_model_path="",
             best_k_models={}, last_model_path=f"{ckpt_dir}/../../../FILE")
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, *_args(resume_work, runs / "dvae" / "resumed", tmp_path / "out.pt", "trainer.max_steps=4",
                                   f"paths.runs={runs}", "resume=auto"))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: resume: checkpoint '{earlier / 'last.ckpt'}'") and ".last_model_path" in errors[0]
    assert victim.read_text() == "not a checkpoint" and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(("path", "kept"), [("s3://b/ckpts/last.ckpt", True), ("s3://b/ckpts-other/x", False),
                                            ("s3://b/ckpts/../x", False), ("/etc/passwd", False)])
def test_a_remote_checkpoint_directory_is_compared_as_text(path: str, kept: bool) -> None:
    from dalle_lightning.run.checkpoint_paths import OutsidePath, check_callback_paths
    from dalle_lightning_callbacks.paced_checkpoint import within_dirpath

    saved = {"callbacks": {"ModelCheckpoint{}": {"dirpath": "s3://b/ckpts", "last_model_path": path}}}
    if kept:
        check_callback_paths(saved, "/copies/last.ckpt", "resume")
    else:
        with pytest.raises(OutsidePath, match="last_model_path is .*nothing was deleted"):
            check_callback_paths(saved, "/copies/last.ckpt", "resume")
    assert within_dirpath(path, "s3://b/ckpts") == kept
