"""Checkpoint files that are never bad under their final name, and a check that a checkpoint is complete.

Lightning's ``TorchCheckpointIO`` saves through ``_atomic_save``: a ``mkstemp`` file in ``$TMPDIR``, then
``shutil.move``, which is a copy (not a rename) when ``$TMPDIR`` is another filesystem, so a full disk or a kill
during the copy leaves a truncated ``last.ckpt``, which a resumed run then picks. :class:`AtomicCheckpointIO`
writes through ``dalle_lightning_plugins.io.atomic_files`` instead: a temporary file beside the target, fsynced, ``os.replace``d.
A failed write raises :class:`CheckpointWriteError` (one line naming the file and the cause), removes its temporary
file and leaves the previous checkpoint as it was.

:func:`checkpoint_problem` says why a checkpoint (a file, or a sharded directory of
``dalle_lightning_plugins.io.dcp_checkpoint``) cannot be resumed from, cheaply: a file must be a whole ``torch.save`` archive (its
zip directory, at the end of the file, is read: a cut file has none); a directory must carry its completion marker.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from dalle_lightning_plugins.io.atomic_files import AtomicWriteError, torch_save
from dalle_lightning_plugins.io.dcp_checkpoint import COMPLETE_MARKER, is_sharded_checkpoint

PathLike = str | os.PathLike  # a checkpoint's path, as Lightning passes it (str or Path)


class CheckpointWriteError(AtomicWriteError):
    """A checkpoint could not be written (full disk, quota, I/O error); the previous one is kept."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves go through a temporary file beside the target (see the module docstring)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported; "
                            f"got {storage_options!r}")
        save_checkpoint_file(checkpoint, path)


def save_checkpoint_file(checkpoint: dict[str, Any], path: PathLike) -> None:
    """``torch.save(checkpoint)`` to ``path`` atomically; :class:`CheckpointWriteError` if it cannot be written."""
    try:
        torch_save(checkpoint, path)
    except Exception as exc:
        error = CheckpointWriteError(f"could not write checkpoint {os.fspath(path)!r} ({_cause(exc)}); the previous "
                                     "checkpoint is kept and no temporary file is left")
        error.errno = getattr(_os_error(exc), "errno", None)
        raise error from exc


def _os_error(exc: BaseException | None) -> OSError | None:
    """The operating system's error behind ``exc`` (torch's writer reports a failed Python write as a RuntimeError
    raised while handling the OSError)."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def _cause(exc: Exception) -> str:
    os_error = _os_error(exc)
    if os_error is not None and os_error.strerror:
        return os_error.strerror
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be resumed from (``"truncated or not a checkpoint"``, ...), or None when it is whole."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            return "a directory that is not a sharded checkpoint (no .metadata)"
        if not (path / COMPLETE_MARKER).is_file():
            return f"an incomplete sharded checkpoint (no {COMPLETE_MARKER} marker)"
        return None
    if not path.is_file():
        return "no such file"
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return "not a torch checkpoint (no data.pkl)"
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"truncated or not a checkpoint ({exc})"
    return None


def atomic_io(io: CheckpointIO | None) -> CheckpointIO:
    """Unless one is given (``plugins=[...]``), checkpoint files are written by :class:`AtomicCheckpointIO`: a
    temporary file beside the target, renamed over it, so an interrupted or failed save never leaves a truncated
    ``last.ckpt`` for a resumed run to pick (Lightning's default writes in place)."""
    if io is None:
        return AtomicCheckpointIO()
    if getattr(io, "checkpoint_io", False) is None:  # a wrapper (AsyncCheckpointIO) of nothing yet
        io.checkpoint_io = AtomicCheckpointIO()  # type: ignore[attr-defined]
    return io
