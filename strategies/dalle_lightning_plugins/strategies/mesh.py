"""The 2-D device mesh of the sharded PowerSGD strategy: nodes x devices per node.

The paper shards parameters across the GPUs of one machine (fast links) and compresses the gradient
all-reduce between machines (slow links). The mesh makes those two axes explicit: ``"shard"`` (within a
node, contiguous global ranks) and ``"replicate"`` (the same shard ordinal on every node). Several nodes
can be simulated on one machine by choosing ``devices_per_node`` smaller than the processes it runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dalle_lightning_plugins import compat

MESH_DIM_NAMES = ("replicate", "shard")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (in-place edits reach the DTensor), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def mesh_shape(world_size: int, devices_per_node: int) -> tuple[int, int]:
    """Return ``(nodes, devices_per_node)`` or raise a one-line error naming both values.

    A mesh that does not tile the world exactly would silently leave ranks out of a group, so a mismatch is
    an error, never rounded.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}, expected a positive number of processes")
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node={devices_per_node}, expected a positive number of devices")
    if world_size % devices_per_node != 0:
        raise ValueError(
            f"world size {world_size} is not a multiple of devices_per_node={devices_per_node}; "
            f"expected nodes x devices_per_node == world size"
        )
    return world_size // devices_per_node, devices_per_node


def _group_options(backend: str, timeout: timedelta | None) -> Any:
    """Process-group options carrying ``timeout``: sub-groups otherwise get the 30 min library default,
    so a dead peer would hang the survivors for half an hour."""
    if timeout is None:
        return None
    if backend == "gloo":
        opts = compat.gloo_options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        return None
    return compat.set_group_timeout(opts, timeout)


def build_mesh(
    device_type: str, world_size: int, devices_per_node: int, backend: str, timeout: timedelta | None = None
) -> DeviceMesh:
    """A ``("replicate", "shard")`` mesh; the default process group must already be initialised."""
    shape = mesh_shape(world_size, devices_per_node)
    opts = _group_options(backend, timeout)
    override: Any = {name: opts for name in MESH_DIM_NAMES} if opts is not None else None
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES, backend_override=override)
