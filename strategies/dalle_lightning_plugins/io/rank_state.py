"""Each rank's own state in a checkpoint (PowerSGD's Q and error buffers, local steps' outer state, the overlap
choice, the rank's own buffers) as tensors and plain values, never as a pickled blob.

Everything the plugins write then loads with ``torch.load(weights_only=True)`` (a full checkpoint) or through
:mod:`dalle_lightning_plugins.io.dcp_reader` (a sharded one), and a file that asks for more is refused.

* :func:`as_data` checks a state holds only tensors, numbers, strings, booleans, None and lists, tuples and dicts
  of them (a part that adds something else fails at the save, in one line naming the key), with every tensor a
  detached CPU copy: a full checkpoint stores that state as it is, by rank.
* :func:`split` / :func:`join`: a sharded checkpoint keeps a rank's tensors in DCP under a key of its own (DCP
  keeps one copy of a key that every rank writes) and the rest, the *skeleton*, in the small metadata file, where
  each tensor is a reference ``{TENSOR_REF: name, "shape": [...], "dtype": "float32"}``: enough to give DCP
  somewhere to load it, although the state's layout (lazily built buffers) is not known before the load.

:func:`to_wire` / :func:`from_wire` carry a state between ranks (a full checkpoint gathers every rank's on rank 0) as
a skeleton and raw bytes: no tensor is pickled, so nothing but the checkpoint's own write calls ``torch.save``.

Checkpoints written before held each rank's state as one ``torch.save``'d byte string; :func:`from_legacy` reads it
as data (it held only data) and refuses it in one line if it asks for more.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dalle_lightning_plugins.io.refusal import torch_load

TENSOR_REF = "dalle_lightning_plugins.tensor"  # the key that marks a tensor's place in a skeleton
_SCALARS = (type(None), bool, int, float, str)  # bool before int: a bool stays a bool
_KEYS = (bool, int, str)


def as_data(state: Any, where: str = "state") -> Any:
    """``state`` with every tensor a detached CPU copy; TypeError (one line, naming where) on anything else that
    ``torch.load(weights_only=True)`` would refuse or that is not meant for a file."""
    if isinstance(state, DTensor):
        raise TypeError(f"{where} is a DTensor; per-rank state holds this rank's local tensors (.to_local())")
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    for kind in _SCALARS:  # a subclass (numpy's float64, an IntEnum) as the plain value: no global in the file
        if isinstance(state, kind):
            return state if kind is type(None) else kind(state)
    if isinstance(state, (list, tuple)):
        items = [as_data(v, f"{where}[{i}]") for i, v in enumerate(state)]
        return items if isinstance(state, list) else tuple(items)
    if isinstance(state, dict):
        bad = [k for k in state if not isinstance(k, _KEYS)]
        if bad:
            raise TypeError(f"{where} has a key of type {type(bad[0]).__name__} ({bad[0]!r}); expected str, int "
                            "or bool keys")
        return {k: as_data(v, f"{where}[{k!r}]") for k, v in state.items()}
    raise TypeError(f"{where} is a {type(state).__module__}.{type(state).__qualname__}; per-rank checkpoint state "
                    "holds tensors, numbers, strings, booleans, None, and lists, tuples and dicts of them")


def split(state: Any, where: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors by name): ``state``'s plain values with each tensor replaced by a reference."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = str(len(tensors))
            tensors[name] = value
            return {TENSOR_REF: name, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if isinstance(value, (list, tuple)):
            items = [walk(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(as_data(state, where)), tensors


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and TENSOR_REF in value


def template(skeleton: Any) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, by name, for DCP to load a skeleton's tensors into; ValueError if a reference is bad."""
    out: dict[str, torch.Tensor] = {}

    def walk(value: Any) -> None:
        if _is_ref(value):
            dtype = getattr(torch, str(value.get("dtype")), None)
            shape = value.get("shape")
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) \
                    or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError(f"a tensor reference {value!r} in a checkpoint's per-rank state; expected a dtype "
                                 "name and a list of sizes")
            out[str(value[TENSOR_REF])] = torch.empty(shape, dtype=dtype)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(skeleton)
    return out


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state :func:`split` took apart: each reference replaced by its loaded tensor."""
    if _is_ref(skeleton):
        return tensors[str(skeleton[TENSOR_REF])]
    if isinstance(skeleton, (list, tuple)):
        items = [join(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    if isinstance(skeleton, dict):
        return {k: join(v, tensors) for k, v in skeleton.items()}
    return skeleton


def to_wire(state: Any, where: str = "state") -> tuple[Any, bytes]:
    """(skeleton, the tensors' raw bytes one after another): a state to send to another rank as plain values and
    bytes, so that no tensor is pickled (pickle writes each tensor's storage with ``torch.save``)."""
    skeleton, tensors = split(state, where)
    raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    return skeleton, torch.cat(raw).numpy().tobytes() if raw else b""


def from_wire(skeleton: Any, raw: bytes) -> Any:
    """The state :func:`to_wire` sent."""
    shapes = template(skeleton)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensors, start = {}, 0
    for name in sorted(shapes, key=int):
        like = shapes[name]
        size = like.numel() * like.element_size()
        tensors[name] = flat[start:start + size].clone().view(like.dtype).reshape(like.shape)
        start += size
    if start != flat.numel():
        raise ValueError(f"{flat.numel()} bytes of per-rank tensors, the skeleton describes {start}")
    return join(skeleton, tensors)


def from_legacy(value: Any, path: Any, part: str, weights_only: bool | None) -> Any:
    """A rank's state as stored: as it is, or a byte string of a checkpoint written before this module (read
    with the caller's ``weights_only``, so as data unless the caller trusts the file)."""
    if isinstance(value, (bytes, bytearray)):
        return torch_load(io.BytesIO(bytes(value)), path, weights_only, part=part, map_location="cpu")
    return value
