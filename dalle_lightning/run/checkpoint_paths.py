"""The paths a checkpoint's callback states name stay inside the checkpoint directory they name.

``ModelCheckpoint`` (and the project's :class:`~dalle_lightning_callbacks.paced_checkpoint.PacedCheckpoint`) keeps
the files it wrote in its state: ``dirpath``, ``best_model_path``, ``last_model_path``, ``kth_best_model_path`` and
the keys of ``best_k_models``. A resumed fit loads them and, at its next save, deletes the "previous" file they name
when it lies under its own checkpoint directory, which Lightning decides with ``Path.absolute()``: that keeps
``..``, so ``<run>/checkpoints/../../FILE`` counts as inside and ``FILE`` is deleted, outside the run.

So before any resume (``resume=PATH``, ``resume=auto``, a launcher's restart) every such path is checked:
written as Lightning writes it (absolute, no ``..``: Lightning stores the ``realpath`` of its directory) and, once
resolved (``Path.resolve()``: ``..`` and links followed), under the resolved ``dirpath`` the same state names as its
run's checkpoint directory (the checkpoint's own folder when it names none). Anything else refuses the checkpoint
in one line naming the key. A checkpoint copied from another machine still resumes: its paths name its old
folder, where a new run deletes nothing (the callbacks delete only inside their own resolved ``dirpath``).

The stored ``dirpath`` itself must name a run's checkpoint folder, not a folder that holds everything: ``/`` (or a
home, or a work_dir) would pass "every path lies under ``dirpath``" whatever the paths are. "The run" of a
checkpoint is the folder its own folder sits in (``<run>/checkpoints/last.ckpt``: the layout ``dalle-train``
writes and ``resume=auto`` finds; for ``resume=PATH`` the same, from the path given). So ``dirpath``, resolved, is
the checkpoint's own folder, or lies inside its run, or lies elsewhere altogether (a copy: its old folder); it is
never its run itself nor an ancestor of the checkpoint's folder, nor the resuming run's directory or an ancestor of
it (:func:`dirpath_problem`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

PATH_KEYS = ("dirpath", "best_model_path", "last_model_path", "kth_best_model_path")
PATHS_KEY = "best_k_models"  # its keys are paths


class OutsidePath(ValueError):
    """A checkpoint's callback state names a file outside its own checkpoint directory. One line."""


def stored_paths(state: Mapping[str, Any], where: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every path ``state`` (one callback's state) holds, ``key`` spelled for an error line."""
    for key in PATH_KEYS:
        value = state.get(key)
        if value not in (None, ""):
            yield f"{where}.{key}", value
    best = state.get(PATHS_KEY)
    if isinstance(best, Mapping):
        for i, value in enumerate(best):
            yield f"{where}.{PATHS_KEY} (key {i})", value
    elif best not in (None, {}):
        yield f"{where}.{PATHS_KEY}", best


def inside(path: Path, folder: Path, itself: bool = False) -> bool:
    """Whether the resolved ``path`` lies under ``folder`` (both resolved by the caller), or is it (``itself``: the
    ``dirpath`` entry; a file entry naming the folder would have Lightning remove the whole folder)."""
    return (itself and path == folder) or folder in path.parents


def dirpath_problem(folder: Path, checkpoint: Path, run_dir: Path | None = None) -> str | None:
    """Why the resolved ``folder`` (a state's ``dirpath``) is no checkpoint folder of a run, None when it is one
    (see the module docstring): ``checkpoint`` is where the state was read from, resolved; ``run_dir`` the resuming
    run's own directory, when known."""
    resuming = run_dir.resolve() if run_dir is not None else None
    if resuming is not None and (folder == resuming or folder in resuming.parents):
        return f"which is or holds this run's directory {str(resuming)!r}"
    own = checkpoint.parent
    run = own.parent
    if folder == own or run in folder.parents:
        return None  # its own folder, or inside its run
    if folder == run or folder in run.parents:
        return f"which is or holds the checkpoint's run directory {str(run)!r}"
    return None  # elsewhere altogether: a copied checkpoint's old folder, where this run deletes nothing


def check_callback_paths(saved: Mapping[str, Any], checkpoint: str | os.PathLike, key: str,
                         run_dir: str | os.PathLike | None = None) -> None:
    """Raise a one-line :class:`OutsidePath` (``key`` first) unless every path in the callback states of
    ``saved`` (a loaded checkpoint, or a sharded checkpoint's metadata) lies inside its state's own resolved
    checkpoint directory, and that directory is a run's checkpoint folder (see the module docstring).
    ``checkpoint`` is where ``saved`` was read from; ``run_dir`` the resuming run's own directory, when known."""
    callbacks = saved.get("callbacks")
    if callbacks is None:
        return
    shown = f"{key.rstrip(':')}: checkpoint {os.fspath(checkpoint)!r}"
    expected = "expected a checkpoint dalle-train wrote, whose files stay in its run's checkpoints/ folder"
    if not isinstance(callbacks, Mapping):
        raise OutsidePath(f"{shown}: callbacks is a {type(callbacks).__name__}; expected callback states by name")
    own_folder = Path(checkpoint).resolve().parent
    for name, state in callbacks.items():
        if not isinstance(state, Mapping):
            continue
        where = f"callbacks[{str(name)!r}]"
        dirpath = state.get("dirpath")
        folder = Path(dirpath).resolve() if isinstance(dirpath, str) and dirpath else own_folder
        for entry, value in stored_paths(state, where):
            if not isinstance(value, str):
                raise OutsidePath(f"{shown}: {entry} is a {type(value).__name__}; expected a path ({expected})")
            if "://" in value or (isinstance(dirpath, str) and "://" in dirpath):  # remote: compared as text
                root = str(dirpath).rstrip("/")
                if ".." in value.split("/") or not (value == root or value.startswith(root + "/")):
                    raise OutsidePath(f"{shown}: {entry} is {value!r}, outside its checkpoint directory "
                                      f"{dirpath!r}, so the checkpoint was not used and nothing was deleted; {expected}")
                continue
            written = Path(value)
            if not written.is_absolute() or ".." in written.parts:
                raise OutsidePath(f"{shown}: {entry} is {value!r}, which Lightning never writes (a relative path or "
                                  f"one with '..'), so the checkpoint was not used and nothing was deleted; {expected}")
            if not inside(written.resolve(), folder, itself=entry.endswith(".dirpath")):
                raise OutsidePath(f"{shown}: {entry} is {value!r}, outside its checkpoint directory {str(folder)!r} "
                                  f"once resolved, so the checkpoint was not used and nothing was deleted; {expected}")
        if isinstance(dirpath, str) and dirpath and "://" not in dirpath:
            problem = dirpath_problem(folder, Path(checkpoint).resolve(), None if run_dir is None else Path(run_dir))
            if problem is not None:
                raise OutsidePath(f"{shown}: {where}.dirpath is {dirpath!r}, {problem}, not a run's checkpoint "
                                  f"folder, so the checkpoint was not used and nothing was deleted; {expected}")
