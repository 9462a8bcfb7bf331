"""Every rank starts from the same weights and buffers: rank 0's, as ``ddp``'s wrapper makes them when it is built
and before a forward (``broadcast_buffers=True``), in one collective per dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (None: every rank) takes the group's first rank's buffers (as
    ``ddp(broadcast_buffers=True)`` before each forward)."""
    buffers = [b for b in module.buffers()
               if not isinstance(b, DTensor) and (b.is_floating_point() or b.dtype in (torch.int64, torch.int32))]
    if buffers:
        broadcast_flat(buffers, group)


@torch.no_grad()
def broadcast_replicas(module: nn.Module, replicate: DeviceMesh, world_size: int) -> None:
    """Make every node start from node 0's shards, and every rank from rank 0's whole parameters and buffers.

    Each process initialises its own copy; without this, replicas of one shard would start (and stay)
    different whenever the seeds differ.
    """
    if replicate.size() > 1:
        locals_ = [p.to_local() for p in module.parameters() if hasattr(p, "to_local")]
        broadcast_flat(locals_, replicate.get_group())
    whole = [p.data for p in module.parameters() if not hasattr(p, "to_local")]  # parameters left whole
    if whole and world_size > 1:
        broadcast_flat(whole, None)
    if world_size > 1:
        broadcast_buffers(module)


def broadcast_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Broadcast from the group's first rank in one collective per dtype instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if group is None:
            dist.broadcast(flat, src=0)
        else:
            dist.broadcast(flat, group=group, group_src=0)
        for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(chunk.view(t.shape))
