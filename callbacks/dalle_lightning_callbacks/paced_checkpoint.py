"""Checkpoints paced by time as well as by updates, with no collective per update.

A restarted run loses the work since its last checkpoint, so the interval that matters is wall time: 500 updates
are minutes on a GPU and an hour on 2 CPU cores. Lightning's ``ModelCheckpoint(train_time_interval=...)`` paces by
time but broadcasts rank 0's decision after every update (one collective per update over the slow link between
nodes, which ``strategy=local_steps`` exists to avoid), and refuses to combine with ``every_n_train_steps``.

:class:`PacedCheckpoint` is ``ModelCheckpoint`` with ``every_n_minutes`` besides ``every_n_train_steps``. The ranks
decide together only at *decision updates*, known to all: at one, rank 0 broadcasts whether the interval has
passed since the last checkpoint and how many updates from now the next decision falls (the time left over its
measured time per update). A steady run makes a few decisions per interval, and a checkpoint by time lands within
one update of its time. Every rank writes its own shards under the sharded strategies (no gather), as every save
of ``ModelCheckpoint`` does there.

A run stopped by SIGTERM or SIGINT (``save_on_stop``, one process) finishes the update under way, writes its
checkpoint there, where every checkpoint is taken (the end of an update), and only then lets Lightning stop the fit
(its ``SIGTERMException``), so that ``resume=`` continues it exactly. A second SIGINT stops at once, as Python
does; a second SIGTERM lets Lightning stop at its next check. Lightning's own handlers (the SLURM requeue signal,
its launcher's forwarding) are left as they are: a deferred SIGTERM is handed to Lightning's handler after the save.
Several processes keep Lightning's immediate stop: a save there would be a collective the ranks reach at different
updates.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


def within_dirpath(filepath: str | os.PathLike, dirpath: str | os.PathLike | None) -> bool:
    """Whether the local file ``filepath``, resolved, lies under the resolved ``dirpath``; a remote URL (which
    nothing resolves) must start with ``dirpath`` and hold no ``..``."""
    if dirpath is None:
        return False
    if "://" in os.fspath(filepath) and not os.fspath(filepath).startswith("file://"):
        url, folder_url = os.fspath(filepath), os.fspath(dirpath).rstrip("/") + "/"
        return url.startswith(folder_url) and ".." not in url.split("/")
    folder = Path(os.fspath(dirpath).removeprefix("file://")).resolve()
    path = Path(os.fspath(filepath).removeprefix("file://")).resolve()
    return folder in path.parents


class PacedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves once ``every_n_minutes`` of training passed since its last save.

    ``every_n_minutes``: None (or 0) paces by updates only, as ``ModelCheckpoint``. ``save_on_stop``: a SIGTERM or
    SIGINT checkpoints after the update under way, then stops the fit (one process; ``stop_signal`` then names
    the signal). Every other argument is ``ModelCheckpoint``'s (``train_time_interval`` excepted: this replaces
    it).
    """

    MARGIN = 0.8  # a decision plans this share of the time left: about 4 decisions per interval at a steady rate

    def __init__(self, *args: Any, every_n_minutes: float | None = None, save_on_stop: bool = True,
                 **kwargs: Any) -> None:
        if kwargs.get("train_time_interval") is not None:
            raise ValueError("PacedCheckpoint(train_time_interval=...); expected every_n_minutes (it paces without a "
                             "collective per update, and combines with every_n_train_steps)")
        if every_n_minutes is not None and (not isinstance(every_n_minutes, (int, float)) or every_n_minutes < 0):
            raise ValueError(f"every_n_minutes={every_n_minutes!r}; expected null or a number of minutes >= 0")
        super().__init__(*args, **kwargs)
        self.every_n_minutes = float(every_n_minutes) if every_n_minutes else None
        self._next_decision: int | None = None  # the update at which the ranks decide next
        self._decided_at: tuple[int, float] | None = None  # (update, time) of the last decision, rank 0's clock
        self._saved_at = time.monotonic()  # rank 0's clock: the last save, or the start of this fit
        self.save_on_stop = bool(save_on_stop)
        self.stop_signal: int | None = None  # SIGTERM or SIGINT received during this fit's training
        self._stop_done = False  # the stop was handed to Lightning
        self._step_at_batch_start = -1
        self._handlers: dict[int, Any] = {}  # the handlers ours replaced (Lightning's SIGTERM handler among them)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._saved_at = time.monotonic()  # a resumed run starts at its checkpoint: no work to lose yet
        self._next_decision = trainer.global_step + 1  # the first decision measures one update
        self._decided_at = (trainer.global_step, self._saved_at)
        self.stop_signal, self._stop_done = None, False
        if self.save_on_stop and trainer.world_size == 1 and threading.current_thread() is threading.main_thread():
            self._take_signals(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        before = self._last_global_step_saved
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved != before:  # saved by updates: the time interval starts again
            self._saved_at = time.monotonic()
        if self.every_n_minutes is not None and self._next_decision is not None \
                and trainer.global_step >= self._next_decision:
            self._paced_save(trainer)
        if self.stop_signal is not None and not self._stop_done and trainer.global_step != self._step_at_batch_start:
            self._stop(trainer)  # after an update, not inside an accumulation window: what every checkpoint holds

    def _paced_save(self, trainer: pl.Trainer) -> None:
        """At a decision update: save when rank 0 says the interval has passed; plan the next decision."""
        save, gap = trainer.strategy.broadcast(self._decide(trainer.global_step))
        self._next_decision = trainer.global_step + gap
        if save and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.monitor is None or self.monitor in candidates:
                self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._saved_at = time.monotonic()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._give_back_signals()
        if self.stop_signal is not None and not self._stop_done:
            # the signal came after the last update's checkpoint hook: the fit is over, the stop still stands
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            self._stop_done = True
            raise SIGTERMException

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        self._give_back_signals()

    def _take_signals(self, trainer: pl.Trainer) -> None:
        """Defer SIGTERM (Lightning's handler, installed by now) and SIGINT (Python's KeyboardInterrupt) to the end
        of the update under way. A SIGINT handler of the user's own is left alone."""
        if trainer.received_sigterm:  # before training started: stop after the first update, with its checkpoint
            self.stop_signal, self._stop_done = signal.SIGTERM, False
        self._handlers = {signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._handlers[signal.SIGINT] = signal.default_int_handler
        for signum in self._handlers:
            signal.signal(signum, self._on_signal)

    def _give_back_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._handlers = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            if signum == signal.SIGINT:  # someone at a terminal: say that it was heard (no buffered stream here)
                os.write(2, b"\nSIGINT: stopping after this update with a checkpoint (again: at once, without one)\n")
            return
        # a second signal: what it would have done without this callback
        handler = self._handlers.get(signum)
        if callable(handler):
            handler(signum, frame)

    def _stop(self, trainer: pl.Trainer) -> None:
        """Checkpoint this update (unless one was just written) and let Lightning stop at its next check."""
        self._stop_done = True
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            if self.save_last:
                self._save_last_checkpoint(trainer, candidates)
            elif self.monitor is None or self.monitor in candidates:
                self._save_topk_checkpoint(trainer, candidates)
        lightning_handler = self._handlers.get(signal.SIGTERM)
        self._give_back_signals()
        if callable(lightning_handler):
            lightning_handler(signal.SIGTERM, None)  # trainer.received_sigterm: Lightning's own graceful stop
        else:  # pragma: no cover - Lightning registers its handler before training starts
            trainer._signal_connector.received_sigterm = True

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Delete ``filepath`` only when it lies inside this callback's own checkpoint directory once both are
        resolved (``..`` and links followed). Lightning decides with ``Path.absolute()``, which keeps ``..``: a
        resumed checkpoint's ``last_model_path`` of ``<dirpath>/../../FILE`` would otherwise delete ``FILE``."""
        if not within_dirpath(filepath, self.dirpath):
            warnings.warn(f"{type(self).__name__} kept {str(filepath)!r}: it lies outside its checkpoint directory "
                          f"{self.dirpath!r} once resolved, and only files there are deleted")
            return
        super()._remove_checkpoint(trainer, filepath)

    def _decide(self, step: int) -> tuple[bool, int]:
        """Rank 0's decision at update ``step``: save now, and the updates until the next decision (at least 1;
        ``MARGIN`` of the updates that fit in the time left at the rate since the last decision, so a run that
        slows down is caught near the end of the interval)."""
        now = time.monotonic()
        assert self.every_n_minutes is not None and self._decided_at is not None
        last_step, last_time = self._decided_at
        per_update = max((now - last_time) / max(step - last_step, 1), 1e-6)
        self._decided_at = (step, now)
        interval = self.every_n_minutes * 60.0
        save = now - self._saved_at >= interval
        left = interval if save else interval - (now - self._saved_at)
        return save, max(1, math.floor(left / per_update * self.MARGIN))
