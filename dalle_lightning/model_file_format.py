"""A model file on disk: safetensors, with the building config and the metadata as JSON in its header.

safetensors is the ecosystem's format for weights that anyone may open: a little-endian 8-byte header length, a
JSON header (names, dtypes, shapes, offsets, and a ``__metadata__`` map of strings), then raw tensor bytes. Reading
it parses JSON and copies bytes; nothing in it can name code. The project stores its two dicts there as JSON
strings (``config``, ``meta``) beside ``format: pt`` (so other tools read the tensors as PyTorch's) and
:data:`FORMAT_KEY`. The files keep the names users already pass (``dvae.pt``, ``prior.pt``): which format a file is
in is told by its first bytes (:func:`is_safetensors`), so a file written before, a ``torch.save`` zip starting with
``PK``, still opens through :func:`dalle_lightning.safe_files.read_data`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from dalle_lightning_plugins.io.atomic_files import atomic_path

FORMAT_KEY = "dalle_lightning_model_file"
FORMAT_VERSION = "1"
HEADER_LIMIT = 100_000_000  # bytes of JSON header safetensors itself accepts at most


def is_safetensors(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts as a safetensors file does: a header length that fits the file, then ``{``."""
    with open(path, "rb") as stream:
        head = stream.read(9)
        size = os.fstat(stream.fileno()).st_size
    if len(head) < 9 or head[8:9] != b"{":
        return False
    length = int.from_bytes(head[:8], "little")
    return 2 <= length <= min(HEADER_LIMIT, size - 8)


def own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor alone in its storage (tied weights and views are copied): safetensors stores every name's bytes
    once and refuses tensors that share memory. Values are unchanged."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        whole = storage.nbytes() == tensor.numel() * tensor.element_size() and tensor.is_contiguous()
        if not whole or storage.data_ptr() in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        if tensor.numel():
            seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict[str, Any],
          meta: dict[str, Any]) -> Path:
    """Write a model file atomically (a temporary file renamed into place). ``config`` and ``meta`` are plain
    JSON values (the caller checked them); NaN or infinity in them is refused by strict JSON."""
    header = {"format": "pt", FORMAT_KEY: FORMAT_VERSION,
              "config": json.dumps(config, allow_nan=False, sort_keys=True),
              "meta": json.dumps(meta, allow_nan=False, sort_keys=True)}
    with atomic_path(path) as tmp:
        save_file(own_storage(tensors), tmp, metadata=header)
    return Path(path)


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a JSON object repeats a key ({sorted(k for k in set(keys) if keys.count(k) > 1)[0]!r})")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse(text: str, path: str | os.PathLike, key: str) -> Any:
    """The JSON value stored under ``key`` of the header, strict (no NaN, no repeated keys)."""
    try:
        return json.loads(text, object_pairs_hook=_strict_object, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)!r}: its header's {key} is not strict JSON ({str(exc).splitlines()[0]}); "
                         "expected a file written by dalle-train") from None
    except RecursionError:  # json's parser recurses per level: a few thousand brackets
        raise ValueError(f"{os.fspath(path)!r}: its header's {key} nests too deep to parse; expected a file written "
                         "by dalle-train") from None


def _broken(path: str | os.PathLike, exc: Exception) -> ValueError:
    first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return ValueError(f"{os.fspath(path)!r} is not a readable safetensors file ({type(exc).__name__}: {first}); "
                      "expected a model file written by dalle-train")


def read_values(path: str | os.PathLike) -> tuple[Any, Any]:
    """``(config, meta)`` as stored in the header, parsed but not yet checked (the tensors are not read)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise _broken(path, exc) from None
    if FORMAT_KEY not in header or "config" not in header:
        raise ValueError(f"{os.fspath(path)!r} is a safetensors file but not a dalle-lightning model file (its "
                         f"metadata has no {FORMAT_KEY!r} and 'config'); expected a file written by dalle-train")
    if header[FORMAT_KEY] != FORMAT_VERSION:
        raise ValueError(f"{os.fspath(path)!r} is a dalle-lightning model file of format "
                         f"{header[FORMAT_KEY][:20]!r}; expected {FORMAT_VERSION!r} (a newer release wrote it?)")
    return _parse(header["config"], path, "config"), _parse(header.get("meta", "{}"), path, "meta")


def read_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The tensors' names and shapes, from the header alone (no tensor is read)."""
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise _broken(path, exc) from None


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The named tensors, on the CPU (``safetensors.torch.load_file``)."""
    try:
        return load_file(os.fspath(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise _broken(path, exc) from None
