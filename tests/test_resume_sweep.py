"""``resume=auto`` inside a multirun sweep: a requeued job continues from its own newest complete checkpoint (the
sweep's jobs with its overrides, its own directory included), never from another job's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dalle_lightning.run.resume import resume_checkpoint
from tests.conftest import run_app
from tests.resume_utils import STAGES

ROOT = Path(__file__).resolve().parents[1]


def _job(sweep: Path, num: str, overrides: list[str], mtime: float | None = None) -> Path:
    """A sweep job directory as Hydra leaves it (.hydra/overrides.yaml), with a complete last.ckpt when ``mtime``."""
    job = sweep / num
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if mtime is not None:
        (job / "checkpoints").mkdir()
        torch.save({"job": num}, job / "checkpoints" / "last.ckpt")
        os.utime(job / "checkpoints" / "last.ckpt", (mtime, mtime))
    return job


def test_auto_in_a_sweep_takes_this_jobs_own_newest_checkpoint(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    sweep = tmp_path / "multirun" / "2026-11-25_12-00-00_abcd"
    mine = ["stage=dvae", "module.optimizer.lr=0.003", "resume=auto"]
    _job(sweep, "0", ["stage=dvae", "module.optimizer.lr=0.001", "resume=auto"], mtime=300)  # another job, newer
    own = _job(sweep, "1", mine, mtime=200)  # this job's own directory, before its requeue
    cfg = OmegaConf.create({"resume": "auto", "stage": {"name": "dvae"}, "paths": {"runs": str(tmp_path / "runs")}})
    assert resume_checkpoint(cfg, own, (sweep, mine)) == str(own / "checkpoints" / "last.ckpt")
    # Relaunched with resume=auto added: the same job still (resume= is not part of a job's identity).
    assert resume_checkpoint(cfg, own, (sweep, mine[:2])) == str(own / "checkpoints" / "last.ckpt")
    fresh = ["stage=dvae", "module.optimizer.lr=0.01", "resume=auto"]  # a job with no checkpoint: starts afresh
    assert resume_checkpoint(cfg, _job(sweep, "2", fresh), (sweep, fresh)) is None


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_requeued_job_of_a_two_job_sweep_continues_from_its_own_checkpoint(
        resume_work: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import train

    sweep = tmp_path / "sweep"
    common = [*STAGES["dvae"], f"paths.work_dir={resume_work}", "trainer.max_steps=6", "data.batch_size=8",
              "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.limit_val_batches=1",
              "callbacks.checkpoint.save_top_k=0", "callbacks.checkpoint.every_n_train_steps=2", "resume=auto",
              "output=${hydra:runtime.output_dir}/dvae.pt", "+callbacks.pause._target_=tests.pause_at.PauseAt",
              "+callbacks.pause.flag=${hydra:runtime.output_dir}/flag", "+callbacks.pause.update=3"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dalle_lightning.cli.train", "-m", *common,
                             "module.optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for job in ("0", "1"):
            deadline = time.monotonic() + 300
            while not (sweep / job / "flag.paused").exists():
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.2)
            if job == "0":
                (sweep / job / "flag.go").touch()  # job 0 runs to its end
        proc.send_signal(signal.SIGKILL)  # job 1 is preempted at update 3: its last.ckpt is from update 2
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (sweep / "0" / "dvae.pt").is_file() and not (sweep / "1" / "dvae.pt").exists()
    interrupted = sweep / "1" / "checkpoints" / "last.ckpt"
    assert torch.load(interrupted, map_location="cpu", weights_only=True)["global_step"] == 2
    (sweep / "1" / "flag.go").touch()

    # The requeue: the same job again (its overrides, its sweep directory and its job directory), as SLURM reruns it.
    run_app(train.main, "-m", *common, "module.optimizer.lr=3e-3", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=1")
    (log,) = (sweep / "1").glob("*.log")  # the job's log (Hydra's job logging), the requeued run's lines included
    assert f"resuming from {interrupted}" in log.read_text()
    assert (sweep / "1" / "dvae.pt").is_file()
    assert torch.load(interrupted, map_location="cpu", weights_only=True)["global_step"] == 6
