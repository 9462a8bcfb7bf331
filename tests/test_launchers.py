"""Hydra's submitit launcher (the ``launch`` extra): a real two-job multirun through ``submitit_local``, and the
sbatch script that ``hydra/launcher=slurm`` writes, checked flag by flag against sbatch's own option names.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.conftest import run_app


@pytest.mark.slow
def test_two_job_multirun_through_submitit_local(tiny_world: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import train

    sweep_dir = tmp_path / "sweep"
    # Each job is its own process started by submitit; each trains its own tokenizer into its own run directory.
    run_app(train.main, "-m", "stage=tokenizer", "hydra/launcher=submitit_local", f"paths.work_dir={tiny_world}",
            "output=${hydra:runtime.output_dir}/tokenizer.json", "stage.max_captions=200", "model.vocab_size=300,320",
            "objective=vocab_size", f"hydra.sweep.dir={sweep_dir}")
    for job, vocab in (("0", 300), ("1", 320)):
        assert json.loads((sweep_dir / job / "metrics.json").read_text())["metrics"]["vocab_size"] == vocab
        assert json.loads((sweep_dir / job / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    # Each job held the locks of its own output and directory (one run per output does not serialise a sweep).
    holders = {json.loads((sweep_dir / job / ".run.lock").read_text())["pid"] for job in ("0", "1")}
    assert len(holders) == 2 and all((sweep_dir / job / ".tokenizer.json.lock").is_file() for job in ("0", "1"))
    # submitit kept a result per job: the runs went through it, not through Hydra's in-process launcher.
    assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert [row["value"] for row in summary["runs"]] == [300, 320]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_preset_writes_the_sbatch_flags_a_user_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cluster here: a stand-in ``sbatch`` keeps the script it is given, and the jobs are reported done."""
    import submitit
    from hydra.core.utils import JobReturn, JobStatus

    from dalle_lightning.cli import train

    bin_dir, script = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    _executable(bin_dir / "sbatch", f'#!/bin/sh\ncp "$1" {script}\necho "Submitted batch job 4242"\n')
    _executable(bin_dir / "srun", "#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(submitit.slurm.slurm.SlurmJob, "results",
                        lambda self: [JobReturn(status=JobStatus.COMPLETED, _return_value=None)])
    run_app(train.main, "-m", "stage=tokenizer", "hydra/launcher=slurm", f"paths.work_dir={tmp_path}",
            "model.vocab_size=300,320", f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "hydra.launcher.partition=gpu", "hydra.launcher.account=proj42", "hydra.launcher.qos=high",
            "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=4", "hydra.launcher.gpus_per_node=4",
            "hydra.launcher.cpus_per_task=8", "hydra.launcher.mem_gb=64", "hydra.launcher.timeout_min=90",
            "hydra.launcher.constraint=a100", "hydra.launcher.array_parallelism=1",
            "hydra.launcher.setup=[module load cuda]", "+hydra.launcher.additional_parameters.mail-type=END")
    lines = script.read_text().splitlines()
    flags = {line.split()[1] for line in lines if line.startswith("#SBATCH")}
    assert {"--partition=gpu", "--account=proj42", "--qos=high", "--nodes=2", "--ntasks-per-node=4",
            "--gpus-per-node=4", "--cpus-per-task=8", "--mem=64GB", "--time=90", "--constraint=a100",
            "--array=0-1%1", "--mail-type=END"} <= flags, sorted(flags)
    assert "module load cuda" in lines
