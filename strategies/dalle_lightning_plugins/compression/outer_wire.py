"""The wire of DiLoCo's outer step: how a pseudo-gradient crosses the slow link, started now, averaged later.

A sync averages one flat fp32 pseudo-gradient over the replicate group. :func:`start_average` puts it on the wire
and returns at once (``async_op``: gloo's and NCCL's own threads move the bytes); :meth:`InFlight.wait` returns the
fp32 mean. Between the two the caller may keep training: that is how a sync overlaps inner updates (Streaming
DiLoCo, Douillard et al. 2025).

Wires, by ``outer_comm_dtype``:

- ``float32``: one all-reduce, 4 bytes per element;
- ``bfloat16`` / ``float16``: one all-reduce of the pre-divided values, clamped so the sum stays finite (2 bytes);
- ``int8``: each block of :data:`INT8_BLOCK` elements scaled by its largest magnitude to [-127, 127] and rounded
  to nearest, its fp32 scale appended (1 byte + 4 / 1024), and **all-gathered**: an int8 sum would overflow, so
  every rank dequantises every replica's payload and adds them in rank order (every rank gets the same mean).
  At 2 replicas an all-gather moves as many bytes per rank as an all-reduce; at R it moves R - 1 payloads, so
  the int8 wire pays against bf16's all-reduce only up to about 4 replicas. INTELLECT-1 sent its pseudo-gradients
  in int8 with a custom all-reduce; this is the plain one that gloo has.

A non-finite element makes its block's scale NaN, so the mean is non-finite where it was: the outer step's
finite check sees it on every wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dalle_lightning_plugins.compression.comm_dtype import COMM_DTYPES, from_comm, to_comm
from dalle_lightning_plugins.dtypes import resolve_dtype

INT8_BLOCK = 1024  # elements per int8 scale: 0.4% of the payload, and a block's outlier spoils only its block
OUTER_WIRES: tuple[torch.dtype, ...] = (*COMM_DTYPES, torch.int8)


def resolve_outer_wire(dtype: torch.dtype | str) -> torch.dtype:
    """float32 / bfloat16 / float16 / int8 (or their config strings); anything else is a one-line error."""
    return resolve_dtype(dtype, allowed=OUTER_WIRES, what="outer_comm_dtype")


def quantize_int8(flat: torch.Tensor) -> torch.Tensor:
    """fp32 ``flat`` -> one int8 payload: the rounded values, then each block's fp32 scale as 4 int8 bytes."""
    n = flat.numel()
    blocks = -(-n // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    padded = padded.view(blocks, INT8_BLOCK)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    values = torch.nan_to_num(padded / scale.clamp_min(torch.finfo(torch.float32).tiny), nan=0.0)
    values = values.round().clamp_(-127, 127).to(torch.int8)
    return torch.cat([values.reshape(-1), scale.reshape(-1).view(torch.int8)])


def dequantize_int8(payload: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`quantize_int8`, to fp32 with ``n`` elements (a NaN scale gives NaN values)."""
    blocks = -(-n // INT8_BLOCK)
    values = payload[: blocks * INT8_BLOCK].view(blocks, INT8_BLOCK).float()
    scale = payload[blocks * INT8_BLOCK:].view(torch.float32).reshape(blocks, 1)
    return (values * scale).reshape(-1)[:n]


@dataclass
class InFlight:
    """One started average: call :meth:`wait` (once) for the fp32 mean."""

    dtype: torch.dtype
    replicas: int
    numel: int
    wire: torch.Tensor
    bytes: int  # this rank's payload
    work: Any = None
    gathered: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.replicas == 1:
            return self.wire
        if self.dtype == torch.int8:
            total = dequantize_int8(self.gathered[0], self.numel)
            for payload in self.gathered[1:]:  # rank order: every rank adds in the same order, gets the same mean
                total += dequantize_int8(payload, self.numel)
            return total.div_(self.replicas)
        if self.dtype == torch.float32:
            return self.wire.div_(self.replicas)
        return from_comm(self.wire)


def start_average(flat: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None,
                  replicas: int) -> InFlight:
    """Put fp32 ``flat`` (this rank's pseudo-gradient, owned by the call) on the wire; nothing waits here."""
    if replicas == 1:
        return InFlight(dtype, 1, flat.numel(), flat, 0)
    if dtype == torch.int8:
        payload = quantize_int8(flat)
        gathered = [torch.empty_like(payload) for _ in range(replicas)]
        work = dist.all_gather(gathered, payload, group=group, async_op=True)
        return InFlight(dtype, replicas, flat.numel(), payload, payload.numel(), work, gathered)
    wire = flat if dtype == torch.float32 else to_comm(flat / replicas, dtype, replicas)
    work = dist.all_reduce(wire, group=group, async_op=True)
    return InFlight(dtype, replicas, flat.numel(), wire, wire.numel() * wire.element_size(), work)
