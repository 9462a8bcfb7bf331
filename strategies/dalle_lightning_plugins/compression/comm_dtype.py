"""Communication dtypes for PowerSGD's low-rank factors.

The paper sends P and Q in a 16-bit format with infinities clamped to the format's largest value, so that one
overflowing entry degrades the approximation (which error feedback then repairs) instead of poisoning the sum
on every replica. We support fp32, bf16 and fp16; error buffers and all arithmetic stay fp32, only the wire
format changes.
"""

from __future__ import annotations

import torch

from dalle_lightning_plugins.dtypes import resolve_dtype

COMM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def resolve_comm_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or a config string ("fp32", "bf16", "fp16", ...); reject anything else."""
    return resolve_dtype(dtype, allowed=COMM_DTYPES, what="comm_dtype")


def comm_limit(dtype: torch.dtype, summands: int = 1) -> float:
    """Largest magnitude we send in ``dtype`` so that a sum of ``summands`` such values stays finite.

    All-reduce sums in the wire format, rounding after each addition; each rounding can add half an ulp at the
    top of the range (~max * eps / 2), so we keep that much headroom per summand (never below max / 2 summands).
    """
    info = torch.finfo(dtype)
    if summands == 1:
        return info.max
    return max(info.max / summands - info.max * info.eps / 2, info.max / (2 * summands))


def to_comm(x: torch.Tensor, dtype: torch.dtype, summands: int = 1) -> torch.Tensor:
    """Cast fp32 ``x`` to the wire ``dtype``, clamping +-inf and out-of-range values to +-comm_limit.

    Clamping happens before the cast so that finite fp32 values too large for fp16 do not round to inf either;
    with ``summands`` > 1 the limit leaves room for the all-reduce sum. NaN stays NaN (the skip check has
    already ruled it out). fp32 is sent as is.
    """
    if dtype == torch.float32:
        return x.float()
    limit = comm_limit(dtype, summands)
    return x.float().clamp(-limit, limit).to(dtype)


def from_comm(x: torch.Tensor) -> torch.Tensor:
    """Back to fp32 for the arithmetic that follows the all-reduce."""
    return x.float()
