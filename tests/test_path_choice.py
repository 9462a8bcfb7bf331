"""``overlap="auto"``: both exchange paths timed on the run's first updates, one decision on every rank.

- the schedule: warm-up updates overlapped, then alternating trials, then the faster path for the rest;
- ranks that time differently still decide alike (the medians are averaged over the ranks first);
- through the strategy at 2 nodes x 1 device: the paths alternate, the weights equal the end-of-backward run's
  (the update is the same on either path), and the choice is reported on both ranks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dalle_lightning_plugins.compression.path_choice import OverlapChoice
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer

CPU = torch.device("cpu")


def _run(choice: OverlapChoice, seconds: dict[bool, float]) -> list[bool]:
    paths = []
    while choice.chosen is None:
        path = choice.overlap_now()
        paths.append(path)
        choice.record(seconds[path], path, CPU)
    return paths


def test_schedule_then_the_faster_path() -> None:
    choice = OverlapChoice("auto", warmup=2, trials=2)
    assert _run(choice, {True: 2.0, False: 1.0}) == [True, True, True, False, True, False]
    assert choice.chosen is False and choice.overlap_now() is False
    assert choice.medians_ms == (2000.0, 1000.0)
    choice.record(5.0, False, CPU)  # decided: later updates change nothing
    assert choice.chosen is False
    choice.reset()
    assert _run(choice, {True: 1.0, False: 1.5})[-1] is False and choice.chosen is True


def test_fixed_modes_and_bad_values() -> None:
    for mode in (True, False):
        choice = OverlapChoice(mode)
        assert choice.overlap_now() is mode
        choice.record(1.0, mode, CPU)
        assert choice.chosen is mode and choice.medians_ms is None
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"overlap=.*expected true, false or 'auto'"):
            OverlapChoice(bad)  # type: ignore[arg-type]


def test_a_path_that_never_ran_counts_as_slowest() -> None:
    choice = OverlapChoice("auto", warmup=1, trials=2)
    for _ in range(5):  # a precision that cannot overlap: every update took the end path
        choice.record(1.0, False, CPU)
    assert choice.chosen is False


def _decide(rank: int, world_size: int) -> tuple[bool | None, tuple[float, float] | None]:
    choice = OverlapChoice("auto", warmup=0, trials=2)
    # rank 0 finds overlapping faster (1 s against 3 s), rank 1 slower (4 s against 1 s): on average it is slower
    _run(choice, {True: 1.0, False: 3.0} if rank == 0 else {True: 4.0, False: 1.0})
    return choice.chosen, choice.medians_ms


@pytest.mark.distributed
def test_ranks_that_time_differently_decide_alike() -> None:
    results = run_distributed(_decide, 2, timeout=120)
    assert results == [(False, (2500.0, 2000.0))] * 2


STEPS = 14  # 3 warm-up + 8 trial updates, then 3 on the chosen path


def _fit(rank: int, overlap: bool | str) -> dict:
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.5))
    strategy = ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=1, min_compression=0.0, overlap=overlap)
    finished = [0]
    original_setup = strategy.setup_environment

    def setup_environment() -> None:
        original_setup()
        exchange = strategy.inter_node.exchange
        if exchange is not None:
            real_finish = exchange.finish

            def finish() -> bool:
                finished[0] += 1
                return real_finish()

            exchange.finish = finish  # type: ignore[method-assign]

    strategy.setup_environment = setup_environment  # type: ignore[method-assign]
    trainer(strategy, devices=2, max_steps=STEPS).fit(module, loader(token_dataset(), rank, world_size=2))
    return {"weights": {n: p.detach().clone() for n, p in module.named_parameters()}, "finished": finished[0],
            "figures": strategy.exchange_figures()}


def _both(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    return {"auto": _fit(rank, "auto"), "end": _fit(rank, False)}


@pytest.mark.distributed
def test_auto_alternates_decides_and_keeps_the_update() -> None:
    results = run_distributed(_both, 2, timeout=240)
    chosen = {res["auto"]["figures"]["strategy/overlapped"] for res in results}
    assert len(chosen) == 1  # one decision on both ranks
    overlapped = chosen.pop() == 1.0
    for res in results:
        # warm-up (3) and the overlapped trials (4), then the chosen path for the last 3 updates
        assert res["auto"]["finished"] == 7 + (3 if overlapped else 0)
        assert res["end"]["finished"] == 0 and "strategy/overlapped" not in res["end"]["figures"]
        assert res["auto"]["figures"]["strategy/trial_update_ms_overlapped"] > 0
        for name, value in res["end"]["weights"].items():
            torch.testing.assert_close(res["auto"]["weights"][name], value, atol=1e-5, rtol=0, msg=name)
