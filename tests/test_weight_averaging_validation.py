"""Lightning's ``WeightAveraging`` under the sharding strategy when the fit validates: the callback swaps the
module's parameters with its averaged copy's around each validation epoch, and a forward without backward leaves
FSDP2's root unit gathered (its parameters then plain tensors) while the copy's are shards: the swap failed with
``aten.copy_.default got mixed torch.Tensor and DTensor`` for any parameter of the root unit (a batch norm's here),
as Lightning's own ``test_ema_ddp*`` found. Averaged and trained parameters and buffers against ``ddp``'s, per rank.

The buffers are batch-norm running statistics, which each rank's forward updates from its own batch: they agree
with ``ddp``'s only where rank 0's are broadcast when ``ddp`` broadcasts them (before the forward that follows a
synchronised grad-enabled one: the first validation forward of each epoch, which reaches the averaged buffers the
callback swapped in, and the first micro-batch of an accumulation window), at one device per node and at two.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env

LAYOUTS = ("dpn2", "dpn1")
ACCUMULATE = (1, 2)


def _fit(layout: str, accumulate: int) -> dict[str, dict[str, torch.Tensor]]:
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
    strategy: Any = "ddp"
    if layout == "dpn2":
        strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[nn.Linear])
    elif layout == "dpn1":  # full PowerSGD rank: exact averaging up to the QR's arithmetic
        strategy = ShardedPowerSGDStrategy(devices_per_node=1, block_classes=[nn.Linear], powersgd_rank=64,
                                           min_compression=0.0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, callbacks=[averaging],
                      max_epochs=2, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accumulate_grad_batches=accumulate)
    data = RandomDataset(32, 32)
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    averaged = averaging._average_model.module  # noqa: SLF001 - the averages themselves, as the callback holds them

    def floats(named: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in named if v.is_floating_point()}

    return {"averaged": floats(averaged.named_parameters()), "module": floats(module.named_parameters()),
            "averaged buffers": floats(averaged.named_buffers()), "module buffers": floats(module.named_buffers())}


def _worker(rank: int, world_size: int, layouts: tuple[str, ...]) -> dict[tuple[str, int], Any]:
    external_launch_env(rank)
    return {(layout, accumulate): _fit(layout, accumulate) for layout in layouts for accumulate in ACCUMULATE}


@pytest.fixture(scope="module")
def ddp() -> list[dict[tuple[str, int], Any]]:
    return run_distributed(_worker, 2, ("ddp",), timeout=300)


@pytest.fixture(scope="module")
def sharded() -> list[dict[tuple[str, int], Any]]:
    return run_distributed(_worker, 2, LAYOUTS, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("accumulate", ACCUMULATE)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_averaging_with_validation_and_batch_norm_as_under_ddp(
        layout: str, accumulate: int, ddp: list[dict[tuple[str, int], Any]],
        sharded: list[dict[tuple[str, int], Any]]) -> None:
    for rank, (want_all, got_all) in enumerate(zip(ddp, sharded)):
        want, got = want_all[("ddp", accumulate)], got_all[(layout, accumulate)]
        for part in ("module", "averaged", "module buffers", "averaged buffers"):
            assert want[part].keys() == got[part].keys()
            for key, value in want[part].items():
                torch.testing.assert_close(got[part][key], value, atol=1e-5, rtol=1e-4,
                                           msg=lambda m, part=part, key=key: f"rank {rank} {part} {key}: {m}")
