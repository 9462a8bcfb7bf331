"""One run per output: a run locks its output and its run directory (launching process only, released when the
process dies); a second run that would write either refuses at once in one line naming the first; run directories
never collide, and all ranks of one run share one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dalle_lightning.run.run_lock import lock_file, run_id
from tests.conftest import run_app
from tests.resume_utils import QUIET, STAGES

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "DALLE_RUN_ID"):
        env.pop(key, None)
    return {**env, **extra}


def _refusal(capsys: pytest.CaptureFixture, main, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *overrides)
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert 1 <= len(err) <= 6 and err[0].startswith("error: "), err
    return err[0]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first run never reached its pause"
        time.sleep(0.2)


def test_run_ids_are_distinct_within_one_second() -> None:
    ids = {run_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{4}", i) for i in ids)


@pytest.mark.usefixtures("one_thread")
def test_a_second_train_of_one_output_refuses_and_a_killed_run_blocks_nothing(
        resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    output, flag = tmp_path / "dvae.pt", tmp_path / "flag"
    common = [*STAGES["dvae"], f"paths.work_dir={resume_work}", "trainer.max_steps=2", "data.batch_size=8", *QUIET,
              f"output={output}", "stage.force=true"]
    first = subprocess.Popen([sys.executable, "-m", "dalle_lightning.cli.train", *common,
                              "+callbacks.pause._target_=tests.pause_at.PauseAt", f"+callbacks.pause.flag={flag}"],
                             env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(flag.with_suffix(".paused"), first)
        holder = json.loads(lock_file(output).read_text())
        start = time.perf_counter()
        line = _refusal(capsys, train.main, *common)
        assert time.perf_counter() - start < 10  # at once, not after loading data or models
        assert line.startswith(f"error: output='{output}': this output is being written by another run (pid {first.pid}")
        assert f"run directory {holder['run_dir']})" in line and Path(holder["run_dir"]).parent.name == "dvae"
        first.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel releases it
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    run_app(train.main, *common)  # the next run goes ahead
    assert output.is_file()


def test_same_second_runs_get_distinct_directories(tiny_world: Path, tmp_path: Path) -> None:
    """Two tokenizer runs started together (distinct outputs) both run, each in its own directory."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "world").symlink_to(tiny_world / "world")
    procs = [subprocess.Popen([sys.executable, "-m", "dalle_lightning.cli.train", "stage=tokenizer",
                               f"paths.work_dir={work}", f"output={work / f'tok{i}.json'}", "stage.max_captions=50"],
                              env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.communicate()[1][-3000:]
    runs = sorted((work / "runs" / "tokenizer").iterdir())
    assert len(runs) == 2 and all((run / "metrics.json").is_file() for run in runs)
    assert (work / "tok0.json").is_file() and (work / "tok1.json").is_file()


@pytest.mark.parametrize("app,module", [("encode", "dalle_lightning.cli.encode"), ("data", "dalle_lightning.cli.data")])
def test_encode_and_data_refuse_an_out_dir_another_run_writes(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              app: str, module: str) -> None:
    """A first run of the command holds its out_dir (paused on a never-ending input); the second refuses."""
    import importlib

    out = tmp_path / "out"
    holder_code = ("import sys, time; from dalle_lightning.run.run_lock import acquire; "
                   f"acquire('out_dir', {str(out)!r}, '/runs/first'); print('locked', flush=True); time.sleep(120)")
    first = subprocess.Popen([sys.executable, "-c", holder_code], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "locked"
        line = _refusal(capsys, importlib.import_module(module).main, f"paths.work_dir={tmp_path}",
                        f"out_dir={out}")
        assert line == (f"error: out_dir='{out}': this output is being written by another run (pid {first.pid} on "
                        f"{os.uname().nodename}, run directory /runs/first); wait for it to end or choose another out_dir")
    finally:
        first.kill()
        first.wait()
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_all_ranks_of_a_lightning_launched_run_share_one_directory(resume_work: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name in ("world", "tokenizer.json", "dvae.pt"):
        (work / name).symlink_to(resume_work / name)
    proc = subprocess.run([sys.executable, "-m", "dalle_lightning.cli.train", *STAGES["dvae"], f"paths.work_dir={work}",
                           "trainer.devices=2", "trainer.max_steps=2", "data.batch_size=4", *QUIET],
                          env=_env(MASTER_ADDR="127.0.0.1"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (work / "runs" / "dvae").iterdir()  # rank 1 got the launching process's directory
    assert (run / "metrics.json").is_file()
    assert json.loads((run / ".run.lock").read_text())["pid"] == json.loads(lock_file(work / "dvae.pt").read_text())["pid"]
