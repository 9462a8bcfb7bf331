"""Reading a ``torch.distributed.checkpoint`` (DCP) directory as data: no pickle in it may run code.

DCP's own ``FileSystemReader`` unpickles the directory's ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner`` reads every non-tensor value (an optimizer's ``lr``, a counter) with
``torch.load(weights_only=False)``: a crafted directory runs whatever it names. Here:

* :func:`read_dcp_metadata` unpickles ``.metadata`` through an allow-list of what DCP writes there (its metadata
  dataclasses, ``torch.Size``, dtypes, layouts, paths) and nothing else;
* every file ``.metadata`` names (its ``storage_data``'s ``relative_path``, which ``FileSystemReader`` opens as
  ``directory / relative_path``) must resolve to a regular file inside the directory: an absolute path, ``..``, a
  link out of it or a device (``/dev/zero``) is refused before any file is opened (:func:`check_storage_paths`),
  and ``.metadata`` itself must be a regular file inside it of at most :data:`MAX_METADATA_BYTES`; a chunk with
  ``transform_descriptors`` (DCP's experimental stream extensions, zstd: a compressed chunk DCP would expand whole)
  is refused too, as the plugins' writer never adds one;
* :class:`DataReader` is a ``FileSystemReader`` given ``.metadata`` so read;
* :class:`DataLoadPlanner` reads non-tensor values with the ``weights_only`` the caller was given (``None``:
  torch's default, True since 2.6), as Lightning's ``ddp`` reads a whole file.

A refusal is :class:`~dalle_lightning_plugins.io.refusal.CheckpointRefused`: one line naming the directory, the
key or file, and the global asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from dalle_lightning_plugins.io.refusal import CheckpointRefused, refusal, torch_load

DCP_METADATA = ".metadata"
# ``.metadata`` is unpickled whole. It holds one small entry (about 200 bytes) per chunk of each tensor: a 12B-parameter
# model with its Adam state (a few thousand tensors) sharded over 64 ranks is about 100 MB short of this bound, and the
# plugins shard within a node (8 ranks: a few MB). A larger file is no checkpoint this code wrote, and is refused
# before it is read rather than unpickled into memory.
MAX_METADATA_BYTES = 256 * 2**20

# What DCP's writer pickles into ``.metadata`` besides containers and numbers, by module. Names that torch itself
# writes into the file (two of them private to torch: the file's format, not an API these plugins call).
_FILE_GLOBALS: dict[str, set[str]] = {
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},  # a dataclass: where a chunk lies in which file
    **{module: {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
       for module in ("pathlib", "pathlib._local")},  # the checkpoint id; Python 3.13 names the second module
    "collections": {"OrderedDict"},
}


def _metadata_classes() -> set[str]:
    """Every dataclass and enum of ``torch.distributed.checkpoint.metadata`` (whatever this torch has)."""
    return {name for name, obj in vars(dcp_metadata).items()
            if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
            and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))}


class _DataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict a pickle ("Restricting Globals"): ``find_class`` is the one door
    through which a pickle reaches any function or class; only DCP's metadata types pass it."""

    allowed = {**_FILE_GLOBALS, dcp_metadata.__name__: _metadata_classes()}

    def find_class(self, module: str, name: str) -> Any:
        if name in self.allowed.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"a persistent id {str(pid)[:80]!r}, which DCP metadata never holds")


def outside(directory: str | os.PathLike, file: str | os.PathLike, key: str) -> str | None:
    """Why ``file`` (a name read from a checkpoint under ``key``) is not a regular file inside ``directory``, once
    links and ``..`` are resolved; None when it is. A file that does not exist yet is left to its reader."""
    name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else None
    if not name:
        return f"its {key} is {file!r}; expected the name of a file in the checkpoint directory"
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return f"its {key} {name!r} lies outside the checkpoint directory; expected a name relative to it"
    root = Path(directory).resolve()
    target = (root / name).resolve()
    if target == root or not target.is_relative_to(root):
        return (f"its {key} {name!r} resolves to {str(target)!r}, outside the checkpoint directory; expected a file "
                "inside it")
    if target.exists() and not target.is_file():
        return f"its {key} {name!r} is not a regular file; expected a file the checkpoint's writer made"
    return None


def check_storage_paths(metadata: Metadata, directory: str | os.PathLike, file: str | os.PathLike) -> None:
    """Every file ``metadata`` (read from ``file``) names lies inside ``directory``, or one
    :class:`~dalle_lightning_plugins.io.refusal.CheckpointRefused` line naming ``file`` and the entry."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:  # written before DCP recorded where each chunk lies: nothing is named
        return
    if not isinstance(storage, dict):
        raise CheckpointRefused(f"refusing checkpoint {os.fspath(file)!r}: its storage_data is a "
                                f"{type(storage).__name__}; expected DCP's map of chunks to files (nothing was opened)")
    checked: set[str] = set()
    for index, info in storage.items():
        entry = f"storage_data[{str(getattr(index, 'fqn', index))[:80]!r}]"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:  # e.g. "stream.zstd": DCP would decompress the chunk whole, however large it grows
            raise CheckpointRefused(f"refusing checkpoint {os.fspath(file)!r}: its {entry}.transform_descriptors="
                                    f"{str(transforms)[:80]} ask DCP to decompress or transform a chunk, which this "
                                    "code's writer never does; expected none; none of its files was opened")
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name in checked:
            continue
        problem = outside(directory, name, f"{entry}.relative_path")
        if problem is not None:
            raise CheckpointRefused(f"refusing checkpoint {os.fspath(file)!r}: {problem}; none of its files was "
                                    "opened")
        checked.add(name)


def read_dcp_metadata(path: str | os.PathLike, trust: bool = False) -> Metadata:
    """A DCP directory's ``.metadata`` (or that file itself), through the allow-list unless ``trust``; it and every
    file it names must lie inside the directory, and it must hold at most :data:`MAX_METADATA_BYTES`. Each refusal
    is one :class:`~dalle_lightning_plugins.io.refusal.CheckpointRefused` line, raised on every rank that reads."""
    path = Path(path)
    directory, file = (path, path / DCP_METADATA) if path.is_dir() else (path.parent, path)
    problem = outside(directory, file.name, "index file")
    size = file.stat().st_size if problem is None else 0  # a missing file: open's own error, as before
    if problem is None and size > MAX_METADATA_BYTES:
        problem = (f"its {DCP_METADATA} holds {size} bytes; expected at most {MAX_METADATA_BYTES // 2**20} MiB (DCP's "
                   "index of a checkpoint, a few MB for this code's), so it was not read")
    if problem is not None:
        raise CheckpointRefused(f"refusing checkpoint {os.fspath(directory)!r}: {problem}")
    with open(file, "rb") as stream:
        try:
            metadata = (pickle.Unpickler if trust else _DataUnpickler)(stream).load()
        except pickle.UnpicklingError as exc:
            raise refusal(file, exc) from None
    if not isinstance(metadata, Metadata):
        raise refusal(file, pickle.UnpicklingError(f"a {type(metadata).__name__} where DCP metadata belongs"))
    check_storage_paths(metadata, directory, file)
    return metadata


class DataReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is ``metadata``, read beforehand by :func:`read_dcp_metadata`
    (DCP's loader would take a refusal for a missing file and fall back to per-rank metadata files)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class DataLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with the caller's ``weights_only`` (the refusal naming
    the directory and key) and puts them where DCP's own ``load_bytes`` would: at the value's path in the state
    (``self.mappings``, DCP's record of the nesting it flattened)."""

    def __init__(self, path: str | os.PathLike, weights_only: bool | None) -> None:
        super().__init__()
        self._path = os.fspath(path)
        self._weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        decoded = torch_load(value, self._path, self._weights_only, part=f"key {key!r}")
        if not self.flatten_state_dict:
            self.state_dict[key] = decoded
            return
        *parents, last = self.mappings[key]
        container: Any = self.original_state_dict
        for step in parents:
            container = container[step]
        container[last] = decoded


def load_data(state: dict[str, Any], path: str | os.PathLike, weights_only: bool | None, no_dist: bool = False) -> None:
    """Collective unless ``no_dist``: ``dcp.load(state)`` from ``path`` as data (trusted if ``weights_only`` is
    False)."""
    reader = DataReader(path, read_dcp_metadata(path, trust=weights_only is False))  # refused here, on every rank
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=DataLoadPlanner(path, weights_only),
                 no_dist=no_dist)
    except CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointRefused)]
        if refused:
            raise refused[0] from None
        raise
