"""The all-gathers FSDP issues ahead of each block follow the configured prefetch plan.

Observed, not assumed: one training step runs under ``torch.profiler`` and FSDP2's own trace labels
(``FSDP::pre_forward (block)``, ``FSDP::forward_prefetch for block``, ...) are read back in time order. One
simulated node of 2 devices is enough, since prefetching is within a node.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer
from torch.profiler import ProfilerActivity, profile

from dalle_lightning_plugins.strategies.prefetch import prefetch_plan
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

BLOCKS, DEPTH = 4, 2
START = re.compile(r"FSDP::(pre_forward|pre_backward) \((.+)\)$")
PREFETCH = re.compile(r"FSDP::(forward|backward)_prefetch for (.+)$")


def _worker(rank: int, world_size: int) -> list[str]:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(n_blocks=BLOCKS), functools.partial(torch.optim.SGD, lr=0.1))
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, prefetch_depth=DEPTH)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer(strategy, devices=2, max_steps=1).fit(module, loader(token_dataset(), rank, world_size=2))
    events = sorted((e.time_range.start, e.name) for e in prof.events() if e.name.startswith("FSDP::"))
    return [name for _, name in events]


def observed_prefetches(events: list[str]) -> dict[tuple[str, str], list[str]]:
    """(pass, block) -> blocks whose prefetch was issued while that block was current, in issue order."""
    out: dict[tuple[str, str], list[str]] = {}
    current: tuple[str, str] | None = None
    for name in events:
        if m := START.match(name):
            current = ("forward" if m[1] == "pre_forward" else "backward", m[2])
            out[current] = []
        elif (m := PREFETCH.match(name)) and current is not None and current[0] == m[1]:
            out[current].append(m[2])
    return out


def test_prefetch_plan() -> None:
    forward, backward = prefetch_plan(4, 2)
    assert forward == [[1, 2], [2, 3], [3], []]
    assert backward == [[], [0], [1, 0], [2, 1]]
    assert prefetch_plan(3, 0) == ([[], [], []], [[], [], []])


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_observed_prefetch_order_is_the_configured_one() -> None:
    events = run_distributed(_worker, 2, timeout=180)[0]
    # FSDP2 labels each unit by its name under the sharded root, which holds the LightningModule's children under
    # their own names: the names a user sees in the LightningModule
    names = [f"model.blocks.{i}" for i in range(BLOCKS)]
    forward, backward = prefetch_plan(BLOCKS, DEPTH)
    want = {("forward", names[i]): [names[j] for j in forward[i]] for i in range(BLOCKS)}
    want |= {("backward", names[i]): [names[j] for j in backward[i]] for i in range(BLOCKS)}
    seen = observed_prefetches(events)
    assert {k: v for k, v in seen.items() if k[1] in names} == want
    # and the gathers really run ahead: block 2's all-gather starts before block 1's forward
    assert events.index(f"FSDP::all_gather ({names[2]})") < events.index(f"FSDP::pre_forward ({names[1]})")
