"""One exchange between nodes per update under gradient accumulation, at every ``devices_per_node``.

Accumulating 2 micro-batches of 2 samples must cross between nodes exactly as often as one batch of 4 does, and
land on its weights: counted on the process groups (every all-reduce the run issues over a group that spans
nodes, whoever issues it; a node's own checks on its shard group do not cross), at low
rank and without error feedback, where exchanging each micro-batch would change the result itself (PowerSGD of
half the gradient, then the other half added uncompressed).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer

UPDATES = 3


def _fit(rank: int, world_size: int, per_node: int, accumulate: int) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.5))
    strategy = ShardedPowerSGDStrategy(devices_per_node=per_node, powersgd_rank=1, min_compression=0.0,
                                       error_feedback=False)
    calls = [0]
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is None or group != strategy.device_mesh["shard"].get_group():  # within a node: not an exchange
            calls[0] += 1
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        trainer(strategy, devices=world_size, max_steps=UPDATES, accumulate_grad_batches=accumulate).fit(
            module, loader(token_dataset(), rank, batch_size=4 // accumulate, world_size=world_size))
    finally:
        dist.all_reduce = real
    return strategy.full_state_dict(), calls[0]


def _both(rank: int, world_size: int, per_node: int) -> dict:
    external_launch_env(rank)
    whole, whole_calls = _fit(rank, world_size, per_node, accumulate=1)
    accumulated, accumulated_calls = _fit(rank, world_size, per_node, accumulate=2)
    return {"whole": whole, "accumulated": accumulated, "calls": (whole_calls, accumulated_calls)}


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "per_node"), [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_accumulation_exchanges_once_per_update(world_size: int, per_node: int) -> None:
    results = run_distributed(_both, world_size, per_node, timeout=240)
    for res in results:
        whole_calls, accumulated_calls = res["calls"]
        assert accumulated_calls == whole_calls, res["calls"]
    full = results[0]
    for name, want in full["whole"].items():
        torch.testing.assert_close(full["accumulated"][name], want, atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")
