"""The mesh's NCCL branch (the one every GPU run takes), which the CPU suite cannot reach: skipped without 2 GPUs."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dalle_lightning_plugins.strategies.mesh import build_mesh
from tests.helpers.distributed import run_distributed


def _replicate_and_shard_sums(rank: int, world_size: int) -> tuple[float, float]:
    """2 GPUs as 2 nodes of 1 device: the replicate group holds both ranks, each shard group one."""
    torch.cuda.set_device(rank)
    mesh = build_mesh("cuda", world_size, 1, "nccl", timedelta(seconds=60))
    sums = []
    for axis in ("replicate", "shard"):
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t, group=mesh[axis].get_group())
        sums.append(t.item())
    return sums[0], sums[1]


@pytest.mark.cuda(devices=2)
@pytest.mark.distributed
def test_nccl_mesh_groups_reduce_over_their_axis() -> None:
    assert run_distributed(_replicate_and_shard_sums, 2, backend="nccl", timeout=120) == [(2.0, 1.0), (2.0, 1.0)]
