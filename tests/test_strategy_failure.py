"""When one rank dies mid-training, the others fail with an error within a bounded time instead of hanging.

2 simulated nodes x 2 devices; rank 3 calls ``os._exit`` at the start of its second step. This test launches its
own processes (``run_distributed`` rightly aborts everything as soon as one worker dies, which would
hide what the survivors do). The strategy's collective timeout bounds the wait even for ranks that never talk
to the dead one directly.
"""

from __future__ import annotations

import functools
import os
import queue
import time
from datetime import timedelta

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer

from dalle_lightning_plugins.strategies.mesh import build_mesh
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import host_store, join_group, run_distributed, stop

WORLD, VICTIM = 4, 3
COLLECTIVE_TIMEOUT = 10.0  # seconds
BOUND = COLLECTIVE_TIMEOUT + 35.0  # plus teardown, on a loaded 2-core machine


class DieAtSecondStep(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == VICTIM and trainer.global_step == 1:
            os._exit(17)


def _entry(rank: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    join_group(rank, WORLD, port, "gloo", COLLECTIVE_TIMEOUT, store_timeout=60)
    external_launch_env(rank)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.1))
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, timeout=COLLECTIVE_TIMEOUT)
    try:
        trainer(strategy, max_steps=50, callbacks=[DieAtSecondStep()]).fit(module, loader(token_dataset(), rank))
        results.put((rank, "finished"))
    except Exception as err:  # the behaviour under test: an error, not a hang
        results.put((rank, f"error: {type(err).__name__}: {str(err)[:200]}"))


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_survivors_error_out_when_a_rank_dies() -> None:
    ctx = mp.get_context("spawn")
    store = host_store(WORLD, timeout=120)
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, store.port, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 180  # generous: four interpreters import torch + lightning on 2 cores
        while procs[VICTIM].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert procs[VICTIM].exitcode == 17, "the victim did not die as planned"
        died = time.monotonic()
        reports: dict[int, str] = {}
        while len(reports) < WORLD - 1 and time.monotonic() < died + BOUND:
            try:
                rank, what = results.get(timeout=0.5)
                reports[rank] = what
            except queue.Empty:
                pass
        elapsed = time.monotonic() - died
        assert set(reports) == set(range(WORLD)) - {VICTIM}, f"ranks {sorted(reports)} reported within {BOUND}s"
        assert all(v.startswith("error") for v in reports.values()), reports
        print(f"survivors raised within {elapsed:.1f}s: {reports}")
    finally:
        stop(procs)
        results.close()


def _hung_peer(rank: int, world_size: int, timeout: float) -> float | None:
    """Rank 0 all-reduces over the mesh's replicate group; rank 1 (alive but stuck) never joins."""
    mesh = build_mesh("cpu", world_size, 1, "gloo", timedelta(seconds=timeout))
    start = time.monotonic()
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1), group=mesh["replicate"].get_group())
        except RuntimeError:
            return time.monotonic() - start
        return None
    time.sleep(timeout + 2)
    return 0.0


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_mesh_groups_carry_the_collective_timeout() -> None:
    """Sub-groups would otherwise get the 30-minute library default whatever the strategy was told."""
    waited = run_distributed(_hung_peer, 2, 3.0, timeout=90)[0]
    assert waited is not None and 2.5 < waited < 3.0 + 5.0, waited
