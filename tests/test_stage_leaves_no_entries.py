"""What a stage sets it takes back, on every path: the environment variables the elastic start writes, and the
entries and hooks the strategy adds for Lightning's ``WeightAveraging`` (its sharded copy), after a fit that ends
with ``full_weights_after=False`` and after a fit that fails, as ``ddp`` leaves them."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env

UNSET = "<unset>"


def _environ() -> dict[str, str]:
    return dict(os.environ)


def _changes(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, str]]:
    return {k: (before.get(k, UNSET), after.get(k, UNSET)) for k in before.keys() | after.keys()
            if before.get(k) != after.get(k)}


def _elastic_start(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """The default group made as under torchrun or srun (processes started outside Lightning), from a process
    where MASTER_ADDR and MASTER_PORT were unset (rank 0) or said something else (rank 1)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from dalle_lightning_plugins.environments.elastic import init_default_group

    class Launched(ClusterEnvironment):
        creates_processes_externally = True  # type: ignore[assignment]
        main_address = "127.0.0.1"  # type: ignore[assignment]
        main_port = port  # type: ignore[assignment]

        @staticmethod
        def detect() -> bool:
            return True

        def world_size(self) -> int:
            return world_size

        def set_world_size(self, size: int) -> None:
            pass

        def global_rank(self) -> int:
            return rank

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return rank

        def node_rank(self) -> int:
            return 0

    dist.destroy_process_group()  # the test harness's group: the run's is made here
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if rank == 1:
        os.environ.update(MASTER_ADDR="elsewhere.invalid", MASTER_PORT="1")
    before = _environ()
    strategy = DDPStrategy(cluster_environment=Launched(), process_group_backend="gloo",
                           parallel_devices=[torch.device("cpu")] * world_size, timeout=timedelta(seconds=30))
    made = init_default_group(strategy)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"made": made, "changes": _changes(before, _environ()), "sum": float(total)}


@pytest.mark.distributed
def test_the_elastic_start_leaves_the_environment_as_it_found_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for got in run_distributed(_elastic_start, 2, port, timeout=120):
        assert got == {"made": True, "changes": {}, "sum": 3.0}  # the group works: 1 + 2


def _fits(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch import nn
    from torch.utils.data import DataLoader

    from dalle_lightning_plugins import ShardedPowerSGDStrategy
    from dalle_lightning_plugins.strategies import weight_averaging

    external_launch_env(rank)
    start = _environ()  # each fit starts from the launch's variables (ddp's teardown removes WORLD_SIZE)

    class WithBatchNorm(BoringModel):
        def __init__(self, fail_at: int | None = None) -> None:
            super().__init__()
            self.fail_at = fail_at
            self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == self.fail_at:
                raise RuntimeError("the user's step fails")
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    def fit(layout: str, fail_at: int | None = None) -> dict[str, Any]:
        torch.manual_seed(0)
        averaging = EMAWeightAveraging(decay=0.9)
        strategy: Any = "ddp" if layout == "ddp" else ShardedPowerSGDStrategy(
            devices_per_node=2, block_classes=[nn.Linear], full_weights_after=False)
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, callbacks=[averaging],
                          max_epochs=1, limit_train_batches=4, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)
        os.environ.clear()
        os.environ.update(start)
        before = _environ()
        error = ""
        try:
            trainer.fit(WithBatchNorm(fail_at), DataLoader(RandomDataset(32, 32), batch_size=4))
        except RuntimeError as exc:
            error = str(exc)
        averaged = averaging._average_model.module  # noqa: SLF001 - the copy the strategy sharded
        hooks = [len(m._state_dict_hooks) + len(m._load_state_dict_pre_hooks)  # noqa: SLF001 - torch's hook tables
                 for m in averaged.modules()]
        return {"error": error, "environ": _changes(before, _environ()), "hooks": hooks,
                "entries": sum(1 for _ in weight_averaging._SHARDED),  # noqa: SLF001 - the strategy's registry
                "plain": all(type(p) is nn.Parameter and type(p.data) is torch.Tensor for p in averaged.parameters()),
                "averaged": {k: v.detach().clone() for k, v in averaged.state_dict().items()} if not error else {}}

    return {(layout, fail): fit(layout, fail) for layout in ("ddp", "dpn2") for fail in (None, 2)}


@pytest.fixture(scope="module")
def fits() -> list[dict[Any, Any]]:
    return run_distributed(_fits, 2, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("fail_at", [None, 2], ids=["ends", "fails"])
def test_a_fit_leaves_the_environment_and_the_averaged_copy_as_ddp(fits: list[dict[Any, Any]],
                                                                   fail_at: int | None) -> None:
    for rank, got in enumerate(fits):
        ddp, mine = got[("ddp", fail_at)], got[("dpn2", fail_at)]
        assert mine["error"] == ddp["error"] == ("" if fail_at is None else "the user's step fails")
        # what ddp's stage changes (Lightning's teardown removes WORLD_SIZE), but for the OMP_NUM_THREADS that
        # DDPStrategy sets where it was unset and leaves: the strategy sets the thread count for the stage only
        assert mine["environ"] == {k: v for k, v in ddp["environ"].items() if k != "OMP_NUM_THREADS"}, f"rank {rank}"
        assert mine["hooks"] == ddp["hooks"], f"rank {rank}: the strategy's hooks left on the averaged copy"
        assert mine["entries"] == ddp["entries"] == 0
        if fail_at is None:  # a stage that ran to its end: the copy whole, as ddp's (full_weights_after=False too)
            assert mine["plain"] and ddp["plain"]
            assert mine["averaged"].keys() == ddp["averaged"].keys()
            for key, value in ddp["averaged"].items():
                torch.testing.assert_close(mine["averaged"][key].float(), value.float(), atol=1e-5, rtol=1e-4,
                                           msg=lambda m, key=key: f"rank {rank} {key}: {m}")
