"""One run per output: an OS-level lock on each output a run writes and on its run directory.

Two ``dalle-train`` of one stage into one work_dir used to both run, the last writer silently winning the artifact;
two ``dalle-encode`` into one out_dir removed each other's split. The launching process of a run (global rank 0
only: the other ranks of the same run must not contend) takes ``fcntl.flock`` on a lock file per output
(``.<name>.lock`` beside the output, so an output directory's contents stay its own) and on its run directory
(``<run dir>/.run.lock``), and writes who holds it into the file. The kernel releases a lock when its process dies,
however it dies, so a killed run never blocks the next one. A second run that would write a locked output refuses
at once with one line naming the first (its pid, host and run directory).

Run directories are distinct by name too (``${run_id:}``: the start time and a random suffix), so two runs started
in the same second never share logs or checkpoints. Under ``torchrun`` every rank and every restart attempt of one
launch takes the launch's start, agreed on in torchrun's store, so a launch keeps one directory;
``DALLE_RUN_ID`` pins the name for other launchers that start every rank by itself (``srun``).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

from dalle_lightning import inside
from dalle_lightning_plugins.environments.launch_identity import agreed_start

_held: dict[str, int] = {}  # lock file -> open descriptor, for as long as this process holds it
_issued: set[str] = set()  # run ids this process has named: never twice, however many fall in one second


def run_id() -> str:
    """The name of a new run directory: ``DALLE_RUN_ID`` if set; under torchrun, the launch's start that every rank
    and every restart attempt agree on (``launch_identity.agreed_start``: one directory per launch); else the start
    time and a random suffix (``2026-11-25_12-05-30_3f2a``), sortable by time and distinct for runs started in the
    same second."""
    pinned = os.environ.get("DALLE_RUN_ID") or agreed_start()
    if pinned:
        return pinned
    while True:  # 4 random hex digits collide within 50 draws 2% of the time: this process never repeats one
        name = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{secrets.token_hex(2)}"
        if name not in _issued:
            _issued.add(name)
            return name


def launching_process() -> bool:
    """Whether this process is the one of its run that locks (global rank 0): not a rank Lightning's launcher or
    torchrun started besides it, nor the first process of another node."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]) == 0
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env["SLURM_PROCID"]) == 0
    node = int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")) or 0)
    return int(env.get("LOCAL_RANK", "0")) == 0 and node == 0


def lock_file(target: str | os.PathLike, directory_lock: bool = False) -> Path:
    """Where the lock of ``target`` lives: ``<target>/.run.lock`` for a run directory, else beside it."""
    target = Path(os.path.abspath(target))
    return target / ".run.lock" if directory_lock else target.with_name(f".{target.name}.lock")


class OutputLocked(ValueError):
    """Another live process writes this output (one line naming it)."""


def acquire(key: str, target: str | os.PathLike, run_dir: str, directory_lock: bool = False,
            folder: str | os.PathLike | None = None) -> None:
    """Lock ``target`` (the value of config ``key``) for this run, or raise :class:`OutputLocked` naming the holder.

    The lock file is opened without following a link out of ``folder`` (default: the folder the lock file sits in;
    a sweep job's run directory passes its sweep, which Hydra made the job's folder in): a lock file planted as a
    link to a file elsewhere would otherwise have that file truncated and the lock record written into it
    (:class:`~dalle_lightning.inside.LinkOut`, one line naming the link)."""
    path = lock_file(target, directory_lock)
    if str(path) in _held:
        return  # this process holds it already (a sweep's jobs run one after another in one process)
    inside.check(path.parent, folder or path.parent, key)  # before mkdir: never make a folder through a link out
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = inside.open_inside(path, folder or path.parent, os.O_RDWR | os.O_CREAT, key)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        what = "run directory" if directory_lock else "output"
        raise OutputLocked(
            f"{key}={os.fspath(target)!r}: this {what} is being written by another run (pid {holder.get('pid', '?')} "
            f"on {holder.get('host', '?')}, run directory {holder.get('run_dir', '?')}); wait for it to end or choose "
            f"another {key}") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "run_dir": run_dir, "command": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[str(path)] = fd


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def release_all() -> None:
    """Give up every lock this process holds (a run's end; the kernel does it anyway when the process dies)."""
    for path, fd in list(_held.items()):
        os.close(fd)  # closing the descriptor releases its flock
        del _held[path]
