"""A fit under the plugins' strategies leaves the process as it found it (issue 66, item 2), and the strategies take
every precision string they train in through Lightning's own connector, unpatched (item 1).

On 2 processes (one node of 2 devices, so the parameters are DTensors): a user's own DTensor on a mesh of their own
is checked before the fit, during it (from the LightningModule's hook) and after it. A c10d ``all_reduce`` on it
raises DTensor's own error each time, word for word, while the module's own raw ``all_reduce`` on the strategy's
sharded gradient works during the fit. After each fit (``ShardedPowerSGDStrategy``, ``LocalStepsStrategy``, and a
fit under each precision string) DTensor's table of op handlers is the table from before, and so is the thread count.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_plugins import LocalStepsStrategy, ShardedPowerSGDStrategy
from dalle_lightning_plugins.compat import dtensor_op_handlers
from dalle_lightning_plugins.strategies.precision_choice import PRECISIONS
from tests.helpers.distributed import run_distributed

WORLD = 2
THREADS = max(1, (os.cpu_count() or 1) // WORLD) + 2
DATA = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))


def _raised(call: Any) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is part of what is compared
        return f"{type(error).__name__}: {error}"
    return "no error"


class Probe(L.LightningModule):
    """Tries the user's DTensor and its own gradient with raw collectives once, mid-fit."""

    def __init__(self, theirs: DTensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.theirs = [theirs]  # not a submodule's tensor: the user's own, outside the model
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.seen:
            return
        grad = self.net[0].weight.grad
        assert grad is not None
        summed = grad.detach().clone()
        dist.all_reduce(summed)
        whole = summed.full_tensor() if isinstance(summed, DTensor) else summed
        expected = grad.full_tensor() if isinstance(grad, DTensor) else grad
        self.seen = {
            "theirs": _raised(lambda: dist.all_reduce(self.theirs[0])),
            "own_is_dtensor": isinstance(grad, DTensor),
            "own_all_reduce": bool(torch.allclose(whole, WORLD * expected)),  # averaged already: every rank's alike
            "threads": torch.get_num_threads(),
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: Any, module: L.LightningModule, rank: int, precision: str = "32-true") -> None:
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    data = DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, WORLD, rank, shuffle=False))
    trainer.fit(module, data)


def _state() -> tuple[dict[str, int], int]:
    return {str(op): id(handler) for op, handler in dtensor_op_handlers().items()}, torch.get_num_threads()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    os.environ.pop("OMP_NUM_THREADS", None)  # as in a rank Lightning's launcher started: the strategy sets threads
    torch.set_num_threads(THREADS)  # not the strategy's choice (cores over processes), so a change shows
    theirs = distribute_tensor(torch.arange(8.0).reshape(4, 2), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    out: dict[str, Any] = {"torch_error": _raised(lambda: dist.all_reduce(theirs))}
    before = _state()
    strategies = {
        "sharded_powersgd": lambda: ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[nn.Linear], timeout=60),
        "local_steps": lambda: LocalStepsStrategy(devices_per_node=2, block_classes=[nn.Linear], sync_every=1,
                                                  timeout=60),
    }
    for name, make in strategies.items():
        module = Probe(theirs)
        _fit(make(), module, rank)
        out[name] = {**module.seen, "state_after": _state() == before,
                     "theirs_after": _raised(lambda: dist.all_reduce(theirs))}
    for precision in PRECISIONS:
        module = Probe(theirs)
        start = [p.detach().clone() for p in module.parameters()]
        _fit(strategies["sharded_powersgd"](), module, rank, precision)
        moved = any(not torch.equal(a, p.detach().to(a.dtype)) for a, p in zip(start, module.parameters()))
        finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
        out[precision] = {"moved": moved, "finite": finite, "state_after": _state() == before}
    return out


@pytest.fixture(scope="module")
def fits() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout=300, start_method="fork")


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["sharded_powersgd", "local_steps"])
def test_a_users_own_dtensor_and_the_process_as_without_the_plugins(fits: list[dict[str, Any]], strategy: str) -> None:
    for rank_out in fits:
        torch_error = rank_out["torch_error"]
        assert "does not have a sharding strategy registered" in torch_error, torch_error
        got = rank_out[strategy]
        assert got["theirs"] == torch_error  # during the fit, from the module's hook
        assert got["theirs_after"] == torch_error
        assert got["own_is_dtensor"] and got["own_all_reduce"]  # the strategy's own shards: ddp's sum
        assert got["threads"] == max(1, (os.cpu_count() or 1) // WORLD) != THREADS  # the stage's own count
        assert got["state_after"]  # DTensor's op handlers and the thread count as before the fit


@pytest.mark.distributed
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_string_trains_and_leaves_nothing(fits: list[dict[str, Any]], precision: str) -> None:
    for rank_out in fits:
        assert rank_out[precision] == {"moved": True, "finite": True, "state_after": True}


def test_lightnings_own_precision_check_is_untouched() -> None:
    """Lightning's function, not a replacement, and it still refuses "16-mixed" for its ModelParallelStrategy."""
    check = _AcceleratorConnector._validate_precision_choice
    assert check.__module__ == "lightning.pytorch.trainer.connectors.accelerator_connector"
    assert check.__qualname__ == "_AcceleratorConnector._validate_precision_choice"
    with pytest.raises(ValueError, match="ModelParallelStrategy` does not support"):
        L.Trainer(strategy=ModelParallelStrategy(), precision="16-mixed", accelerator="cpu", devices=2, logger=False)
