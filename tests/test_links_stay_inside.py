"""No link leads out of a folder a user was handed: a lock file, ``samples/candidates``, a sweep's files and
folders, or a job's saved overrides planted as a link to a file elsewhere is refused in one line naming it (exit
code 2), and the file elsewhere is neither written, deleted nor read; a checkpoint whose ``dirpath`` is ``/`` (or
any folder holding its run) is refused. Links inside the folder, and a user's own ``paths.work_dir`` or sweep
directory given as a link, keep working. Each crafted input is given to the command a user types."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dalle_lightning.inside import LinkOut
from dalle_lightning.run import run_lock
from tests.conftest import run_app

KEPT = "a file outside the handed folder: nothing may write, delete or print it\n"
FIX = "nothing was opened through it"


def _outside(root: Path, name: str = "file") -> Path:
    """A file elsewhere (outside every handed folder) holding :data:`KEPT`."""
    path = root / "elsewhere" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(KEPT)
    return path


def _refused(capsys: pytest.CaptureFixture, main: object, *overrides: str) -> str:
    """Run the app; it must exit with code 2 and print one line, which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *overrides)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: "), err
    return errors[0]


def _leads_out(key: str, link: Path, target: Path, folder: Path) -> str:
    return f"error: {key}: {str(link)!r} leads to {str(target)!r}, outside {str(folder)!r}, so {FIX}"


# 1. A lock file planted as a link -----------------------------------------------------------------------------------

def test_a_lock_file_planted_as_a_link_out_of_work_dir_is_refused_and_its_target_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    work = tmp_path / "work"
    work.mkdir()
    victim = _outside(tmp_path)
    (work / ".dvae.pt.lock").symlink_to(victim)
    line = _refused(capsys, train.main, "stage=dvae", f"paths.work_dir={work}", "resume=auto")
    assert line.startswith(_leads_out("output", work / ".dvae.pt.lock", victim, work)), line
    assert victim.read_text() == KEPT and not (work / "runs").exists()


def test_runs_as_a_link_out_of_work_dir_is_refused_before_a_run_directory_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    work = tmp_path / "work"
    work.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (work / "runs").symlink_to(elsewhere)  # Hydra would make runs/dvae/<id>/ there and write its files into it
    line = _refused(capsys, train.main, "stage=dvae", f"paths.work_dir={work}", "resume=auto")
    assert line.startswith(_leads_out("hydra.run.dir", work / "runs", elsewhere, work)), line
    assert not list(elsewhere.iterdir()) and not list(work.glob(".*.lock"))


def test_a_run_directory_lock_planted_as_a_link_is_refused_a_link_inside_is_followed(tmp_path: Path) -> None:
    """A sweep job's ``.run.lock`` (and the job folder itself) stays inside its sweep; a lock file that is a link
    to another file inside the folder is locked through the link."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    victim = _outside(tmp_path)
    (sweep / "0" / ".run.lock").symlink_to(victim)
    with pytest.raises(LinkOut, match=r"^hydra.sweep.dir: '.*/0/\.run\.lock' leads to .*outside") as refused:
        run_lock.acquire("hydra.sweep.dir", sweep / "0", str(sweep / "0"), directory_lock=True, folder=sweep)
    assert "\n" not in str(refused.value)
    (tmp_path / "moved").mkdir()
    (sweep / "1").symlink_to(tmp_path / "moved")  # the job folder Hydra would make, already a link out
    with pytest.raises(LinkOut, match=r"^hydra.sweep.dir: '.*/sweep/1' leads to .*outside"):
        run_lock.acquire("hydra.sweep.dir", sweep / "1", str(sweep / "1"), directory_lock=True, folder=sweep)
    assert victim.read_text() == KEPT and not list((tmp_path / "moved").iterdir())
    (sweep / "2").mkdir()
    (sweep / "2" / ".run.lock").symlink_to(sweep / "2" / "held")  # inside: fine
    try:
        run_lock.acquire("hydra.sweep.dir", sweep / "2", str(sweep / "2"), directory_lock=True, folder=sweep)
        assert json.loads((sweep / "2" / "held").read_text())["run_dir"] == str(sweep / "2")
    finally:
        run_lock.release_all()


# 2. samples/candidates as a relative link --------------------------------------------------------------------------

def _generate(work: Path, out: Path) -> list[str]:
    return [f"prior={work / 'prior.pt'}", f"dvae={work / 'dvae.pt'}", f"tokenizer={work / 'tokenizer.json'}",
            "clip=null", "prompts=[a red square]", "num_candidates=2", "batch_size=2", "save_candidates=true",
            "device=cpu", f"out_dir={out}", f"paths.work_dir={out.parent}"]


def _samples_marker(out: Path, files: list[str]) -> None:
    (out / ".dalle-lightning.json").write_text(json.dumps({"kind": "samples", "writer": "dalle-generate",
                                                           "files": files, "prompts": ["a red square"]}))


def test_candidates_as_a_link_out_of_out_dir_is_refused_and_nothing_outside_touched(
        tiny_artifacts: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    out = tmp_path / "handed" / "samples"
    out.mkdir(parents=True)
    victim = _outside(tmp_path, "0_0.png")
    (out / "candidates").symlink_to("../../elsewhere")  # relative, as a stranger's folder would carry it
    _samples_marker(out, ["0.png", "candidates/0_0.png", "grid.png"])
    line = _refused(capsys, generate.main, *_generate(tiny_artifacts, out))
    assert line.startswith(_leads_out("out_dir", out / "candidates", victim.parent, out)), line
    assert victim.read_text() == KEPT and [p.name for p in victim.parent.iterdir()] == ["0_0.png"]


def test_a_linked_work_dir_and_a_candidates_link_inside_out_dir_keep_working(
        tiny_artifacts: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import generate

    real = tmp_path / "real"
    (real / "samples" / "kept").mkdir(parents=True)
    (tmp_path / "work").symlink_to(real)  # the user's own work_dir, given as a link
    out = tmp_path / "work" / "samples"
    (out / "candidates").symlink_to("kept")  # inside out_dir
    (out / "kept" / "0_0.png").write_text("an earlier run's candidate")
    _samples_marker(out, ["0.png", "candidates/0_0.png", "grid.png"])
    run_app(generate.main, *_generate(tiny_artifacts, out))
    assert sorted(p.name for p in (real / "samples" / "kept").iterdir()) == ["0_0.png", "0_1.png"]
    assert (real / "samples" / "kept" / "0_0.png").read_bytes().startswith(b"\x89PNG")  # replaced by this run
    assert (real / "samples" / "0.png").is_file() and (real / "runs" / "generate").is_dir()


# 3. A handed sweep folder continued with resume=auto ---------------------------------------------------------------

LINKED = ("multirun.yaml", "0/.hydra/config.yaml", "0/train.log", "0/.run.lock", "0/checkpoints")


def _handed_sweep(root: Path, linked: tuple[str, ...]) -> tuple[Path, dict[str, Path]]:
    """A sweep folder as Hydra and dalle-train leave it (job 0 with its saved overrides), ``linked`` names in it
    planted as links to files (a folder, for checkpoints) elsewhere."""
    sweep = root / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- stage=dvae\n- resume=auto\n")
    targets = {}
    for name in linked:
        if name == "0/checkpoints":
            target = root / "elsewhere" / "checkpoints"
            target.mkdir(parents=True)
            (target / "kept.txt").write_text(KEPT)
        else:
            target = _outside(root, name.replace("/", "_"))
        (sweep / name).symlink_to(target)
        targets[name] = target
    return sweep, targets


def _outside_state(targets: dict[str, Path]) -> dict[str, str]:
    return {name: (t / "kept.txt" if t.is_dir() else t).read_text() + ",".join(p.name for p in t.parent.iterdir())
            for name, t in targets.items()}


@pytest.mark.parametrize("linked", [LINKED, *((name,) for name in LINKED)], ids=["all", *LINKED])
def test_a_handed_sweep_with_a_link_out_is_refused_before_anything_is_written(
        linked: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    sweep, targets = _handed_sweep(tmp_path, linked)
    before = _outside_state(targets)
    line = _refused(capsys, train.main, "-m", "stage=dvae", f"paths.work_dir={tmp_path / 'work'}", "resume=auto",
                    f"hydra.sweep.dir={sweep}")
    first = sorted(linked, key=lambda name: (name.count("/"), name))[0]  # the walk meets the top level first
    assert line.startswith(_leads_out("hydra.sweep.dir", sweep / first, targets[first], sweep)), line
    assert _outside_state(targets) == before and not (tmp_path / "work").exists()


def test_resume_auto_in_a_sweep_reads_no_job_file_through_a_link_out(tmp_path: Path) -> None:
    """``resume=auto``'s own reading (a job started by a launcher in another process, past the sweep's check)."""
    from omegaconf import OmegaConf

    from dalle_lightning.run.resume import resume_checkpoint

    sweep, targets = _handed_sweep(tmp_path, ("0/checkpoints",))
    cfg = OmegaConf.create({"resume": "auto", "stage": {"name": "dvae"}, "paths": {"runs": str(tmp_path / "runs")}})
    with pytest.raises(LinkOut, match=r"^resume: '.*/sweep/0/checkpoints' leads to"):
        resume_checkpoint(cfg, sweep / "0", (sweep, ["stage=dvae", "resume=auto"]))
    (sweep / "0" / ".hydra" / "overrides.yaml").unlink()
    (sweep / "0" / ".hydra" / "overrides.yaml").symlink_to(_outside(tmp_path, "overrides.yaml"))
    with pytest.raises(LinkOut, match=r"^resume=auto: '.*/sweep/0/.hydra/overrides.yaml' leads to"):
        resume_checkpoint(cfg, sweep / "0", (sweep, ["stage=dvae", "resume=auto"]))


# 4. dalle-sweep-summary reads no file outside the sweep ------------------------------------------------------------

def _summary_sweep(root: Path) -> Path:
    """Job 0 finished (metrics.json), job 1 failed (only its saved overrides)."""
    sweep = root / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.json").write_text(json.dumps({"overrides": ["a=1"], "metrics": {"val/loss": 0.5}}))
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- a=2\n")
    return sweep


SECRET = "hunter2-7d1f"


@pytest.mark.parametrize("linked", ["1/.hydra/overrides.yaml", "1", "multirun.yaml", "0/metrics.json"])
def test_sweep_summary_reads_no_file_through_a_link_out_of_the_sweep(
        linked: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import sweep_summary

    sweep = _summary_sweep(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "job" / ".hydra").mkdir(parents=True)  # a whole job folder elsewhere, for linked == "1"
    secrets = f"- password={SECRET}\n- token=ghp_0123456789\n"  # a YAML list, as overrides.yaml holds
    (elsewhere / "job" / ".hydra" / "overrides.yaml").write_text(secrets)
    (elsewhere / "secrets.yaml").write_text(secrets)
    (elsewhere / "metrics.json").write_text(json.dumps({"overrides": [f"password={SECRET}"], "metrics": {"x": 1.0}}))
    target = {"1": elsewhere / "job", "0/metrics.json": elsewhere / "metrics.json"}.get(linked,
                                                                                     elsewhere / "secrets.yaml")
    if linked == "1":
        shutil.rmtree(sweep / "1")
    else:
        (sweep / linked).unlink(missing_ok=True)
    (sweep / linked).symlink_to(target)
    assert sweep_summary.main([str(sweep)]) == 2
    printed = capsys.readouterr()
    assert printed.err == f"{_leads_out('sweep_dir', sweep / linked, target, sweep)}; expected files and folders " \
        "inside it (remove the link, or copy what it names)\n", printed.err
    assert SECRET not in printed.out + printed.err and not list(sweep.glob("summary.*"))


def test_sweep_summary_follows_links_inside_the_sweep_and_a_linked_sweep(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import sweep_summary

    sweep = _summary_sweep(tmp_path)
    (sweep / "1" / ".hydra" / "overrides.yaml").rename(sweep / "1" / ".hydra" / "saved.yaml")
    (sweep / "1" / ".hydra" / "overrides.yaml").symlink_to("saved.yaml")  # inside
    (tmp_path / "mine").symlink_to(sweep)  # the user's own path to it, a link
    assert sweep_summary.main([str(tmp_path / "mine")]) == 0
    summary = json.loads((sweep / "summary.json").read_text())
    assert [row["overrides"] for row in summary["runs"]] == [["a=1"], ["a=2"]], summary
    assert not capsys.readouterr().err


# 5. A checkpoint whose dirpath holds everything --------------------------------------------------------------------

def _checkpoint(path: Path, dirpath: str, last: str) -> Path:
    """The parts of a Lightning checkpoint the check reads: a state_dict, a step, a checkpoint callback's state."""
    state = {"dirpath": dirpath, "last_model_path": last, "best_model_path": "", "kth_best_model_path": "",
             "best_k_models": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "global_step": 2, "callbacks": {"PacedCheckpoint{'every_n_minutes': 30}": state}},
               path)
    return path


@pytest.mark.parametrize("dirpath", ["/", "work", "run"])
def test_resume_of_a_checkpoint_whose_dirpath_holds_its_run_is_refused(
        dirpath: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    work = tmp_path / "work"
    run = work / "runs" / "dvae" / "2026-01-01_00-00-00_abcd"
    folder = {"/": "/", "work": str(work), "run": str(run)}[dirpath]
    victim = {"/": tmp_path / "elsewhere" / "file", "work": work / "dvae.pt", "run": run / "train.log"}[dirpath]
    victim.parent.mkdir(parents=True)
    victim.write_text(KEPT)  # under the stored dirpath, as the check before asked, and no file of the checkpoint's
    ckpt = _checkpoint(run / "checkpoints" / "last.ckpt", folder, str(victim))
    common = ["stage=dvae", f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'new'}"]
    for resume, key in ((f"resume={ckpt}", f"resume={ckpt}"), ("resume=auto", "resume")):
        line = _refused(capsys, train.main, *common, resume)
        holds = f"this run's directory {str(tmp_path / 'new')!r}" if dirpath == "/" else \
            f"the checkpoint's run directory {str(run)!r}"  # the resuming run's is checked first
        assert line.startswith(f"error: {key}: checkpoint {str(ckpt)!r}: callbacks[\"PacedCheckpoint"
                               f"{{'every_n_minutes': 30}}\"].dirpath is {folder!r}, which is or holds {holds}, "
                               "not a run's checkpoint folder, so the checkpoint was not used and nothing was "
                               "deleted"), line
        assert victim.read_text() == KEPT


def test_a_dirpath_holding_the_resuming_run_is_refused_a_copy_naming_its_old_folder_is_not(tmp_path: Path) -> None:
    from dalle_lightning.run.checkpoint_paths import OutsidePath
    from dalle_lightning.run.resume import check_data

    old = tmp_path / "old" / "runs" / "dvae" / "a" / "checkpoints"
    copy = _checkpoint(tmp_path / "copies" / "last.ckpt", str(old), str(old / "last.ckpt"))
    new_run = tmp_path / "work" / "runs" / "dvae" / "b"
    check_data(copy, "resume", new_run)  # its old folder: the new run deletes nothing there
    sub = _checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", str(tmp_path / "run" / "other"),
                      str(tmp_path / "run" / "other" / "x.ckpt"))
    check_data(sub, "resume", new_run)  # inside its own run
    holder = _checkpoint(tmp_path / "copies" / "holder.ckpt", str(tmp_path / "work"), str(tmp_path / "work" / "x"))
    with pytest.raises(OutsidePath, match=r"dirpath is .*, which is or holds this run's directory .*/runs/dvae/b'"):
        check_data(holder, "resume", new_run)


def test_a_split_folder_as_a_link_out_is_refused_by_dalle_data_and_dalle_encode(
        tiny_artifacts: Path, tiny_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``dalle-data`` and ``dalle-encode`` replace ``<out_dir>/<split>`` whole: a handed ``world/train`` or
    ``tokens/train`` linking elsewhere had its target's shards replaced (``dalle-data``) or ``rmtree`` fail on the
    link with a traceback (``dalle-encode``)."""
    from dalle_lightning.cli import data, encode

    elsewhere = _outside(tmp_path, "000000.tar").parent
    work = tmp_path / "work"
    (work / "world").mkdir(parents=True)
    (work / "world" / "train").symlink_to(elsewhere)
    line = _refused(capsys, data.main, f"paths.work_dir={work}", "n_train=8", "n_val=4", "n_zeroshot=4",
                    "shard_size=8", "force=true")
    assert line.startswith(_leads_out("out_dir", work / "world" / "train", elsewhere, work / "world")), line
    (work / "tokens").mkdir()
    (work / "tokens" / "train").symlink_to(elsewhere)
    line = _refused(capsys, encode.main, f"paths.work_dir={work}", f"paths.world={tiny_world / 'world'}",
                    f"dvae={tiny_artifacts / 'dvae.pt'}", f"tokenizer={tiny_artifacts / 'tokenizer.json'}",
                    "force=true", "num_workers=0")
    assert line.startswith(_leads_out("out_dir", work / "tokens" / "train", elsewhere, work / "tokens")), line
    assert [p.name for p in elsewhere.iterdir()] == ["000000.tar"] and (elsewhere / "000000.tar").read_text() == KEPT
