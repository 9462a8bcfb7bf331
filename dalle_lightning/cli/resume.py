"""Which checkpoint ``dalle-train resume=...`` continues from.

Every training run keeps its checkpoints in ``checkpoints/`` of its Hydra run directory
(``<paths.runs>/<stage>/<time>/``): ``last.ckpt`` and the periodic ones, files single-process, sharded directories
under ``strategy=sharded_powersgd``. ``resume=auto`` takes the newest complete one of the stage (the last written,
so a run that was itself resumed and then killed again is continued, not its predecessor), skipping, with one line
saying which, any that is truncated or incomplete (``dalle_lightning_plugins.checkpoint_io.checkpoint_problem``);
``resume=PATH`` names one; ``resume=null`` starts from scratch.

Inside a multirun sweep (``dalle-train -m ... resume=auto``) a job's runs live under the sweep directory
(``<sweep>/<job>/``), not under ``<paths.runs>/<stage>/``: ``auto`` takes the newest complete checkpoint of the
sweep's jobs with this job's overrides (``resume=`` aside), its own directory included, since a requeued job (SLURM
preemption or time limit, ``hydra.launcher.max_num_timeout``) runs again in the very directory it was interrupted
in. A job with no checkpoint yet (its first start) starts afresh, so one command serves both.

Whatever ``resume`` says, a worker that a restarting launcher started again (``torchrun --max-restarts``, a requeued
SLURM job) continues its own launch: :func:`restart_checkpoint` finds the unfinished runs of the launch
(``launch.json``) and the ranks agree on the newest checkpoint they all hold.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dalle_lightning.cli.common import process_rank
from dalle_lightning_plugins.atomic_files import write_json
from dalle_lightning_plugins.checkpoint_io import checkpoint_problem
from dalle_lightning_plugins.elastic import agree_on_checkpoint, all_gather_objects, restart_count

log = logging.getLogger("dalle_lightning.train")

AUTO = "auto"
LAST = "last.ckpt"


def checkpoints_in(run_dirs: Iterable[Path]) -> list[Path]:
    """Every checkpoint (``checkpoints/*.ckpt``, not a temporary one) of ``run_dirs``, newest first."""
    found = [p for run in run_dirs for p in (run / "checkpoints").glob("*.ckpt") if not p.name.startswith(".")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def newest_checkpoint(runs: Path, stage: str, exclude: Path | None = None) -> Path | None:
    """The most recently written complete checkpoint of ``<runs>/<stage>/*/`` (not under ``exclude``), or None."""
    return newest_complete(stage_runs(runs, stage, exclude))[0]


def stage_runs(runs: Path, stage: str, exclude: Path | None = None) -> list[Path]:
    """The run directories of ``stage`` under ``runs`` (without ``exclude``, this run's own new directory)."""
    return [d for d in (runs / stage).glob("*") if d.is_dir() and (exclude is None or d.resolve() != exclude.resolve())]


def newest_complete(run_dirs: Iterable[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``run_dirs`` (None if none) and the newer ones skipped, with why."""
    skipped = []
    for path in checkpoints_in(run_dirs):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def sweep_job_runs(sweep_dir: Path, overrides: Iterable[str]) -> list[Path]:
    """The directories of ``sweep_dir``'s jobs that ran with ``overrides`` (compared without ``resume=...``, as
    Hydra saved them in ``<job>/.hydra/overrides.yaml``)."""
    want = _job_key(overrides)
    jobs = []
    for job in sweep_dir.glob("*"):
        saved = job / ".hydra" / "overrides.yaml"
        if job.is_dir() and saved.is_file():
            try:
                if _job_key(OmegaConf.load(saved) or []) == want:
                    jobs.append(job)
            except (OSError, OmegaConfBaseException, ValueError):
                continue  # a job directory Hydra did not finish making
    return jobs


def _job_key(overrides: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(o for o in overrides if not str(o).lstrip("+~").startswith("resume=")))


def _skipped(skipped: list[tuple[Path, str]]) -> str:
    return "; ".join(f"{path} ({problem})" for path, problem in skipped)


def resume_checkpoint(cfg: DictConfig, run_dir: Path | None = None,
                      sweep: tuple[Path, list[str]] | None = None) -> str | None:
    """The checkpoint ``cfg.resume`` asks for, as a path for ``Trainer.fit(ckpt_path=...)``; None to start afresh.

    ``run_dir`` (this run's own, new directory) is never a candidate for ``auto`` outside a sweep; ``sweep`` (the
    sweep directory and this job's overrides) makes ``auto`` look at the sweep's jobs with the same overrides.
    Raises a one-line ``ValueError`` or ``FileNotFoundError`` for a value that names no (complete) checkpoint."""
    value = cfg.get("resume")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"resume={value!r}; expected null, auto, or the path of a checkpoint (checkpoints/{LAST})")
    if cfg.stage.name == "tokenizer":
        raise ValueError(f"resume={value} with stage=tokenizer; expected resume=null (the tokenizer trains without "
                         "checkpoints)")
    if value == AUTO:
        if sweep is not None:
            where = f"{sweep[0]}/<jobs with this job's overrides>/checkpoints/"
            found, skipped = newest_complete(sweep_job_runs(*sweep))
            if found is None and not skipped:
                log.info("resume=auto: no checkpoint of this sweep job yet in %s; starting afresh", sweep[0])
                return None
        else:
            runs = Path(cfg.paths.runs)
            where = f"{runs / cfg.stage.name}/*/checkpoints/"
            found, skipped = newest_complete(stage_runs(runs, cfg.stage.name, run_dir))
        if found is None:
            detail = f" (every one is incomplete: {_skipped(skipped)})" if skipped else ""
            raise FileNotFoundError(f"resume=auto found no complete checkpoint in {where}{detail}; expected an "
                                    f"earlier {cfg.stage.name} run of this work_dir, or resume=PATH")
        if skipped:
            log.warning("resume=auto: skipped %s; resuming from %s", _skipped(skipped), found)
        return str(found)
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"resume={value}: no such checkpoint; expected a checkpoint file or sharded "
                                f"checkpoint directory (<run>/checkpoints/{LAST}), or resume=auto")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"resume={value}: {problem}; expected a complete checkpoint (resume=auto skips incomplete ones)")
    return str(path)


# ---------------------------------------------------------------------------------------------- restarted launches

LAUNCH_FILE = "launch.json"  # in a run directory: the launch it belongs to (dalle_lightning_plugins.elastic.launch_ids)
FINISHED_FILE = "metrics.json"  # written by rank 0 when the run ends: a finished run is never continued by a restart


def launch_runs(run_dirs: Iterable[Path], ids: Iterable[str], overrides: Iterable[str] | None = None) -> list[Path]:
    """The run directories an earlier attempt of this launch made (its ``launch.json`` names one of ``ids``), with
    the same command-line ``overrides`` (``resume=`` aside; where known), and that did not finish. The overrides
    tell apart two runs one SLURM job made one after the other."""
    wanted = set(ids)
    key = None if overrides is None else list(_job_key(overrides))
    found = []
    for run in run_dirs:
        try:
            record = json.loads((run / LAUNCH_FILE).read_text())
            recorded = set(record.get("ids", []))
        except (OSError, ValueError, AttributeError):
            continue  # not a run of a restarting launcher, or one whose file was never finished
        same = key is None or record.get("overrides") is None or record["overrides"] == key
        if recorded & wanted and same and not (run / FINISHED_FILE).exists():
            found.append(run)
    return found


def candidate_runs(cfg: DictConfig, sweep: tuple[Path, list[str]] | None) -> list[Path]:
    """Where a restarted attempt looks for its launch's runs: the stage's run directories, or a sweep's jobs."""
    if sweep is not None:
        return [d for d in sweep[0].glob("*") if d.is_dir()]
    return stage_runs(Path(cfg.paths.runs), cfg.stage.name)


def record_launch(run_dir: Path, ids: Iterable[str], overrides: Iterable[str] | None = None) -> None:
    """Name this run's launch (and its command-line overrides) in its directory (rank 0), so that a restart of the
    launch finds the run."""
    write_json(run_dir / LAUNCH_FILE, {"ids": sorted(set(ids)), "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "overrides": None if overrides is None else list(_job_key(overrides))})


def restart_checkpoint(cfg: DictConfig, requested: str | None, run_dir: Path | None,
                       sweep: tuple[Path, list[str]] | None, local_ids: list[str],
                       overrides: list[str] | None = None) -> str | None:
    """Collective (every rank calls it once the default process group is up, or alone): the checkpoint a run
    continues from when a restarting launcher started it again.

    The ranks pool their launch ids (:func:`dalle_lightning_plugins.elastic.launch_ids`: every node's torchrun
    agent, the rendezvous id, the SLURM job), find the unfinished runs of this launch, and agree on the newest
    checkpoint every rank holds complete; rank 0 then names the launch in its own run directory. With no earlier
    attempt (a launch's first start, or no restarting launcher) the run goes on with ``requested``
    (``resume=...``)."""
    pooled = sorted({i for ids in all_gather_objects(local_ids) for i in ids})
    if not pooled:
        return requested
    runs = launch_runs(candidate_runs(cfg, sweep), pooled, overrides)
    complete = []
    for path in checkpoints_in(runs):
        if checkpoint_problem(path) is None:
            complete.append(str(path))
    chosen = agree_on_checkpoint(complete)
    if run_dir is not None and process_rank() == 0:
        record_launch(run_dir, pooled, overrides)
    if chosen is not None:
        log.info("restarted by the launcher (attempt %d on this node): resuming from %s", restart_count(), chosen)
        return chosen
    if runs:
        log.info("restarted by the launcher: no complete checkpoint of this launch yet; starting afresh")
    return requested
