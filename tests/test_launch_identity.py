"""A launch is one launch: a worker continues an earlier attempt only when its launcher says it restarted it
(``dalle_lightning/run/start_decision.py``, ``dalle_lightning_plugins/environments/launch_identity.py``).

torchrun's part runs the real torchrun (one node, one worker that records what torchrun tells it:
``tests/helpers/launch_env_worker.py``) twice with the same ``--rdzv-id``, the first launch's worker dying once;
the decisions are then taken on real run directories and checkpoint files with exactly those environments.
SLURM's part gives the decision the variables SLURM sets in a job and in a requeued job.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.run.start_decision import AFRESH, CONTINUE, RESUME, StartDecision, decide_start
from dalle_lightning_plugins.environments.launch_identity import this_launch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "helpers" / "launch_env_worker.py"
COMMAND = ["stage=prior", "trainer.max_steps=10"]


def _cfg(work: Path) -> DictConfig:
    return OmegaConf.create({"paths": {"runs": str(work / "runs"), "work_dir": str(work)}, "stage": {"name": "prior"},
                             "resume": None})


def _attempt(work: Path, env: dict[str, str], name: str, started: str | None = None, trained_to: int | None = None,
             requested: str | None = None, overrides: list[str] = COMMAND) -> tuple[StartDecision, Path]:
    """One attempt as ``dalle-train`` makes it: its run directory (the launch's agreed start where torchrun gave
    one, as ``run_lock.run_id`` names it), the decision, and, with ``trained_to``, the checkpoint of that update
    that a kill left behind (no ``metrics.json``)."""
    run_dir = work / "runs" / "prior" / (started or name)
    run_dir.mkdir(parents=True, exist_ok=True)
    decision = decide_start(_cfg(work), requested, run_dir, None, overrides, this_launch(env, started))
    if trained_to is not None:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        torch.save({"global_step": trained_to}, run_dir / "checkpoints" / "last.ckpt")
    return decision, run_dir


# ------------------------------------------------------------------------------------------------------- SLURM

JOB = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}


def test_the_same_command_twice_in_one_slurm_job_starts_afresh_the_second_time(tmp_path: Path) -> None:
    first, _ = _attempt(tmp_path, JOB, "2026-11-28_08-00-00_aaaa", trained_to=4)  # killed after update 4's checkpoint
    assert first.kind == AFRESH, first.reason
    second, _ = _attempt(tmp_path, JOB, "2026-11-28_08-05-00_bbbb")  # the same overrides, next line of the script
    assert (second.kind, second.checkpoint) == (AFRESH, None), second.reason
    given = str(tmp_path / "elsewhere.ckpt")
    third, _ = _attempt(tmp_path, JOB, "2026-11-28_08-10-00_cccc", requested=given)
    assert (third.kind, third.checkpoint) == (RESUME, given), third.reason


def test_a_requeued_slurm_job_continues_its_run_and_only_its_run(tmp_path: Path) -> None:
    _, first = _attempt(tmp_path, JOB, "2026-11-28_08-00-00_aaaa", trained_to=4)
    requeued = dict(JOB, SLURM_RESTART_COUNT="1")
    other, _ = _attempt(tmp_path, requeued, "2026-11-28_09-00-00_dddd", overrides=["stage=prior", "seed=3"])
    assert other.kind == AFRESH, other.reason  # another command of the requeued script: not this run
    again, second = _attempt(tmp_path, requeued, "2026-11-28_09-00-01_eeee", trained_to=8)  # killed once more
    assert (again.kind, again.checkpoint) == (CONTINUE, str(first / "checkpoints" / "last.ckpt")), again.reason
    assert "SLURM requeued job 4242" in again.reason and "(update 4)" in again.reason
    third, _ = _attempt(tmp_path, dict(JOB, SLURM_RESTART_COUNT="2"), "2026-11-28_10-00-00_ffff")
    assert third.checkpoint == str(second / "checkpoints" / "last.ckpt"), third.reason  # update 8, the newest
    later_job, _ = _attempt(tmp_path, {"SLURM_JOB_ID": "4243"}, "2026-11-29_08-00-00_gggg")
    assert later_job.kind == AFRESH, later_job.reason  # the unfinished run is never continued by another launch


# ----------------------------------------------------------------------------------------------------- torchrun

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, fail_first: bool) -> dict[int, dict]:
    """One torchrun launch with ``--rdzv-id=100`` (what a person reuses for days); its workers' records by attempt."""
    out.mkdir(parents=True)
    argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1",
            "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
            "--rdzv-id=100", str(WORKER), str(out), "1" if fail_first else "0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={
        "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(out)})
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(p.stem.removeprefix("attempt")): json.loads(p.read_text()) for p in out.glob("attempt*.json")}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict]]:
    """Two launches with the same rendezvous id: the first one's worker dies once and is restarted."""
    out = tmp_path_factory.mktemp("torchrun")
    return [_torchrun(out / "first", fail_first=True), _torchrun(out / "second", fail_first=False)]


def test_a_torchrun_restart_continues_its_launch_in_its_one_directory(launches: list[dict[int, dict]],
                                                                       tmp_path: Path) -> None:
    first = launches[0]
    assert sorted(first) == [0, 1], first  # torchrun restarted the worker once
    assert first[0]["started"] == first[1]["started"] is not None  # agreed in the agents' store, kept by the restart
    assert first[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    start, run = _attempt(tmp_path, first[0]["env"], "", first[0]["started"], trained_to=4)
    assert start.kind == AFRESH, start.reason
    restart, same_run = _attempt(tmp_path, first[1]["env"], "", first[1]["started"])
    assert same_run == run  # one directory for every attempt of the launch
    assert (restart.kind, restart.checkpoint) == (CONTINUE, str(run / "checkpoints" / "last.ckpt")), restart.reason
    assert restart.reason.startswith("torchrun restarted this launch's workers (TORCHELASTIC_RESTART_COUNT=1")


def test_a_new_torchrun_launch_with_the_same_rdzv_id_starts_as_resume_says(launches: list[dict[int, dict]],
                                                                          tmp_path: Path) -> None:
    first, second = launches
    assert second[0]["env"]["TORCHELASTIC_RUN_ID"] == first[0]["env"]["TORCHELASTIC_RUN_ID"] == "100"
    assert second[0]["started"] != first[0]["started"]  # a new store: a new launch
    _attempt(tmp_path, first[1]["env"], "", first[1]["started"], trained_to=4)  # the first launch, killed
    fresh, run = _attempt(tmp_path, second[0]["env"], "", second[0]["started"])
    assert (fresh.kind, fresh.checkpoint) == (AFRESH, None), fresh.reason
    given = str(tmp_path / "given.ckpt")
    asked, _ = _attempt(tmp_path, second[0]["env"], "", second[0]["started"], requested=given)
    assert (asked.kind, asked.checkpoint) == (RESUME, given), asked.reason
    assert json.loads((run / "launch.json").read_text())["started"] == second[0]["started"]


def test_every_rank_of_a_launch_logs_into_its_one_directory(tmp_path: Path) -> None:
    """Rank 0 keeps ``train.log`` and ``.hydra/``; another rank of the same directory writes ``train.rank1.log``."""
    from hydra import compose, initialize_config_dir
    from lightning_utilities.core.rank_zero import rank_zero_only

    from dalle_lightning.run.run_guard import rank_logs
    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose("train", overrides=[f"paths.work_dir={tmp_path}"], return_hydra_config=True)
    rank_logs(config, str(tmp_path / "run"))  # rank 0
    assert config.hydra.output_subdir == ".hydra"
    rank_zero_only.rank = 1  # as Lightning reads it from torchrun's RANK (conftest restores it)
    rank_logs(config, str(tmp_path / "run"))
    name = config.hydra.job.name  # "train" under dalle-train
    assert config.hydra.job_logging.handlers.file.filename == str(tmp_path / "run" / f"{name}.rank1.log")
    assert config.hydra.output_subdir is None
