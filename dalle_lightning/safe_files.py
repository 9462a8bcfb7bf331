"""Opening a file never runs code from it: every file a user hands in is read as data.

A pickle can name any importable callable and have the reader call it; a model file passed around between users is
the classic way to run code on someone else's machine. So every file the project opens (its model files, Lightning
checkpoints, an open_clip weights file, OpenAI's released dVAE) goes through ``torch.load(weights_only=True)``:
torch's restricted unpickler, which builds tensors, containers and plain values and refuses every other global.
A refusal is one line naming the file, the global it asked for and what to do (:class:`UnsafeFile`, a
``ValueError``, which the commands print as ``error: ...`` with exit code 2), never a pickle traceback.

:func:`check_plain` is the second half: values read from a file that later code acts on (a model's building config,
its metadata) must be plain JSON values, so that nothing but the allow-list in :mod:`dalle_lightning.model_targets`
decides what gets built.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from dalle_lightning.stored_values import shown, walk
from dalle_lightning_plugins.io.refusal import inflated_record, refused_global

class UnsafeFile(ValueError):
    """A file that asks for more than data when opened (a global outside the allow-list, a config target that is
    not one of the project's models). Its message is one line."""


def refusal(path: str | os.PathLike, name: str, what: str, fix: str) -> UnsafeFile:
    """The one-line error for ``path`` (a ``what``), whose pickle asked for the global ``name``."""
    return UnsafeFile(f"{what} {os.fspath(path)!r} asks for the global {name}, which could run code when opened, "
                      f"so it was not opened; expected a file of tensors and plain values: {fix}")


def load_data(path: str | os.PathLike, what: str = "file", fix: str = "use a file this project wrote",
              mmap: bool = False, allowed: Iterable[Any] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with ``allowed`` (classes) added for this call only;
    a refused global, or a zip record that is compressed (torch would inflate it whole: refused unread), is a
    one-line :class:`UnsafeFile` naming ``what`` and ``path`` and ending with ``fix``. Other errors (a file that is
    not a torch save: torch's unpickler refuses its first byte as an unsupported operand) are left to the caller,
    which knows what the file should be; nothing of the file ran either way."""
    problem = inflated_record(path)
    if problem is not None:
        raise UnsafeFile(f"{what} {os.fspath(path)!r}: {problem}, so it was not read; expected a file of tensors and "
                         f"plain values: {fix}")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        name = refused_global(exc)
        if name is None:
            raise
        raise refusal(path, name, what, fix) from None


def read_data(path: str | os.PathLike, what: str, fix: str, expected: str, allowed: Iterable[Any] = ()) -> Any:
    """:func:`load_data`, with any other failure (a file that is not a torch save: pickle, zip and torch raise many
    types) one ``ValueError`` line: ``'<path>' is not a <what> (<error type>); expected <expected>``."""
    try:
        return load_data(path, what, fix, allowed=allowed)
    except UnsafeFile:
        raise
    except Exception as exc:  # noqa: BLE001 - every way a foreign file fails to load is the same answer
        raise ValueError(f"{os.fspath(path)!r} is not a {what} ({type(exc).__name__}); expected {expected}") from exc


PLAIN_SCALARS = (str, int, float, bool, type(None))


def check_plain(value: Any, path: str | os.PathLike, where: str) -> None:
    """Raise a one-line :class:`UnsafeFile` unless ``value`` is a plain JSON value (str, int, float, bool, None,
    lists of them, dicts with str keys; floats finite, as strict JSON has them), naming ``path`` and the first
    offending entry (``where`` is its key). Walked by :func:`~dalle_lightning.stored_values.walk`: each shared
    container once, at a bounded depth and expanded size."""
    named = repr(os.fspath(path))
    for visit in walk(value, where, named):
        item, place = visit.value, visit.place
        if visit.is_key:
            if not isinstance(item, str):
                raise UnsafeFile(f"{named}: {place} has the key {shown(item, 200)} of type {type(item).__name__}; "
                                 "expected str keys (plain JSON values)")
        elif isinstance(item, float) and not math.isfinite(item):
            raise UnsafeFile(f"{named}: {place}={item!r} is not a finite number, so it was not used; expected plain "
                             "JSON values (numbers are finite)")
        elif not isinstance(item, PLAIN_SCALARS + (list, tuple, dict)):
            raise UnsafeFile(f"{named}: {place} holds a {type(item).__name__}; expected plain JSON values "
                             "(str, int, float, bool, null, lists, dicts)")
