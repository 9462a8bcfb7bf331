"""Lightning's ``WeightAveraging`` under the sharding strategy when the fit validates: the callback swaps the
module's parameters with its averaged copy's around each validation epoch, and a forward without backward leaves
FSDP2's root unit gathered (its parameters then plain tensors) while the copy's are shards: the swap failed with
``aten.copy_.default got mixed torch.Tensor and DTensor`` for any parameter of the root unit (a batch norm's here),
as Lightning's own ``test_ema_ddp*`` found. Averaged and trained parameters against ``ddp``'s."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env


def _worker(rank: int, world_size: int, strategy_name: str) -> dict[str, Any]:
    external_launch_env(rank)
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch import nn
    from torch.utils.data import DataLoader

    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    class WithBatchNorm(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = WithBatchNorm()
    averaging = EMAWeightAveraging(decay=0.9)
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[nn.Linear]) if strategy_name == "sharded" \
        else "ddp"
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, callbacks=[averaging],
                      max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    data = RandomDataset(32, 32)
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    averaged = averaging._average_model.module  # noqa: SLF001 - the averages themselves, as the callback holds them
    # parameters only: batch-norm running statistics differ from ddp's under the strategy with or without the
    # callback (docs/plugins.md, "What still differs from ddp")
    return {"averaged": {k: v.detach().clone() for k, v in averaged.named_parameters()},
            "module": {k: v.detach().clone() for k, v in module.named_parameters()}}


@pytest.mark.distributed
def test_weight_averaging_with_validation_and_batch_norm_as_under_ddp() -> None:
    ddp = run_distributed(_worker, 2, "ddp", timeout=180)
    sharded = run_distributed(_worker, 2, "sharded", timeout=180)
    for want, got in zip(ddp, sharded):
        for part in ("module", "averaged"):
            assert want[part].keys() == got[part].keys()
            for key, value in want[part].items():
                torch.testing.assert_close(got[part][key], value, atol=1e-5, rtol=1e-4, msg=lambda m, part=part, key=key: f"{part} {key}: {m}")
