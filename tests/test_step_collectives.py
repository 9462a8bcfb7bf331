"""Collectives a training micro-batch adds beyond ``ddp``'s, counted (2 gloo processes, one node of 2 devices).

``ddp`` makes no Python-level collective in a micro-batch (its reducer's all-reduces are C++'s). The strategy's
FSDP2 gathers and reduce-scatters replace those; beyond them it makes, per update, the one all-reduce that agrees
the step's flags (a non-finite gradient skips the update on every rank: ``agree_step_flags``, the update's one host
read), and the node-wide check that every unit ran on every rank (``check_units_ran``) on the first
``VERIFY_FIRST`` micro-batches of a stage and one in ``VERIFY_EVERY`` after: not per micro-batch, where each check
is a host synchronisation on a GPU. Counted over 12 micro-batches (6 updates of 2) by wrapping
``torch.distributed``'s functions in each process, named by the innermost plugin or Lightning frame that called.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from dalle_lightning_plugins.strategies.sharded_root import VERIFY_FIRST
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_patterns import ListBody
from tests.test_module_patterns import _loader
from tests.test_strategy_common import external_launch_env

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "barrier", "all_gather_object", "broadcast_object_list",
               "reduce", "gather", "scatter")
MICRO_BATCHES, ACCUMULATE = 12, 2


class Counting(L.Callback):
    """Wraps the collectives for the fit; counts those called between a batch's start and its end."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on = False
        self.saved: dict[str, Any] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name in COLLECTIVES:
            self.saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._counted(name, original))

    def _counted(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                frames = [f.name for f in traceback.extract_stack()[:-1] if "lightning" in f.filename]
                self.counts[(name, frames[-1] if frames else "?")] += 1
            return original(*args, **kwargs)
        return call

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for name, original in self.saved.items():
            setattr(dist, name, original)

    def on_train_batch_start(self, *args: Any) -> None:
        self.on = True

    def on_train_batch_end(self, *args: Any) -> None:
        self.on = False


def _worker(rank: int, world_size: int) -> dict[str, dict[tuple[str, str], int]]:
    external_launch_env(rank)
    out = {}
    for layout in ("ddp", "dpn2"):
        torch.manual_seed(0)
        strategy = (DDPStrategy(process_group_backend="gloo") if layout == "ddp"
                    else ShardedPowerSGDStrategy(devices_per_node=2, timeout=90))
        counting = Counting()
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=MICRO_BATCHES // ACCUMULATE,
                  accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  use_distributed_sampler=False, callbacks=[counting]).fit(ListBody(), _loader(rank))
        out[layout] = dict(counting.counts)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_micro_batch_adds_no_collective_beyond_ddp_but_the_first_unit_checks() -> None:
    for rank_out in run_distributed(_worker, 2, timeout=300):
        assert rank_out["ddp"] == {}, rank_out["ddp"]
        assert rank_out["dpn2"] == {("all_reduce", "check_units_ran"): VERIFY_FIRST,
                                    ("all_reduce", "agree_step_flags"): MICRO_BATCHES // ACCUMULATE}, rank_out["dpn2"]
