"""Which launch a process belongs to, and whether its launcher says that it restarted it.

A worker continues an earlier attempt by itself only when the launcher restarted it; anything else, a new command
in the same SLURM allocation or a new ``torchrun`` that reuses a ``--rdzv-id``, starts as ``resume=`` says. The
launchers' own records, and nothing a second launch could share:

- **torchrun**: each agent makes its workers' log directory with ``mkdtemp`` when it starts and keeps it over all
  its restarts (``TORCHELASTIC_ERROR_FILE`` is ``<dir>/attempt_<k>/<local rank>/error.json``); no other agent,
  of this launch or another, has that directory. ``TORCHELASTIC_RESTART_COUNT`` counts the restarts that agent
  made after a failure (a node whose workers were restarted because another node came back reads 0, so the
  directory, not the count, is what proves an earlier attempt). The agents' store (the rendezvous's, which
  torchrun shares with the workers) lives exactly as long as the launch: :func:`agreed_start` keeps there the
  start time of the launch's first worker, the same on every rank and every attempt, which names the launch's one
  run directory; a new launch has a new store and a new time.
- **SLURM**: ``SLURM_RESTART_COUNT`` > 0 in a job the scheduler requeued (preemption, a node failure, ``scontrol
  requeue``); the job id (and array task) stays. A second command in the same job reads 0.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

START_KEY = "dalle_lightning_plugins/launch_start"  # in the agents' store: this launch's start, first writer wins
STORE_TIMEOUT = timedelta(seconds=60)  # the agents' store is up before any worker starts
_agreed: dict[str, str] = {}  # store address -> the start read there (one read per process)


@dataclass(frozen=True)
class Launch:
    """What this process's launcher says about the launch (one rank's view; :func:`pool` joins the ranks')."""

    agents: tuple[str, ...] = ()  # "<host>:<agent log dir>" of the torchrun agents (one per node)
    rdzv: str | None = None  # torchrun's --rdzv-id where the user chose one (its default is "none")
    started: str | None = None  # the launch's start time, agreed on in the agents' store (None without one)
    torchrun_restarts: int = 0  # the largest TORCHELASTIC_RESTART_COUNT of the ranks
    slurm_job: str | None = None  # "<job>" or "<array job>_<task>"
    slurm_restarts: int = 0  # SLURM_RESTART_COUNT: how often the scheduler requeued the job

    @property
    def restarting_launcher(self) -> bool:
        """Whether a launcher that restarts workers started this process at all (else nothing is ever continued)."""
        return bool(self.agents or self.slurm_job)

    def record(self) -> dict[str, Any]:
        """The JSON a run directory keeps of its launch (``launch.json``), without the restart counts."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if "restarts" not in k}


def this_launch(environ: dict[str, str] | None = None, started: str | None = None) -> Launch:
    """This rank's view of its launch, from the launchers' environment variables; ``started``: :func:`agreed_start`."""
    env = os.environ if environ is None else environ
    agents: tuple[str, ...] = ()
    error_file = env.get("TORCHELASTIC_ERROR_FILE")
    if error_file and len(Path(error_file).parents) > 3:
        agents = (f"{socket.gethostname()}:{Path(error_file).parents[2]}",)
    rdzv = env.get("TORCHELASTIC_RUN_ID") or None
    job = None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    elif env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
    return Launch(agents=agents, rdzv=None if rdzv == "none" else rdzv, started=started,
                  torchrun_restarts=_count(env, "TORCHELASTIC_RESTART_COUNT"), slurm_job=job,
                  slurm_restarts=_count(env, "SLURM_RESTART_COUNT"))


def _count(env: Any, key: str) -> int:
    try:
        return max(int(env.get(key, "0") or 0), 0)
    except ValueError:
        raise ValueError(f"{key}={env.get(key)!r}; expected a whole number (set by the launcher)") from None


def pool(views: list[Launch]) -> Launch:
    """Every rank's view joined: all agents, the largest restart counts; the rest is the same on every rank."""
    first = views[0]
    return Launch(agents=tuple(sorted({a for v in views for a in v.agents})), rdzv=first.rdzv, started=first.started,
                  torchrun_restarts=max(v.torchrun_restarts for v in views), slurm_job=first.slurm_job,
                  slurm_restarts=max(v.slurm_restarts for v in views))


def agreed_start(environ: dict[str, str] | None = None) -> str | None:
    """This launch's start (``2026-11-28_08-00-00_3f2a``: the first worker's time and a random suffix), the same
    for every rank and every restart attempt of one torchrun launch; None where torchrun did not start this
    process with its agents' store (``TORCHELASTIC_USE_AGENT_STORE``). Nothing but the store's lifetime, the
    launch's, ties it: a new launch, whatever its ``--rdzv-id``, draws a new one."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    address = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if address not in _agreed:
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT)
        mine = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(2)}"
        _agreed[address] = store.compare_set(START_KEY, "", mine).decode()
    return _agreed[address]
