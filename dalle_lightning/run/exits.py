"""How a run ends when it cannot go on: a signal (SIGTERM, SIGINT) or a lost peer, each in one line with its own
exit code (143 / 130, 75), which launchers read: torchrun restarts its workers, SLURM's ``RequeueExit=75`` requeues
only a lost peer; a bug keeps its traceback and exit code 1."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Any

from dalle_lightning_plugins.environments import peer_loss


def process_rank() -> int:
    """This process's global rank (0 outside distributed runs), as Lightning knows it or its launcher set it."""
    try:
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank = getattr(rank_zero_only, "rank", None)
    except ImportError:  # pragma: no cover - lightning is a dependency
        rank = None
    if rank is None:
        rank = next((int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if k in os.environ), 0)
    return int(rank)


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says, by its type, that a peer or the link went (``dalle_lightning_plugins.environments.peer_loss``:
    torch.distributed's network and store errors, the strategies' ``PeerLost``, NCCL's remote error, gloo's
    transport errors); one process has no peer to lose. Anything else is a bug and keeps its traceback."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    return peer_loss.lost_peer(exc)


def lost_peer_exit(exc: BaseException) -> None:
    """End this process with one line on every rank (each node says what it saw) and exit code 75
    (``peer_loss.LOST_PEER_EXIT``, EX_TEMPFAIL), which a restarting launcher answers by restarting the workers
    (torchrun: any failure; SLURM: ``RequeueExit=75`` in slurm.conf requeues on it alone) and which a bug (exit
    code 1, its traceback on stderr) never has; the traceback goes to torchrun's error file, where its final
    report reads it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if any(frame.name == "_sigterm_notifier_fn" for frame in traceback.extract_tb(exc.__traceback__)):
        # torchrun stops a node's healthy workers (SIGTERM) to restart them with a node that came back, and
        # Lightning's handler tells the other ranks by a broadcast, which fails when one is gone
        line = f"rank {process_rank()}: stopped by the launcher (SIGTERM) to restart; a peer was already gone ({line})"
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not sys.exit: the interpreter's exit would tear down the process group, whose sockets wait on the lost peer
    # (up to the whole outage: 43 s of a 30 s link cut, measured). Nothing is left to write; the kernel releases
    # the run's locks (run_lock) with the process.
    os._exit(peer_loss.LOST_PEER_EXIT)


APP_COMMANDS = {"world": "dalle-data", "train": "dalle-train", "encode": "dalle-encode", "generate": "dalle-generate",
                "eval": "dalle-eval"}  # config name -> the command a user typed


class Stopped(BaseException):
    """SIGTERM, raised where the command is (a ``BaseException``: no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def _stop_on_sigterm() -> Any:
    """Turn SIGTERM into ``Stopped`` in this (main) thread; the handler it replaced, or None where none was set."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_stopped)


def stopped_exit(app: str, signum: int) -> None:
    """One line and exit code 128 + ``signum`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a process a
    signal ended. Every file the commands write is written whole (``atomic_files``), so nothing half-written stays."""
    if process_rank() == 0:
        command = APP_COMMANDS.get(app, app)
        print(f"error: {command} stopped by {signal.Signals(signum).name}; every file it writes appears whole or not at "
              "all (written under a temporary name): run the command again to finish", file=sys.stderr, flush=True)
    sys.exit(128 + int(signum))
