"""After a stage, the per-resblock precision plugin holds its scales and settings, not the stage's modules: under the
sharding strategy those are FSDP2's units, whose per-process classes pickle cannot name, so ``torch.save(trainer)``
after ``fit`` failed there while it worked under ``ddp``. Both strategies here, on a stranger's residual model."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env


def _worker(rank: int, world_size: int, strategy_name: str) -> dict[str, Any]:
    external_launch_env(rank)
    import lightning.pytorch as L

    from dalle_lightning_plugins import ResblockScalingPrecision, ShardedPowerSGDStrategy
    from tests.helpers.stranger_residual import Block, Residual

    torch.manual_seed(0)
    module = Residual()
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[Block]) if strategy_name == "sharded" \
        else "ddp"
    plugin = ResblockScalingPrecision("bf16", block_classes=[Block])
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, strategy=strategy, plugins=[plugin])
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer.fit(module, DataLoader(data, batch_size=4))
    saved = io.BytesIO()
    torch.save(trainer, saved)  # raised PicklingError (FSDPBlock) under the sharding strategy before
    saved.seek(0)
    again = torch.load(saved, weights_only=False).lightning_module
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())
    return {"scales": plugin.state_dict(), "hooks": hooks, "holds_modules": plugin._blocks or plugin._root is not None,
            "weights": {k: v.clone() for k, v in module.state_dict().items()},
            "reloaded": {k: v.clone() for k, v in again.state_dict().items()}}


@pytest.mark.distributed
def test_trainer_pickles_after_fit_with_the_plugin_as_under_ddp() -> None:
    results = {name: run_distributed(_worker, 2, name, timeout=180)
               for name in ("ddp", "sharded")}
    for name, ranks in results.items():
        for got in ranks:
            assert got["hooks"] == 0 and not got["holds_modules"], name
            for key, value in got["weights"].items():
                torch.testing.assert_close(got["reloaded"][key], value)
    assert results["sharded"][0]["scales"] == results["ddp"][0]["scales"]
