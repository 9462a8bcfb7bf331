"""A folder a user may have been handed keeps the project inside it: no link in it leads the project out.

A work_dir, its ``runs/``, a samples folder, a sweep and its jobs may come from someone else, and any name in them
may be a symbolic link. Opening ``<work_dir>/.dvae.pt.lock`` or ``<sweep>/0/train.log`` by name follows such a link,
so the project would truncate, write, delete or read a file wherever the link points (a password file, a key).
So every file the project writes, locks, deletes or reads inside such a folder is checked here first: its path,
resolved (every link followed, ``..`` applied), must lie inside the folder's own resolved path. A link that stays
inside the folder keeps working, and so does the folder itself being a link (a user's own ``paths.work_dir`` on the
command line). A link that leads out is refused in one line naming it (:class:`LinkOut`, a ``ValueError``: the
commands print ``error: ...`` and exit with code 2), before anything is opened through it.
"""

from __future__ import annotations

import os
from pathlib import Path

FIX = "nothing was opened through it; expected files and folders inside it (remove the link, or copy what it names)"


class LinkOut(ValueError):
    """A name inside a handed folder is a link (or ``..``) that leads out of the folder. One line naming it."""


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def link_out(path: str | os.PathLike, folder: str | os.PathLike) -> tuple[Path, Path] | None:
    """The first name on the way from ``folder`` down to ``path`` that leads out of ``folder`` once resolved, with
    where it leads; None when ``path`` stays inside (it need not exist: a missing tail stays where its parent is).
    ``path`` is ``folder`` joined with relative names, as the callers build it; one not under ``folder`` at all
    counts as leading out."""
    folder, path = os.path.abspath(folder), os.path.abspath(path)
    real_folder = os.path.realpath(folder)
    if not _within(path, folder):
        return Path(path), Path(os.path.realpath(path))
    step = folder
    for name in Path(os.path.relpath(path, folder)).parts if path != folder else ():
        step = os.path.join(step, name)
        real = os.path.realpath(step)
        if not _within(real, real_folder):
            return Path(step), Path(real)
    return None


def check(path: str | os.PathLike, folder: str | os.PathLike, key: str = "") -> Path:
    """``path`` resolved, or a one-line :class:`LinkOut` (``key`` first) naming the link that leads it out of
    ``folder``."""
    found = link_out(path, folder)
    if found is not None:
        link, target = found
        raise LinkOut(f"{key + ': ' if key else ''}{str(link)!r} leads to {str(target)!r}, outside "
                      f"{os.fspath(folder)!r}, so {FIX}")
    return Path(os.path.realpath(path))


def open_inside(path: str | os.PathLike, folder: str | os.PathLike, flags: int, key: str = "",
                mode: int = 0o666) -> int:
    """``os.open`` of ``path`` once :func:`check` found it inside ``folder``: its resolved path, with ``O_NOFOLLOW``,
    so a link put in its place in between is not followed either (``ELOOP``)."""
    return os.open(check(path, folder, key), flags | os.O_NOFOLLOW, mode)


def check_tree(folder: str | os.PathLike, key: str = "") -> None:
    """Every link anywhere under ``folder`` (walked without following links) stays inside it, or a one-line
    :class:`LinkOut` naming the first that does not: for a folder others write into by name (Hydra writes a run's
    ``.hydra/*.yaml``, its log and a sweep's ``multirun.yaml``; Lightning its ``checkpoints/``), checked before
    anything is written. A missing folder holds nothing."""
    real_folder = os.path.realpath(folder)
    for where, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            entry = os.path.join(where, name)
            if os.path.islink(entry) and not _within(os.path.realpath(entry), real_folder):
                check(entry, folder, key)
