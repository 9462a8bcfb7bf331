"""One way to write a file: a uniquely named temporary file beside the target, flushed and fsynced, then renamed
over the target with ``os.replace``.

A reader (another process, a resumed run, a later stage) therefore sees the old file or the complete new one,
never half of one, even after a kill or a full disk; two processes writing the same path never take each other's
temporary file away (each has its own name); and the rename is never a copy across filesystems, because the
temporary file lives in the target's own directory. A failed write removes its temporary file and leaves the
previous file in place.

Everything the project writes goes through :func:`atomic_path` (JSON, text, torch saves, PNGs, tokenizer
files, checkpoints); the helpers below cover the kinds that need only the standard library and torch. Images are
written by ``dalle_lightning_callbacks.image_files.save_image`` (in ``dalle-lightning``, which requires Pillow) on
top of :func:`write_bytes`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PARTIAL = ".partial"  # the suffix of temporary files, so that a listing can tell them from finished files


class AtomicWriteError(OSError):
    """A file could not be written (full disk, quota, I/O error): the message names it; the previous file is kept
    and no temporary file is left. Commands report it in one line."""


def temporary_name(path: str | os.PathLike) -> Path:
    """A fresh hidden name beside ``path``, unique to this process and call (``.<name>.<pid>.<random>.partial``)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{PARTIAL}")


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; on success it is fsynced and renamed to ``path``.

    The temporary file exists (empty) when the block starts, so that writers that open by name may overwrite it;
    on any exception it is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # umask applies, as to any new file
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as stream:
            stream.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any, sort_keys: bool = True) -> Path:
    """Write ``obj`` as indented JSON with a final newline to ``path`` atomically."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically. Written through a Python file object, so that a failed write
    (a full disk) raises the ``OSError`` with its errno rather than only torch's own error."""
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as stream:
        torch.save(obj, stream)
    return Path(path)
