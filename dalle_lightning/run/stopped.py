"""A training run stopped by SIGTERM or SIGINT says so: one line naming the checkpoint to continue from, exit code
128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a process a signal ended.

Lightning stops a fit on SIGTERM by raising ``SIGTERMException``, a ``SystemExit`` without a code, so a stopped
run used to exit 0 as if it had finished; on SIGINT it catches the ``KeyboardInterrupt`` and exits 1. The
checkpoint callback (``dalle_lightning_callbacks.paced_checkpoint.PacedCheckpoint``, ``save_on_stop``) finishes
the update under way and checkpoints it before the fit stops, so that ``resume=`` continues exactly
(docs/resume.md, "Stopping a run").

Workers that ``torchrun`` started are left as they were: the launcher stops healthy workers with SIGTERM to
restart them, and ``dalle_lightning.run.exits.lost_peer_exit`` reports the one case that needs a line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from dalle_lightning.run.exits import process_rank
from dalle_lightning_plugins.io.checkpoint_io import checkpoint_problem

SIGNAL_CONNECTOR_LOG = "lightning.pytorch.trainer.connectors.signal_connector"  # "Received SIGTERM: 15"


def under_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env


@contextlib.contextmanager
def stop_reported(cfg: DictConfig, trainer: Any, resumed_from: str | None = None,
                  sweep: tuple[Path, list[str]] | None = None) -> Iterator[None]:
    """Around ``trainer.fit`` (and the validation after it): a stop by SIGTERM or SIGINT ends the process with one
    line (rank 0) and exit code 128 + the signal. Anything else passes through untouched."""
    if under_torchrun():
        yield
        return
    connector_log = logging.getLogger(SIGNAL_CONNECTOR_LOG)
    level = connector_log.level
    connector_log.setLevel(max(level, logging.WARNING))  # the one line below says it
    try:
        yield
    except SIGTERMException:
        stop(cfg, trainer, _pending(trainer) or signal.SIGTERM, resumed_from, sweep)
    except SystemExit as exc:  # Lightning ends a fit that a KeyboardInterrupt stopped with sys.exit(1)
        if not isinstance(exc.__context__, KeyboardInterrupt):
            raise
        stop(cfg, trainer, signal.SIGINT, resumed_from, sweep)
    except KeyboardInterrupt:
        stop(cfg, trainer, signal.SIGINT, resumed_from, sweep)
    except RuntimeError as exc:
        pending = _pending(trainer)
        if pending is None or "DataLoader worker" not in str(exc):
            raise
        # the signal reached the data loader's workers too (a terminal's Ctrl+C, a scheduler signalling every
        # process), which ended: the batch the stop still needed could not be read
        stop(cfg, trainer, pending, resumed_from, sweep)
    finally:
        connector_log.setLevel(level)


def _pending(trainer: Any) -> int | None:
    """The signal a checkpoint callback deferred (``PacedCheckpoint.stop_signal``), if any."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        signum = getattr(callback, "stop_signal", None)
        if signum is not None:
            return int(signum)
    return None


def stop(cfg: DictConfig, trainer: Any, signum: int, resumed_from: str | None,
         sweep: tuple[Path, list[str]] | None = None) -> None:
    """Print the stop's one line (rank 0) and exit with 128 + ``signum``."""
    if process_rank() == 0:
        print(f"error: {stop_message(cfg, trainer, signum, resumed_from, sweep)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.exit(128 + int(signum))


def stop_message(cfg: DictConfig, trainer: Any, signum: int, resumed_from: str | None,
                 sweep: tuple[Path, list[str]] | None = None) -> str:
    """``stopped by SIGTERM after 12 updates; the run's last checkpoint is P (update 12): continue it with
    resume=P (or resume=auto)``, or what to do when the run wrote no checkpoint."""
    updates = int(getattr(trainer, "global_step", 0))
    head = f"stopped by {signal.Signals(signum).name} after {updates} update{'' if updates == 1 else 's'}"
    found = last_checkpoint(trainer)
    if found is not None:
        path, step = found
        at = f" (update {step})" if step is not None else ""
        auto = " (or resume=auto)" if _auto_finds(cfg, path, sweep) else ""
        return f"{head}; the run's last checkpoint is {path}{at}: continue it with resume={path}{auto}"
    if resumed_from is not None:
        return (f"{head}, before this run wrote a checkpoint; the checkpoint it continued from is kept: continue "
                f"with resume={resumed_from}")
    return f"{head}, before the run wrote a checkpoint; nothing to resume: run the command again to start afresh"


def last_checkpoint(trainer: Any) -> tuple[Path, int | None] | None:
    """The newest complete checkpoint in the run's checkpoint directories (the highest update its own metadata
    records; ``last.ckpt`` first among equals), and its update."""
    from dalle_lightning.run.resume import checkpoint_step

    found: list[tuple[tuple[int, bool], Path, int | None]] = []  # by the update the checkpoint itself records
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        newest = getattr(callback, "last_model_path" if getattr(callback, "save_last", None) else "best_model_path", "")
        step = getattr(callback, "_last_global_step_saved", None)
        dirpath = getattr(callback, "dirpath", None)
        paths = {Path(newest)} if newest else set()
        if dirpath and Path(dirpath).is_dir():
            paths |= {p for p in Path(dirpath).glob("*.ckpt") if not p.name.startswith(".")}
        for path in paths:
            if path.exists() and checkpoint_problem(path) is None:
                known = str(path) == newest and isinstance(step, int) and step >= 0
                saved = checkpoint_step(path)  # never the file time (a copy without -p resets it)
                found.append(((saved if saved is not None else -1, path.name == "last.ckpt"), path,
                              step if known else saved))
    if not found:
        return None
    _, path, step = max(found, key=lambda item: item[0])
    return path, step


def _auto_finds(cfg: DictConfig, path: Path, sweep: tuple[Path, list[str]] | None) -> bool:
    """Whether ``resume=auto`` of the same command would take ``path``."""
    from dalle_lightning.run.resume import newest_complete, stage_runs, sweep_job_runs

    try:
        if sweep is not None:
            newest, _ = newest_complete(sweep_job_runs(*sweep))
        else:
            newest, _ = newest_complete(stage_runs(Path(cfg.paths.runs), cfg.stage.name))
    except Exception:  # noqa: BLE001 - a hint only: never fail the stop's line over it
        return False
    return newest is not None and newest.resolve() == path.resolve()
