"""Where a training run starts: afresh, from what ``resume=`` names, or where an earlier attempt of this same
launch stopped. One function, :func:`decide_start`, takes that decision, once, with its reason.

Continuing needs the launcher's word that it restarted this launch (``dalle_lightning_plugins.environments.launch_identity``):

- **torchrun**: an unfinished run whose ``launch.json`` names one of this launch's agents (each agent's own log
  directory, made when the agent started and kept over its restarts) and, where torchrun shares its agents' store,
  the same launch start. A new ``torchrun``, even with the same ``--rdzv-id``, has new agents and a new start.
- **SLURM**: ``SLURM_RESTART_COUNT`` > 0 (the scheduler requeued the job) and an unfinished run of this job with
  this command's overrides. A second command in the same job or allocation reads 0 and starts as ``resume=`` says.

Everything else starts as ``resume=`` says. A run that ended (``metrics.json``) is never continued, and a run whose
launch used up its restarts is never continued by a later launch, which is a new one.

Collective (every rank calls it once the default process group is up, or alone): the ranks pool their views of
the launch, each lists the complete checkpoints it sees of the earlier attempts by their path relative to
``paths.work_dir`` (nodes may mount the shared file system at different places), and all take the newest that
every rank holds. Rank 0 then records this run's start and launch in its run directory (``launch.json``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dalle_lightning.run.exits import process_rank
from dalle_lightning.run.resume import FINISHED_FILE, LAUNCH_FILE, _job_key, launch_checkpoints, stage_runs
from dalle_lightning_plugins.io.atomic_files import write_json
from dalle_lightning_plugins.environments.elastic import agree_on_checkpoint, all_gather_objects
from dalle_lightning_plugins.environments.launch_identity import Launch, agreed_start, pool, this_launch

AFRESH, RESUME, CONTINUE = "afresh", "resume", "continue"


@dataclass(frozen=True)
class StartDecision:
    """Where the run starts (``kind``: afresh, resume, continue), from which checkpoint, and why, in one line."""

    kind: str
    checkpoint: str | None
    reason: str


def earlier_attempt(record: dict[str, Any], launch: Launch, overrides: Iterable[str] | None) -> str | None:
    """Why ``record`` (a ``launch.json``) is an earlier attempt of ``launch``, or None when it is not one."""
    agents = set(record.get("agents") or []) & set(launch.agents)
    started = record.get("started")
    if agents and (launch.started is None or started == launch.started):
        count = launch.torchrun_restarts
        return f"torchrun restarted this launch's workers (TORCHELASTIC_RESTART_COUNT={count} at most)"
    same_command = overrides is None or record.get("overrides") in (None, list(_job_key(overrides)))
    if launch.slurm_restarts > 0 and launch.slurm_job and record.get("slurm_job") == launch.slurm_job and same_command:
        return f"SLURM requeued job {launch.slurm_job} (SLURM_RESTART_COUNT={launch.slurm_restarts})"
    return None


def earlier_runs(run_dirs: Iterable[Path], launch: Launch,
                 overrides: Iterable[str] | None) -> list[tuple[Path, dict[str, Any], str]]:
    """The unfinished runs that earlier attempts of ``launch`` wrote, with their records and why they match."""
    found = []
    for run in run_dirs:
        if (run / FINISHED_FILE).exists():
            continue
        try:
            record = json.loads((run / LAUNCH_FILE).read_text())
        except (OSError, ValueError):
            continue  # not a run this code started, or one whose record was never finished
        why = earlier_attempt(record, launch, overrides) if isinstance(record, dict) else None
        if why is not None:
            found.append((run, record, why))
    return found


def candidate_runs(cfg: DictConfig, sweep: tuple[Path, list[str]] | None) -> list[Path]:
    """Where earlier attempts left their runs: the stage's run directories, or a sweep's jobs."""
    if sweep is not None:
        return [d for d in sweep[0].glob("*") if d.is_dir()]
    return stage_runs(Path(cfg.paths.runs), cfg.stage.name)


def relative(path: Path, work_dir: Path) -> str:
    """``path`` as every node names it: relative to its own ``paths.work_dir`` (not resolved: a link stays)."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(work_dir))


def decide_start(cfg: DictConfig, requested: str | None, run_dir: Path | None,
                 sweep: tuple[Path, list[str]] | None = None, overrides: list[str] | None = None,
                 launch: Launch | None = None) -> StartDecision:
    """Collective: where this run starts (see the module docstring), with the one line that says why (the caller
    logs it, once, on rank 0); rank 0 records the run's launch. ``requested``: the checkpoint ``resume=`` names
    (``resume.resume_checkpoint``), None for afresh; ``launch``: this rank's view of its launch (by default what
    its launcher's environment and store say)."""
    view = launch if launch is not None else this_launch(started=agreed_start())
    launch = pool(all_gather_objects(view))
    earlier = earlier_runs(candidate_runs(cfg, sweep), launch, overrides) if launch.restarting_launcher else []
    work_dir = Path(str(cfg.paths.work_dir))
    mine = [(relative(path, work_dir), step) for path, step in launch_checkpoints(run for run, _, _ in earlier)]
    found_earlier = any(all_gather_objects(bool(earlier)))  # every rank's reading is done past this point
    chosen = agree_on_checkpoint([rel for rel, _ in mine])
    if chosen is not None:
        step = dict(mine).get(chosen)
        at = f" (update {step})" if step is not None else ""
        path = os.path.normpath(work_dir / chosen)  # this rank's own name of it
        decision = StartDecision(CONTINUE, path, f"{earlier[0][2]}: continuing this launch from {path}{at}")
    elif requested is not None:
        why = "; the launch's earlier attempts left no checkpoint every rank holds" if found_earlier else ""
        decision = StartDecision(RESUME, requested, f"resuming from {requested} (resume={cfg.get('resume')}){why}")
    else:
        why = ("restarted by the launcher before the launch wrote a checkpoint every rank holds" if found_earlier
               else "resume=null and no earlier attempt of this launch")
        decision = StartDecision(AFRESH, None, f"starting afresh: {why}")
    if process_rank() == 0 and run_dir is not None:
        record_launch(run_dir, launch, overrides, [record for _, record, _ in earlier])
    return decision


def record_launch(run_dir: Path, launch: Launch, overrides: Iterable[str] | None,
                  earlier: Iterable[dict[str, Any]] = ()) -> None:
    """Rank 0: this run's start and launch in its directory (``launch.json``), with the agents of the attempts it
    continues, so that a later restart of any of them finds it."""
    record = launch.record()
    record["agents"] = sorted(set(record["agents"]).union(*(set(r.get("agents") or []) for r in earlier)))
    record["started"] = launch.started or time.strftime("%Y-%m-%d_%H-%M-%S")
    record["overrides"] = None if overrides is None else list(_job_key(overrides))
    write_json(run_dir / LAUNCH_FILE, record)
