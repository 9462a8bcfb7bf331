"""The step's flags, agreed by every rank in one collective: is any gradient anywhere non-finite, which whole
parameters did some rank use, and which rows of each embedding table.

Every path of the inter-node exchange (the end-of-backward path, the overlapped one, PowerSGD on its own) must
answer these questions the same way on every rank before anything is committed: a step skipped on one rank and
taken on another would leave the replicas different, and gradients one rank has and another lacks would
mismatch the collectives. All of them are answered by one MAX all-reduce of a small uint8 buffer here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

MASK_BYTES = 1  # one uint8 per flag, per used parameter and per embedding row


def finite_per_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One bool per tensor, on the device: all its elements are finite.

    ``(t * 0).sum()`` is 0 when every element is finite and NaN otherwise (Inf * 0 and NaN * 0 are NaN), and it
    cannot overflow. On CPU it takes two vectorised passes where ``torch.isfinite(t).all()`` takes four (7x slower
    over the prior's gradients); no host synchronisation either way.
    """
    return torch.stack([t.mul(0).sum() for t in tensors]).isfinite()


def used_rows(grad: torch.Tensor) -> torch.Tensor:
    """1 for each row of an embedding's gradient holding a non-zero (or non-finite) value, else 0."""
    return grad.ne(0).any(dim=1).to(torch.uint8)


class RowSparse(NamedTuple):
    """An embedding table sent by used rows: this rank's (local) gradient, where its rows start in the whole
    table and how many it holds, and the whole table's rows. Masks travel in the whole table's row numbers, so that ranks holding
    different row shards (FSDP2 at several devices per node) agree on one buffer."""

    name: str
    grad: torch.Tensor | None
    offset: int
    local_rows: int
    rows: int


@dataclass
class StepFlags:
    """What every rank agreed for this step."""

    finite: bool  # every gradient on every rank is finite: take the update
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding name -> row indices some rank used
    row_mask_bytes: int = 0  # bytes of the row masks in the buffer (traffic between nodes, for the stats)


@torch.no_grad()
def agree_step_flags(
    grads: Sequence[torch.Tensor],
    whole: Sequence[nn.Parameter] = (),
    row_sparse: Sequence[RowSparse] = (),
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> StepFlags:
    """One MAX all-reduce over ``group`` (None: every rank) for every answer of the step; see the module docstring.

    Args:
        grads: the local gradients (or gradient shards) to check for non-finite values.
        whole: parameters every rank holds whole: one another rank has a gradient for gets zeros here
            (``ddp(find_unused_parameters=True)``), so every rank passes the same gradients to the collectives;
            one no rank used keeps ``grad=None``, so the optimizer leaves it alone, as under ``ddp``.
        row_sparse: embedding tables sent by used rows: the union of every rank's used rows comes back, in the
            local gradient's row numbers.
        device: where the flags live (the collective's device); default that of the first gradient.

    The flags are read back to the host once: the step's one host synchronisation.
    """
    if device is None:
        device = grads[0].device if grads else (whole[0].device if whole else torch.device("cpu"))
    bad = (~finite_per_tensor(grads).all()).reshape(1) if grads else torch.zeros(1, dtype=torch.bool, device=device)
    masks = []
    for table in row_sparse:
        mask = torch.zeros(table.rows, dtype=torch.uint8, device=device)
        if table.grad is not None and table.local_rows:
            mask[table.offset: table.offset + table.local_rows] = used_rows(table.grad)
        masks.append(mask)
    used = torch.tensor([p.grad is not None for p in whole], dtype=torch.uint8, device=device)
    flags = torch.cat([used, bad.to(device=device, dtype=torch.uint8), *[m.to(device) for m in masks]])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    host = flags.cpu()
    n = len(whole)
    for p, was_used in zip(whole, host[:n].bool().tolist()):
        if was_used and p.grad is None:
            p.grad = torch.zeros_like(p)
    rows: dict[str, torch.Tensor] = {}
    offset = n + 1
    for table in row_sparse:
        start = offset + table.offset
        rows[table.name] = host[start: start + table.local_rows].nonzero().flatten()
        offset += table.rows
    return StepFlags(finite=not bool(host[n]), rows=rows, row_mask_bytes=MASK_BYTES * sum(m.numel() for m in masks))
