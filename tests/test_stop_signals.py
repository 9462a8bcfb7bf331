"""A ``dalle-train`` that SIGTERM or SIGINT stops says so: exit code 143 or 130, one ``error:`` line naming the
checkpoint written at the stop, from which ``resume=`` continues to the weights of an uninterrupted run
(``dalle_lightning/run/stopped.py``, ``PacedCheckpoint(save_on_stop=True)``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf

from dalle_lightning.run.stopped import stop_message, stop_reported
from tests.conftest import run_app
from tests.resume_utils import QUIET, STAGES, max_dw

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"error: stopped by (SIG\w+) after (\d+) updates; the run's last checkpoint is (\S+) "
                  r"\(update (\d+)\): continue it with resume=(\S+)( \(or resume=auto\))?$")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "DALLE_RUN_ID", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    return env


def _sigint_as_a_shell_gives_it() -> None:
    """In the child before it runs: SIGINT's default action, whatever this process inherited (a background job of a
    non-interactive shell, as a CI script may start the suite, ignores SIGINT, and a child would inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _args(work: Path, runs: Path, name: str, *extra: str) -> list[str]:
    return [*STAGES["dvae"], f"paths.work_dir={work}", f"paths.runs={runs}", "trainer.max_steps=6",
            "data.batch_size=8", *QUIET, f"output={runs.parent / name}.pt", *extra]


def _stopped_run(work: Path, runs: Path, signum: int, flag: Path) -> tuple[int, list[str], str]:
    """A real ``python -m dalle_lightning.cli.train``, held after update 3 (``tests/pause_at.py``) while it gets
    ``signum``, then let go: its exit code, its ``error:`` lines, its stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "dalle_lightning.cli.train",
                             *_args(work, runs, "stopped", "+callbacks.pause._target_=tests.pause_at.PauseAt",
                                    f"+callbacks.pause.flag={flag}", "+callbacks.pause.update=3")],
                            env=_env(), preexec_fn=_sigint_as_a_shell_gives_it, cwd=runs.parent, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.with_suffix(".paused").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached update 3"
            time.sleep(0.1)
        proc.send_signal(signum)  # in update 3's last hook: the run finishes the update and checkpoints it
        time.sleep(0.3)
        flag.with_suffix(".go").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, [line for line in err.splitlines() if line.startswith("error:")], err


def test_sigterm_ends_with_one_line_and_143_and_the_named_checkpoint_resumes_exactly(
        resume_work: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, errors, err = _stopped_run(resume_work, runs, signal.SIGTERM, tmp_path / "flag")
    assert code == 143, err[-3000:]
    assert len(errors) == 1 and "Traceback" not in err and "Received SIGTERM" not in err, err[-3000:]
    match = LINE.match(errors[0])
    assert match, errors[0]
    name, updates, path, at, resume, auto = match.groups()
    assert (name, updates, at) == ("SIGTERM", "3", "3") and resume == path and auto, errors[0]
    assert Path(path).is_file() and Path(path).parent.parent.parent == runs / "dvae"
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] == 3
    assert not (tmp_path / "stopped.pt").exists()  # a stopped run writes no model

    from dalle_lightning.cli import train

    run_app(train.main, *_args(resume_work, runs, "resumed", f"resume={path}"))
    run_app(train.main, *_args(resume_work, tmp_path / "straight_runs", "straight"))
    assert max_dw(tmp_path / "resumed.pt", tmp_path / "straight.pt") == 0.0


def test_sigint_ends_with_130_and_resume_auto_continues(resume_work: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, errors, err = _stopped_run(resume_work, runs, signal.SIGINT, tmp_path / "flag")
    assert code == 130, err[-3000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    match = LINE.match(errors[0])
    assert match and match.group(1) == "SIGINT" and match.group(4) == "3" and match.group(6), errors[0]

    from dalle_lightning.cli import train

    run_app(train.main, *_args(resume_work, runs, "resumed", "resume=auto"))
    assert (tmp_path / "resumed.pt").is_file()
    assert len(list(runs.glob("dvae/*/metrics.json"))) == 1  # the resumed run finished; the stopped one did not


class _Trainer:
    """What the stop's line reads of a Trainer that wrote no checkpoint."""

    global_step = 1
    checkpoint_callbacks: list = []


def test_a_stop_before_any_checkpoint_says_what_to_do() -> None:
    cfg = OmegaConf.create({"paths": {"runs": "/nonexistent"}, "stage": {"name": "dvae"}})
    assert stop_message(cfg, _Trainer(), signal.SIGTERM, None) == (
        "stopped by SIGTERM after 1 update, before the run wrote a checkpoint; nothing to resume: run the command "
        "again to start afresh")
    assert stop_message(cfg, _Trainer(), signal.SIGINT, "/r/last.ckpt").endswith(
        "before this run wrote a checkpoint; the checkpoint it continued from is kept: continue with "
        "resume=/r/last.ckpt")


def test_torchrun_workers_keep_lightnings_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops healthy workers with SIGTERM to restart them: no line, Lightning's exit (the launcher's)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(SIGTERMException):
        with stop_reported(OmegaConf.create({}), _Trainer()):
            raise SIGTERMException
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(SystemExit) as exit_info:  # any other SystemExit passes through
        with stop_reported(OmegaConf.create({}), _Trainer()):
            sys.exit(3)
    assert exit_info.value.code == 3


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_other_commands_stop_with_one_line_and_the_signal_code(resume_work: Path, tiny_world: Path, tmp_path: Path,
                                                               signum: int, code: int) -> None:
    """dalle-encode (and every command but training, which the tests above cover) stopped by a signal while it
    encodes: one line, 128 + the signal, and no token split left behind, whole or partial."""
    out = tmp_path / "tokens"
    proc = subprocess.Popen([sys.executable, "-m", "dalle_lightning.cli.encode", f"paths.work_dir={resume_work}",
                             f"paths.world={tiny_world / 'world'}", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}",
                             "batch_size=1", "num_workers=0"],
                            env=_env(), preexec_fn=_sigint_as_a_shell_gives_it, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out.is_dir() and any(p.name.startswith(".") for p in out.iterdir())):  # its temporary split folder
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    name = signal.Signals(signum).name
    assert proc.returncode == code and errors == [
        f"error: dalle-encode stopped by {name}; every file it writes appears whole or not at all (written under a "
        "temporary name): run the command again to finish"], err[-2000:]
    assert not list(out.rglob("*.tar"))  # nothing half-encoded passes for a split
