"""Each rank selects its own CUDA device before the process group starts, as Lightning's strategies do.

No GPU here: CUDA is mocked. With ``devices=[2, 3]`` local rank 1 must call ``torch.cuda.set_device(cuda:3)``,
and before ``init_process_group`` (NCCL binds a communicator to the current device), or two ranks land on one
GPU whenever CUDA was initialised before the strategy ran.
"""

from __future__ import annotations

import os
from unittest import mock

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy


def test_setup_environment_sets_this_ranks_cuda_device_first() -> None:
    calls: list[str] = []
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(1)
    with mock.patch.dict(os.environ, {"LOCAL_RANK": "1"}):
        strategy = ShardedPowerSGDStrategy(devices_per_node=2, process_group_backend="nccl")
        strategy.accelerator = CUDAAccelerator()
        strategy.parallel_devices = [torch.device("cuda", 2), torch.device("cuda", 3)]
        strategy.cluster_environment = env
        strategy._lightning_module = mock.Mock()
        with (
            mock.patch("torch.cuda.set_device", side_effect=lambda d: calls.append(f"set_device({d})")),
            mock.patch("lightning.pytorch.accelerators.cuda._check_cuda_matmul_precision"),
            mock.patch.object(ShardedPowerSGDStrategy, "_setup_distributed", lambda self: calls.append("init_process_group")),
            mock.patch("dalle_lightning_plugins.strategies.sharded_powersgd.build_mesh", return_value=mock.MagicMock()),
            mock.patch("dalle_lightning_plugins.compression.inter_node.PowerSGD"),
        ):
            strategy.setup_environment()
        assert strategy.root_device == torch.device("cuda", 3)
    assert calls == ["set_device(cuda:3)", "init_process_group"]
