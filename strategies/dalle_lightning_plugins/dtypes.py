"""One reading of dtype names for every config knob of the project.

Configs, command lines and constructors name dtypes as ``fp16``, ``bf16``, ``bfloat16`` or ``torch.float32``;
each knob used to parse them with its own table, so a name valid in one place was an error in the next. Every
knob now goes through :func:`resolve_dtype`, and restricts the result with ``allowed`` where only some dtypes
make sense (the wire format of PowerSGD, the compute dtype of a 16-bit branch).

``dalle_lightning`` and ``benchmarks`` may import this module; it imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import overload

import torch

SHORT_NAMES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of ``dtype`` where it has one (``bf16``), else torch's own (``int8``)."""
    for name, value in SHORT_NAMES.items():
        if value == dtype:
            return name
    return str(dtype).removeprefix("torch.")


@overload
def resolve_dtype(spec: None, *, allowed: Collection[torch.dtype] | None = ..., what: str = ...) -> None: ...


@overload
def resolve_dtype(
    spec: torch.dtype | str, *, allowed: Collection[torch.dtype] | None = ..., what: str = ...
) -> torch.dtype: ...


def resolve_dtype(
    spec: torch.dtype | str | None, *, allowed: Collection[torch.dtype] | None = None, what: str = "dtype"
) -> torch.dtype | None:
    """A torch dtype from a dtype or a name (``fp16``, ``bfloat16``, ``torch.float32``; case-insensitive).

    ``None`` passes through (a knob left unset). ``allowed`` limits the result; ``what`` names the knob in the
    error, so a typo in a config reads ``comm_dtype='int8' is not supported; expected one of [...]``.
    """
    if spec is None:
        return None
    if isinstance(spec, torch.dtype):
        dtype: torch.dtype | None = spec
    else:
        key = str(spec).strip().lower().removeprefix("torch.")
        found = SHORT_NAMES.get(key, getattr(torch, key, None))
        dtype = found if isinstance(found, torch.dtype) else None
    if dtype is None or (allowed is not None and dtype not in allowed):
        names = sorted(dtype_name(d) for d in allowed) if allowed is not None else sorted(SHORT_NAMES)
        hint = "expected one of" if allowed is not None else "expected a torch dtype name such as"
        raise ValueError(f"{what}={spec!r} is not supported; {hint} {names}")
    return dtype
