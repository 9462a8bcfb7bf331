"""The overlapped exchange at several devices per node: FSDP2 inside each node, each unit's exchange between
nodes started as soon as FSDP2 has reduce-scattered it, against the end-of-backward path and exact averaging.

4 processes, 2 nodes x 2 devices (gloo), the tiny residual model of ``tests/test_strategy_common.py``:

- at low rank the overlapped run lands on the end-of-backward run's weights within fp32 rounding, and at full
  rank on exact data parallelism (one process, the four ranks' batches together);
- the units' P all-reduces are issued (asynchronously) during the backward, before the step waits for them;
- the embedding, sharded by rows over each node, goes by the rows some rank used (flags in the table's rows);
- the two copies of every shard stay identical, and each rank holds only its half of every unit.
"""

from __future__ import annotations

import functools

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, reference_sgd, token_dataset, trainer

LR, STEPS, WORLD = 0.5, 3, 4


class BackwardEvents(L.Callback):
    """Records every all-reduce issued between ``on_before_backward`` and the end of the exchange."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._real = dist.all_reduce

    def _counting(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.events.append("async" if async_op else "sync")
        return self._real(tensor, op=op, group=group, async_op=async_op)

    def on_before_backward(self, *args) -> None:
        self.events.append("backward")
        dist.all_reduce = self._counting

    def on_after_backward(self, *args) -> None:  # after the exchange: the strategy ran it inside backward
        dist.all_reduce = self._real
        self.events.append("after")


def _fit(rank: int, overlap: bool, powersgd_rank: int, events: BackwardEvents | None = None) -> dict:
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=powersgd_rank, min_compression=0.0,
                                       overlap=overlap, bucket_cap_mb=0.0, full_weights_after=False)
    trainer(strategy, devices=WORLD, max_steps=STEPS, callbacks=[events] if events else []).fit(
        module, loader(token_dataset(), rank, world_size=WORLD))
    local = {n: p.to_local().numel() for n, p in module.named_parameters()}
    return {"full": strategy.full_state_dict(), "divergence": strategy.replica_divergence(), "local": local,
            "sent": strategy.powersgd.stats.bytes_sent_last_step, "overlapped": strategy.inter_node.exchange is not None}


def _paths(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    events = BackwardEvents()
    on = _fit(rank, True, 1, events)
    off = _fit(rank, False, 1)
    full = _fit(rank, True, 12)
    return {"on": on, "off": off, "full": full, "events": events.events}


@pytest.mark.distributed
def test_overlap_per_unit_equals_the_end_of_backward_path_and_full_rank_is_exact() -> None:
    results = run_distributed(_paths, WORLD, timeout=300)
    reference = reference_sgd(STEPS, LR, WORLD)
    first = results[0]
    assert first["on"]["overlapped"] and not first["off"]["overlapped"]
    for name, want in reference.items():
        torch.testing.assert_close(first["on"]["full"][name], first["off"]["full"][name], atol=1e-5, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(first["full"]["full"][name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    for res in results:
        assert res["on"]["divergence"] == 0.0 and res["full"]["divergence"] == 0.0
        # each rank holds half of every unit (the 11-row embedding and head: 6 and 5 rows)
        total = {n: v.numel() for n, v in reference.items()}
        assert sum(res["on"]["local"].values()) < 0.6 * sum(total.values())
        # the embedding by used rows: never more than the end-of-backward path (which sends it whole) and the
        # 11 one-byte row flags; here 4 ranks x 8 tokens use nearly every one of its 11 rows
        assert res["on"]["sent"] <= res["off"]["sent"] + 11
        events = res["events"]
        for step in range(STEPS):
            start = [i for i, e in enumerate(events) if e == "backward"][step]
            end = [i for i, e in enumerate(events) if e == "after"][step]
            window = events[start + 1:end]
            # the units' P all-reduces go asynchronously before the one synchronous flag all-reduce
            first_sync = window.index("sync")
            assert window[:first_sync].count("async") >= 3, window
