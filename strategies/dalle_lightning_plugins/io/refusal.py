"""A checkpoint that asks for more than data is refused in one line: the file, the global it asked for, what to do.

Opening a file must never run code from it. ``torch.load(weights_only=True)`` (torch's default since 2.6, which
Lightning keeps) already refuses a pickle that names a function or class outside its allow-list, but its message
is a dozen lines that do not name the file; a DCP directory's own ``.metadata`` is read by ``pickle`` with no
check at all (see :mod:`dalle_lightning_plugins.io.dcp_reader`). Every load of the plugins goes through
:func:`torch_load` or raises :class:`CheckpointRefused` itself, so a refusal reads the same wherever it happens.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any

import torch

# Lightning 2.6 drops Trainer.fit(weights_only=...) for strategies that restore after setup (its FSDP, this one):
# torch's own switch, read when weights_only is None, is what reaches the load there.
TRUST_HINT = ("open it only if you trust whoever wrote it: weights_only=False, or for Trainer.fit(ckpt_path=...) "
              "the environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1")

_GLOBAL = re.compile(r"(?:Unsupported global: )?GLOBAL ([\w.]+)")
_REASON = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?:\. Please|\n|$)")


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint holds something other than tensors and plain values; nothing of it ran. One line: the file, the
    global it asked for and what to do. An ``UnpicklingError``, as torch's own refusal is, so code that catches
    that (Lightning's callers, a user's) catches this one too."""


def refused_global(exc: BaseException) -> str | None:
    """The global a restricted unpickler refused (``io.open``), read off torch's (or
    :mod:`~dalle_lightning_plugins.io.dcp_reader`'s) error; None for any other error."""
    found = _GLOBAL.search(str(exc))
    return found.group(1) if found else None


def asked_for(exc: BaseException) -> str:
    """What a refused pickle asked for: ``"the global io.open"``, else torch's own reason in a few words."""
    name = refused_global(exc)
    if name is not None:
        return f"the global {name}"
    text = str(exc)
    reason = _REASON.search(text)
    if reason:
        return reason.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def refusal(path: Any, exc: BaseException, part: str = "") -> CheckpointRefused:
    """The one-line :class:`CheckpointRefused` for ``path`` (``part``: where in it, e.g. a DCP key)."""
    where = f"{os.fspath(path)!r}" + (f" ({part})" if part else "")
    return CheckpointRefused(f"refusing checkpoint {where}: it asks for {asked_for(exc)}, which is not data, and "
                             f"nothing of it ran; {TRUST_HINT}")


def inflated_record(source: Any) -> str | None:
    """Why the torch zip ``source`` (a path or a seekable file) must not be read, or None: a record that is
    compressed (``torch.save`` stores every record as it is, so a DEFLATEd one is crafted, and torch would inflate
    it whole: a megabyte on disk, a gigabyte in memory) or that claims more bytes than the archive holds. Read
    from the zip's central directory only, which torch's reader follows too; a file that is not a zip (torch's
    legacy format, a truncated file) is left to ``torch.load``, which says what it is."""
    position = source.tell() if hasattr(source, "tell") else None
    try:
        with zipfile.ZipFile(source) as archive:
            end = archive.start_dir  # where the records end and the central directory begins
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    return (f"its record {info.filename!r} is compressed ({info.compress_size} bytes inflating to "
                            f"{info.file_size}), which torch.save never writes")
                if info.file_size != info.compress_size or info.header_offset + info.file_size > end:
                    return (f"its record {info.filename!r} claims {info.file_size} bytes that the archive does not "
                            "hold")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, OverflowError):
        return None
    finally:
        if position is not None:
            source.seek(position)
    return None


def torch_load(source: Any, path: Any, weights_only: bool | None, part: str = "", **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=weights_only)``, torch's refusal turned into :func:`refusal`'s one line.

    ``weights_only=None`` is passed on as None: torch then applies its own default (True since 2.6, or what
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` / ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` say), exactly as Lightning's
    ``ddp`` loads a local file. A zip with a compressed record (:func:`inflated_record`) is refused unread."""
    problem = inflated_record(source)
    if problem is not None:
        where = f"{os.fspath(path)!r}" + (f" ({part})" if part else "")
        raise CheckpointRefused(f"refusing checkpoint {where}: {problem}, so it was not read; expected a checkpoint "
                                "torch.save wrote")
    try:
        return torch.load(source, weights_only=weights_only, **kwargs)
    except pickle.UnpicklingError as exc:
        if isinstance(exc, CheckpointRefused):
            raise
        raise refusal(path, exc, part) from None

