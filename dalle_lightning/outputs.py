"""Output directories the commands own: a writer replaces or clears only what it wrote itself.

``dalle-data`` (image shards), ``dalle-encode`` (token shards) and ``dalle-generate`` (PNG samples) each leave a
marker file (``.dalle-lightning.json``) in the directories they write, naming the kind of output and what it was
made with. Before a writer deletes or overwrites anything it *claims* the directory: absent, empty, or marked
with its own kind. Anything else (another command's output, the user's files) is a one-line error naming what
is there, so a mistyped ``out_dir`` never costs data. Directories written before markers existed are recognised
by their file names and first tar member (legacy), so old outputs stay reusable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dalle_lightning import inside
from dalle_lightning.plain_yaml import refuse_stored
from dalle_lightning_plugins.io.atomic_files import write_json

MARKER = ".dalle-lightning.json"
# A marker is a few KB: its kind, what made the output, and for samples the names of the files (a thousand
# candidates: ~20 KB). A file beyond this under the marker's name is none, and is refused before it is read whole.
MAX_MARKER_BYTES = 16 * 2**20
WRITERS = {"images": "dalle-data", "tokens": "dalle-encode", "samples": "dalle-generate"}
DESCRIBED = {"images": "image shards", "tokens": "token shards", "samples": "generated samples"}
SHARD = re.compile(r"^\d{6}\.tar$")
SAMPLE = re.compile(r"^(\d+|grid)\.png$")
CANDIDATE = re.compile(r"^\d+_\d+\.png$")


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of ``folder``, or None when it has none (or an unreadable one).

    Its values are plain JSON, and stay plain: the records in it (the dVAE and tokenizer that made token shards)
    travel on into a prior's ``meta.trained_with``, so a string holding ``${`` (which no writer puts there) is
    refused in one line naming the file and the key (``plain_yaml.refuse_stored``), never passed on. A marker that
    is a link out of the folder is refused in one line naming it (:mod:`dalle_lightning.inside`), never read."""
    path = Path(folder) / MARKER
    inside.check(path, folder)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None  # a folder, a FIFO or a device under the marker's name: never read (a FIFO never ends)
        with open(path, "rb") as stream:
            data = stream.read(MAX_MARKER_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_MARKER_BYTES:
        raise ValueError(f"marker {str(path)!r} holds more than {MAX_MARKER_BYTES // 2**20} MiB, so it was not read; "
                         f"expected a marker a dalle-lightning command wrote (a few KB), or delete {MARKER}")
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError:  # not UTF-8 or not JSON: not a marker
        return None
    if not isinstance(record, dict):
        return None
    refuse_stored(record, path, fix=f"a marker a dalle-lightning command wrote (or delete {MARKER})")
    return record


def check_split_folders(out_dir: str | os.PathLike, splits: Iterable[str], key: str = "out_dir") -> None:
    """Each ``<out_dir>/<split>`` a writer replaces stays inside ``out_dir`` (:mod:`dalle_lightning.inside`): a split
    folder a stranger left as a link would have its target's shards replaced, and ``rmtree`` stop on the link. The
    ``out_dir`` itself may be a link (the user's own, on the command line)."""
    for split in splits:
        inside.check(Path(out_dir) / split, out_dir, key)


def write_marker(folder: str | os.PathLike, kind: str, **record: Any) -> None:
    """Mark ``folder`` as ``kind`` output (with facts later commands check, e.g. the dVAE of token shards)."""
    write_json(Path(folder) / MARKER, {"kind": kind, "writer": WRITERS[kind], **record})


def _shard_members(path: Path) -> set[str]:
    """Extensions of the first sample's members in a tar shard (empty if unreadable). Names only, from a plain tar
    (``r:``: a compressed stream is never inflated, and no member is read; the headers are found by seeking)."""
    if not path.is_file():
        return set()  # a device or FIFO named as a shard would never end
    try:
        with tarfile.open(path, "r:") as tar:
            names = [member.name for _, member in zip(range(4), tar)]
    except (OSError, tarfile.TarError):
        return set()
    return {name.split(".", 1)[1] for name in names if "." in name}


def legacy_kind(folder: Path) -> str | None:
    """The kind of an unmarked directory that holds only what one of the writers names its files."""
    names = sorted(p.name for p in folder.iterdir())
    if names and all(SHARD.match(n) for n in names):
        members = _shard_members(folder / names[0])
        if {"codes.npy", "ids.npy"} <= members:
            return "tokens"
        if {"png", "txt", "json"} <= members:
            return "images"
    candidates = folder / "candidates"
    if names and all(SAMPLE.match(n) or n == "candidates" for n in names):
        if not candidates.exists() or all(CANDIDATE.match(p.name) for p in candidates.iterdir()):
            return "samples"
    return None


def kind_of(folder: Path) -> str | None:
    """What ``folder`` holds, by marker or by file names; None for anything else."""
    record = read_marker(folder)
    if record is not None:
        kind = record.get("kind")
        return kind if kind in WRITERS else None
    return legacy_kind(folder)


def _describe(folder: Path) -> str:
    kind = kind_of(folder)
    if kind is not None:
        return f"{DESCRIBED[kind]} written by {WRITERS[kind]}"
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"files no dalle-lightning writer made ({shown})"


def claim(folder: str | os.PathLike, kind: str, key: str = "out_dir") -> bool:
    """Check that ``folder`` may be replaced by ``kind`` output; True if it holds such output already.

    Raises ``ValueError`` (one line, naming what is there) for a file, or a directory with other content.
    """
    folder = Path(folder)
    if folder.is_file():
        raise ValueError(f"{key}={str(folder)!r} is a file; expected a directory for {DESCRIBED[kind]}")
    if not folder.exists() or not any(folder.iterdir()):
        return False
    if kind_of(folder) == kind:
        return True
    raise ValueError(
        f"{key}: {str(folder)!r} holds {_describe(folder)}; expected a new or empty directory, "
        f"or {DESCRIBED[kind]} an earlier {WRITERS[kind]} wrote (nothing was deleted)"
    )


def replace_dir(folder: str | os.PathLike, kind: str, key: str = "out_dir") -> None:
    """Remove ``folder`` if (and only if) it holds ``kind`` output; a missing folder is fine."""
    if claim(folder, kind, key):
        shutil.rmtree(folder)
    elif Path(folder).is_dir():
        Path(folder).rmdir()


def remove_stale_shards(folder: str | os.PathLike, keep: int) -> list[Path]:
    """Delete the shards ``NNNNNN.tar`` numbered ``keep`` and up, which an earlier, larger run left behind."""
    stale = [p for p in Path(folder).glob("*.tar") if SHARD.match(p.name) and int(p.stem) >= keep]
    for path in stale:
        path.unlink()
    return stale


def clear_samples(folder: str | os.PathLike, key: str = "out_dir") -> None:
    """Remove what an earlier ``dalle-generate`` wrote into ``folder`` (its marker's file list, or for an unmarked
    folder of sample names, those), so a rerun never leaves old images beside new ones. Other folders: an error.
    ``candidates/`` as a link out of the folder is refused in one line naming it: its files are no earlier run's."""
    folder = Path(folder)
    inside.check(folder / "candidates", folder, key)
    if not claim(folder, "samples", key):
        return
    record = read_marker(folder) or {}
    listed = record.get("files")
    if isinstance(listed, list):
        paths = [folder / str(name) for name in listed]
    else:
        paths = [p for p in folder.rglob("*.png")]
    for path in paths:
        if path.resolve().parent in (folder.resolve(), (folder / "candidates").resolve()):
            path.unlink(missing_ok=True)
    candidates = folder / "candidates"
    if candidates.is_dir() and not candidates.is_symlink() and not any(candidates.iterdir()):  # a link: kept
        candidates.rmdir()
