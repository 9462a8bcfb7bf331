"""A module left sharded by a stage (``full_weights_after=False``) and trained again by a new Trainer: its second
stage reads weights outside their units and runs its compiled children as the first did, as under ``ddp``.

2 gloo processes, one node. ``CompiledChild`` (a compiled body of units and a compiled head): fit, validate, fit
again with a new Trainer; each child compiles one graph in the fit and one for validation (``no_grad``), and
none in the second fit, under ``ddp`` and under the strategy (the second stage's steps run under the same torch
function modes as the first's, which dynamo's guards compare). ``WeightPenalty`` (an L2 penalty on a unit's weight
in ``training_step``): fit, then fit again with a new Trainer; the weights after both (gathered where the
module stays sharded) are ``ddp``'s.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_patterns import CompiledChild, WeightPenalty
from tests.test_module_patterns import _loader
from tests.test_strategy_common import external_launch_env


def _trainer(layout: str, last: bool) -> L.Trainer:
    strategy = (DDPStrategy(process_group_backend="gloo") if layout == "ddp" else
                ShardedPowerSGDStrategy(devices_per_node=2, timeout=90, full_weights_after=last,
                                        **({"block_patterns": ["body.*"]} if layout == "declared" else {})))
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, use_distributed_sampler=False)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    external_launch_env(rank)
    out: dict[str, Any] = {}
    for layout in ("ddp", "declared"):
        torch.manual_seed(0)
        module = CompiledChild()
        counts = [dict(CompiledChild.compiles)]
        first = _trainer(layout, last=False)
        first.fit(module, _loader(rank))
        counts.append(dict(CompiledChild.compiles))
        first.validate(module, _loader(rank), verbose=False)
        counts.append(dict(CompiledChild.compiles))
        _trainer(layout, last=True).fit(module, _loader(rank))
        counts.append(dict(CompiledChild.compiles))
        out[f"compiled {layout}"] = [{k: after[k] - before[k] for k in after} for before, after in zip(counts, counts[1:])]
    for layout in ("ddp", "default"):
        torch.manual_seed(0)
        module = WeightPenalty()
        _trainer(layout, last=False).fit(module, _loader(rank))
        _trainer(layout, last=True).fit(module, _loader(rank))
        whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in module.named_parameters()}
        out[f"penalty {layout}"] = {n: p.detach().clone() for n, p in whole.items()}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_a_second_stage_on_a_carried_module_compiles_and_reads_as_ddp() -> None:
    for rank_out in run_distributed(_worker, 2, timeout=300):
        expected = [{"body": 1, "head": 1}, {"body": 1, "head": 1}, {"body": 0, "head": 0}]
        assert rank_out["compiled ddp"] == expected, rank_out["compiled ddp"]
        assert rank_out["compiled declared"] == expected, rank_out["compiled declared"]
        ours, ddp = rank_out["penalty default"], rank_out["penalty ddp"]
        assert sorted(ours) == sorted(ddp)
        for name in ddp:
            torch.testing.assert_close(ours[name], ddp[name], atol=2e-5, rtol=0, msg=name)
