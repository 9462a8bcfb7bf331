"""Which checkpoint ``dalle-train resume=...`` continues from.

Every training run keeps its checkpoints in ``checkpoints/`` of its Hydra run directory
(``<paths.runs>/<stage>/<time>/``): ``last.ckpt`` and the periodic ones, files single-process, sharded directories
under ``strategy=sharded_powersgd``. ``resume=auto`` takes the newest complete one of the stage: of the run that
began last (so a run that was itself resumed and then killed again is continued, not its predecessor), its highest
update, skipping, with one line saying which, any that is truncated or incomplete
(``dalle_lightning_plugins.io.checkpoint_io.checkpoint_problem``); ``resume=PATH`` names one; ``resume=null`` starts
from scratch. "Newest" is read from the runs' and checkpoints' own records (a run's start in its ``launch.json`` or
its directory's name, a checkpoint's ``global_step``), never from file times, which a copy without ``-p`` resets
and a client's clock stamps.

Inside a multirun sweep (``dalle-train -m ... resume=auto``) a job's runs live under the sweep directory
(``<sweep>/<job>/``), not under ``<paths.runs>/<stage>/``: ``auto`` takes the newest complete checkpoint of the
sweep's jobs with this job's overrides (``resume=`` aside), its own directory included, since a requeued job (SLURM
preemption or time limit, ``hydra.launcher.max_num_timeout``) runs again in the very directory it was interrupted
in. A job with no checkpoint yet (its first start) starts afresh, so one command serves both.

Whatever ``resume`` says, a worker that its launcher restarted (``torchrun --max-restarts``, a requeued SLURM job)
continues its own launch; that decision, and this module's answer otherwise, is taken in one place:
:func:`dalle_lightning.run.start_decision.decide_start`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from dalle_lightning import inside
from dalle_lightning.plain_yaml import read_yaml, refuse_stored
from dalle_lightning.run.checkpoint_paths import check_callback_paths
from dalle_lightning.safe_files import UnsafeFile, load_data
from dalle_lightning_plugins.io.checkpoint_io import checkpoint_problem
from dalle_lightning_plugins.io.refusal import CheckpointRefused

log = logging.getLogger("dalle_lightning.train")

AUTO = "auto"
LAST = "last.ckpt"


def checkpoint_step(path: Path) -> int | None:
    """The update a complete checkpoint was taken after (``global_step`` in its own metadata: the file's, or a
    sharded directory's metadata file), None where it does not say. Not the file's time, which a copy without
    ``-p`` resets and a client's clock stamps."""
    try:
        if path.is_dir():
            from dalle_lightning_plugins.io.dcp_checkpoint import read_metadata

            saved = read_metadata(path)
        else:
            try:  # mmap: the tensors stay on disk, only the small pickle is read (as data: weights_only)
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # an archive torch cannot map (written by an old torch)
                saved = torch.load(path, map_location="cpu", weights_only=True)
        step = saved.get("global_step") if isinstance(saved, dict) else None
    except Exception:  # noqa: BLE001 - complete but unreadable here: it orders last, it is not dropped
        return None
    return int(step) if isinstance(step, int) else None


def run_start(run: Path) -> str:
    """When a run began, as its own record says (``launch.json``'s ``started``, written by rank 0 when it starts),
    else its directory's name (``${run_id:}``: the start time first); never a file time. A record that is a link
    out of the run is refused in one line (:mod:`dalle_lightning.inside`), never read."""
    record = inside.check(run / LAUNCH_FILE, run, "resume")
    try:
        started = json.loads(record.read_text()).get("started")
    except (OSError, ValueError, AttributeError):
        started = None
    return str(started) if started else run.name


def _runs_newest_first(run_dirs: Iterable[Path]) -> list[Path]:
    return sorted(run_dirs, key=lambda run: (run_start(run), run.name), reverse=True)


def _by_step(paths: Iterable[Path]) -> list[tuple[Path, int | None]]:
    """``paths`` with their steps, the highest step first (unknown steps last; ties: last.ckpt, then by name)."""
    stepped = [(p, checkpoint_step(p)) for p in paths]
    return sorted(stepped, key=lambda ps: (ps[1] if ps[1] is not None else -1, ps[0].name == LAST, ps[0].name),
                  reverse=True)


def _checkpoint_files(run: Path) -> list[Path]:
    """The checkpoints in ``run``'s ``checkpoints/``; the folder or a file there that is a link out of the run (a
    handed work_dir or sweep) is refused in one line naming it, before it is listed or read."""
    inside.check(run / "checkpoints", run, "resume")
    files = [p for p in (run / "checkpoints").glob("*.ckpt") if not p.name.startswith(".")]
    for path in files:
        inside.check(path, run, "resume")
    return files


def newest_checkpoint(runs: Path, stage: str, exclude: Path | None = None) -> Path | None:
    """The newest complete checkpoint of ``<runs>/<stage>/*/`` (not under ``exclude``), or None."""
    return newest_complete(stage_runs(runs, stage, exclude))[0]


def stage_runs(runs: Path, stage: str, exclude: Path | None = None) -> list[Path]:
    """The run directories of ``stage`` under ``runs`` (without ``exclude``, this run's own new directory); one that
    is a link out of ``runs`` (a handed work_dir) is refused in one line naming it, before anything in it is read."""
    inside.check(runs / stage, runs, "resume=auto")
    found = [d for d in (runs / stage).glob("*") if inside.check(d, runs, "resume=auto").is_dir()]
    return [d for d in found if exclude is None or d.resolve() != exclude.resolve()]


def newest_complete(run_dirs: Iterable[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint of ``run_dirs`` (None if none) and the incomplete ones passed over, with why:
    the run that began last first (a run that continued another began after it, so a resumed run that was killed
    again is continued, not its predecessor), and in a run the highest step."""
    skipped = []
    for run in _runs_newest_first(run_dirs):
        complete = []
        for path in _checkpoint_files(run):
            problem = checkpoint_problem(path)
            if problem is None:
                complete.append(path)
            else:
                skipped.append((path, problem))
        if complete:
            return _by_step(complete)[0][0], skipped
    return None, skipped


def launch_checkpoints(run_dirs: Iterable[Path]) -> list[tuple[Path, int | None]]:
    """Every complete checkpoint of one launch's runs, the highest step first (its attempts continue each other,
    so the highest step is the newest, whichever directory holds it)."""
    return _by_step(p for run in run_dirs for p in _checkpoint_files(run) if checkpoint_problem(p) is None)


def sweep_job_runs(sweep_dir: Path, overrides: Iterable[str]) -> list[Path]:
    """The directories of ``sweep_dir``'s jobs that ran with ``overrides`` (compared without ``resume=...``, as
    Hydra saved them in ``<job>/.hydra/overrides.yaml``). A job, or its saved overrides, that is a link out of the
    sweep is refused in one line naming it, never read."""
    want = _job_key(overrides)
    jobs = []
    for job in sweep_dir.glob("*"):
        saved = job / ".hydra" / "overrides.yaml"
        inside.check(saved, sweep_dir, "resume=auto")
        if job.is_dir() and saved.is_file():
            try:  # the texts Hydra saved, compared as texts: a ${...} in one is never resolved
                listed = read_yaml(saved)
            except (OSError, ValueError):
                continue  # a job directory Hydra did not finish making
            if isinstance(listed, list) and _job_key(str(o) for o in listed) == want:
                jobs.append(job)
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
        try:
            saved = saved_values(found, "resume")  # its paths before anything is built; the fit checks the whole file
        except (ValueError, CheckpointRefused):
            raise  # a refusal: one line
        except Exception:  # noqa: BLE001 - unreadable here, so the fit's own load fails before a callback state is used
            saved = None
        if isinstance(saved, dict):
            check_callback_paths(saved, found, "resume", run_dir)
        return str(found)
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"resume={value}: no such checkpoint; expected a checkpoint file or sharded "
                                f"checkpoint directory (<run>/checkpoints/{LAST}), or resume=auto")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"resume={value}: {problem}; expected a complete checkpoint (resume=auto skips incomplete ones)")
    check_data(path, f"resume={value}:", run_dir)
    return str(path)


def check_data(path: str | Path, key: str, run_dir: Path | None = None) -> None:
    """A one-line ``ValueError`` (an :class:`~dalle_lightning.safe_files.UnsafeFile` for a file that asks for
    code; ``key`` first) unless the checkpoint file ``path`` is a Lightning checkpoint of tensors and plain values,
    as every checkpoint ``dalle-train`` writes is: it loads under ``torch.load(weights_only=True)``, as the fit that
    resumes from it loads it (``Trainer.fit(weights_only=True)``, where a refusal would be a long traceback), and
    its hyper-parameters name nothing to build (``_target_``, Lightning's ``_instantiator``: the project's modules
    save neither). A sharded checkpoint directory's tensors are read by the strategy's own loader, which refuses the
    same way; its ``meta.pt`` (callback states, hyper-parameters) is read here, as data. Either way the non-tensor
    values are checked (:func:`check_plain_state`; ``run_dir``: the resuming run's own directory)."""
    path = Path(path)
    saved = saved_values(path, key)
    if path.is_dir():
        check_plain_state(saved, path, key, run_dir)
        return
    what = f"{key.rstrip(':')}: checkpoint"
    if not isinstance(saved, dict) or not isinstance(saved.get("state_dict"), dict) or "global_step" not in saved:
        raise ValueError(f"{what} {str(path)!r} is not a Lightning checkpoint (no state_dict or global_step); "
                         f"expected {LAST} or a periodic checkpoint of a dalle-train run")
    hparams = saved.get("hyper_parameters")
    builds = [k for k in ("_target_", "_instantiator", "class_path") if isinstance(hparams, dict) and k in hparams]
    if builds:
        raise UnsafeFile(f"{what} {str(path)!r} asks to build {hparams[builds[0]]!r} (hyper_parameters.{builds[0]}), "
                         f"which dalle-train never writes, so it was not used; expected a checkpoint dalle-train wrote")
    check_plain_state(saved, path, key, run_dir)


def saved_values(path: Path, key: str) -> Any:
    """What the checkpoint at ``path`` holds, read as data (a refused global is one line, ``key`` first): a file
    memory-mapped (its tensors stay on disk), a sharded directory's metadata (callbacks, loops, hyper-parameters)."""
    if path.is_dir():
        from dalle_lightning_plugins.io.dcp_checkpoint import read_metadata

        return read_metadata(path, weights_only=True)
    what, fix = f"{key.rstrip(':')}: checkpoint", "resume from a checkpoint dalle-train wrote"
    try:
        return load_data(path, what, fix, mmap=True)
    except RuntimeError:  # an archive torch cannot map (written by an old torch): read it whole, as data too
        return load_data(path, what, fix)


def check_plain_state(saved: dict, path: Path, key: str, run_dir: Path | None = None) -> None:
    """The checkpoint's values that are not tensors stay values: its hyper-parameters hold no interpolation
    (``${...}``, which nothing resolves from a file: refused in one line naming the key), and every path in its
    callback states lies inside the checkpoint directory the state names (:mod:`.checkpoint_paths`)."""
    if isinstance(saved, dict):
        refuse_stored(saved.get("hyper_parameters"), path, "hyper_parameters",
                      "resume from a checkpoint dalle-train wrote", what=f"{key.rstrip(':')}: checkpoint")
        check_callback_paths(saved, path, key, run_dir)


LAUNCH_FILE = "launch.json"  # in a run directory: when it began and the launch it belongs to (start_decision.py)
FINISHED_FILE = "metrics.json"  # written by rank 0 when the run ends: a finished run is never continued by a restart
