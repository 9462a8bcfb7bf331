"""Lightning's collectives on sharded values (issue 61): ``reduce``, ``all_gather``, ``broadcast``,
``self.log(..., sync_dist=True)`` and a module's own ``torch.distributed.all_reduce``/``broadcast`` take the DTensors FSDP2 leaves (a parameter's or a gradient's reduction, ``Shard``
or ``Partial`` placements on the node's sub-mesh) and give what ``ddp`` gives for the same full tensor.

Every value is checked against a reference computed by hand in the test process (the full model, the ranks' batches
averaged as ddp averages them), under ``ddp`` as well as under the sharded strategy, automatic and manual
optimization. The two-level mesh (a DTensor on one node's devices, the reduction over every node) is checked
directly on 4 processes, 2 nodes of 2, with the raw collectives' rule installed for the strategy's mesh only: a
DTensor on a mesh of the user's own meets DTensor's own error, ``async_op=True`` and a ``Partial`` DTensor are
refused in one line, and removing the rule leaves DTensor's table as it was.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_plugins.compat import dtensor_op_handlers
from dalle_lightning_plugins.strategies.dtensor_collectives import RawCollectives, full_value
from dalle_lightning_plugins.strategies.mesh import build_mesh
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3
BATCH = 2
LR = 0.1
LAYOUTS = ("ddp", "dpn2", "dpn1")
MODES = ("automatic", "manual")
DATA = TensorDataset(torch.randn(WORLD * BATCH * STEPS, 4, generator=torch.Generator().manual_seed(1)))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).pow(2).mean()


class Recorder(Logger):
    """Every logged step's metrics, on every rank (Lightning calls ``log_metrics`` on each)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


class Logged(L.LightningModule):
    """Logs a parameter's sum, a gradient's sum and another's max with ``sync_dist`` (on the step, and the gradients'
    on the epoch too, accumulated before their sync); calls the strategy's collectives once."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.net = make_net()
        self.automatic_optimization = not manual
        self.direct: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = loss_of(self, batch[0])
        self.log("w_sum", self.net[0].weight.sum(), sync_dist=True)  # a parameter: Shard(0) -> sum: Partial
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        # after manual_backward: a node's gradients are averaged over the node, and (between nodes) only in the
        # optimizer step, where PowerSGD compresses every backward's sum once; a sum is the same either way
        self._log_grad_sum()
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # both modes: the gradients here are averaged over every rank, under ddp and the sharded strategy
        if self.automatic_optimization:
            self._log_grad_sum()
        weight, bias = self.net[0].weight, self.net[2].bias
        assert weight.grad is not None and bias.grad is not None
        self.log("g_max", bias.grad.abs().max(), sync_dist=True, on_step=True, on_epoch=True, reduce_fx="max")
        if not self.direct:
            strategy = self.trainer.strategy
            self.direct = {
                "reduce_sum": strategy.reduce(weight.grad.sum(), reduce_op="sum"),
                "reduce_mean": strategy.reduce(weight.detach().sum(), reduce_op="mean"),
                "all_gather": strategy.all_gather(weight.grad),
                "module_all_gather": self.all_gather({"g": weight.grad.sum()})["g"],
                "broadcast": strategy.broadcast({"w": weight.detach().clone(), "rank": self.global_rank}, src=1),
                "grad_is_dtensor": isinstance(weight.grad, DTensor),
                **self._raw_collectives(weight),
            }

    def _raw_collectives(self, weight: nn.Parameter) -> dict[str, torch.Tensor]:
        """A module's own ``torch.distributed`` calls on a gradient, as Lightning's manual-optimization tests make
        them: ``all_reduce(grad.data)`` sums the full gradient over the ranks in place (then divided back), and
        ``broadcast`` of a parameter's copy gives rank 1's full value everywhere."""
        grad = weight.grad
        assert grad is not None
        dist.all_reduce(grad.data)
        summed = full_value(grad.detach().clone())
        grad /= self.trainer.world_size
        sent = weight.detach().clone()
        dist.broadcast(sent, src=1)
        return {"raw_all_reduce": summed, "raw_broadcast": full_value(sent)}

    def _log_grad_sum(self) -> None:
        grad = self.net[0].weight.grad
        assert grad is not None
        self.log("g_sum", grad.sum(), sync_dist=True, on_step=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def strategy_of(layout: str) -> Any:
    if layout == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if layout == "dpn2":  # one node of 2: FSDP2 shards every Linear, gradients are DTensors
        return ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[nn.Linear], timeout=60)
    # two nodes of 1: whole tensors, averaged between nodes uncompressed (exactly, as ddp)
    return ShardedPowerSGDStrategy(devices_per_node=1, block_classes=[nn.Linear], uncompressed_patterns=["*"],
                                   overlap=False, timeout=60)


def fit_worker(rank: int, world_size: int, plan: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out = {}
    for layout, mode in plan:
        module, recorder = Logged(manual=mode == "manual"), Recorder()
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy_of(layout), logger=recorder,
                            log_every_n_steps=1, max_steps=STEPS, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
        data = DataLoader(DATA, batch_size=BATCH, sampler=DistributedSampler(DATA, world_size, rank, shuffle=False))
        trainer.fit(module, data)
        direct = module.direct
        assert not any(isinstance(v, DTensor) for v in [*direct.values(), direct["broadcast"]["w"]])
        out[(layout, mode)] = {"rows": recorder.rows, "direct": direct}
    return out


def by_hand() -> dict[str, Any]:
    """ddp's numbers from the full model: per step the mean over ranks of each rank's loss gradient, SGD."""
    net = make_net()
    x = DATA.tensors[0]
    w_sum, g_sum, g_max, direct = [], [], [], {}
    for step in range(STEPS):
        # DistributedSampler without shuffling: rank r reads items r, r + WORLD, ...; step k its k-th batch
        batches = [x[r::WORLD][step * BATCH:(step + 1) * BATCH] for r in range(WORLD)]
        net.zero_grad()
        (sum(loss_of(net, b) for b in batches) / WORLD).backward()
        weight, bias = net[0].weight, net[2].bias
        w_sum.append(weight.sum().item())
        g_sum.append(weight.grad.sum().item())
        g_max.append(bias.grad.abs().max().item())
        if step == 0:
            direct = {
                "reduce_sum": WORLD * weight.grad.sum(),
                "reduce_mean": weight.detach().sum(),
                "all_gather": torch.stack([weight.grad] * WORLD),
                "module_all_gather": torch.stack([weight.grad.sum()] * WORLD),
                "broadcast": {"w": weight.detach().clone(), "rank": 1},
                "raw_all_reduce": WORLD * weight.grad,
                "raw_broadcast": weight.detach().clone(),
            }
        with torch.no_grad():
            for p in net.parameters():
                p -= LR * p.grad
    return {"w_sum": w_sum, "g_sum": g_sum, "g_max": g_max, "direct": direct}


@pytest.fixture(scope="module")
def fits() -> dict[tuple[str, str], Any]:
    plan = [(layout, mode) for layout in LAYOUTS for mode in MODES]
    results = run_distributed(fit_worker, WORLD, plan, timeout=180, start_method="fork")
    return {key: [r[key] for r in results] for key in plan}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sync_dist_and_collectives_match_ddp_by_hand(fits: dict, layout: str, mode: str) -> None:
    ref = by_hand()
    for rank, got in enumerate(fits[(layout, mode)]):
        steps = [row for row in got["rows"] if "g_sum_step" in row]
        assert len(steps) == STEPS, (rank, got["rows"])
        for key in ("w_sum", "g_sum", "g_max"):
            name = key if key == "w_sum" else f"{key}_step"
            assert [row[name] for row in steps] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (rank, key)
        epoch = next(row for row in got["rows"] if "g_sum_epoch" in row)
        assert epoch["g_sum_epoch"] == pytest.approx(sum(ref["g_sum"]) / STEPS, rel=1e-5, abs=1e-6)
        assert epoch["g_max_epoch"] == pytest.approx(max(ref["g_max"]), rel=1e-5, abs=1e-6)
        direct, expected = got["direct"], ref["direct"]
        assert direct["grad_is_dtensor"] == (layout == "dpn2")  # sharded within the node: FSDP2's DTensors
        for key in ("reduce_sum", "reduce_mean", "all_gather", "module_all_gather", "raw_all_reduce",
                    "raw_broadcast"):
            torch.testing.assert_close(direct[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{rank} {key}")
        torch.testing.assert_close(direct["broadcast"]["w"], expected["broadcast"]["w"])
        assert direct["broadcast"]["rank"] == 1


def _raised(call: Any) -> str:
    """``type: message`` of what ``call()`` raises (the test fails if it returns)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is part of what is compared
        return f"{type(error).__name__}: {error}"
    raise AssertionError("expected an error")


def two_level_worker(rank: int, world_size: int) -> dict[str, Any]:
    """2 nodes of 2: a DTensor sharded over the node's devices; node n's full value is (n + 1) * base."""
    mesh = build_mesh("cpu", world_size, 2, "gloo")
    node = rank // 2
    base = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    value = distribute_tensor(base * (node + 1), mesh["shard"], [Shard(0)])
    # a user's own tensor parallelism: a mesh (and process group) of their own over the same ranks
    theirs = distribute_tensor(base.clone(), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    torch_error = _raised(lambda: dist.all_reduce(theirs))  # DTensor's own, without the plugins' rule
    strategy = ShardedPowerSGDStrategy(devices_per_node=2)  # its collectives need no setup but the process group
    assert full_value({"v": [value]})["v"][0].equal(base * (node + 1))
    table = dict(dtensor_op_handlers())
    raw = RawCollectives(mesh, "ShardedPowerSGDStrategy")
    raw.install()
    try:
        out = {
            "mean": strategy.reduce(value.sum(), reduce_op="mean"),  # Partial on the node's sub-mesh
            "sum": strategy.reduce(value, reduce_op="sum"),  # Shard(0)
            "max": strategy.reduce(value.max(), reduce_op="max"),
            "gather": strategy.all_gather(value),
            "broadcast": strategy.broadcast(value, src=2),
            "raw_sum": _raw_all_reduce(value),  # Shard(0)
            "raw_broadcast": _raw_broadcast(value, src=2),
            "partial_refused": _raised(lambda: dist.all_reduce(value.sum())),
            "async_refused": _raised(lambda: dist.all_reduce(value.detach().clone(), async_op=True)),
            "theirs_during": _raised(lambda: dist.all_reduce(theirs)),
            "torch_error": torch_error,
        }
    finally:
        raw.uninstall()
    out["table_restored"] = dict(dtensor_op_handlers()) == table
    out["theirs_after"] = _raised(lambda: dist.all_reduce(theirs))
    return out


def _raw_all_reduce(value: DTensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return full_value(value)


def _raw_broadcast(value: DTensor, src: int) -> torch.Tensor:
    value = value.detach().clone()
    dist.broadcast(value, src=src)
    return full_value(value)


@pytest.fixture(scope="module")
def two_level() -> list[dict[str, Any]]:
    return run_distributed(two_level_worker, 4, timeout=60, start_method="fork")


def test_two_level_mesh_reduces_over_every_node(two_level: list[dict[str, Any]]) -> None:
    base = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    for got in two_level:
        torch.testing.assert_close(got["mean"], base.sum() * (1 + 1 + 2 + 2) / 4)
        torch.testing.assert_close(got["sum"], base * (1 + 1 + 2 + 2))
        torch.testing.assert_close(got["max"], base.max() * 2)
        torch.testing.assert_close(got["gather"], torch.stack([base, base, 2 * base, 2 * base]))
        torch.testing.assert_close(got["broadcast"], 2 * base)
        torch.testing.assert_close(got["raw_sum"], base * (1 + 1 + 2 + 2))
        torch.testing.assert_close(got["raw_broadcast"], 2 * base)


def test_raw_collectives_scoped_to_the_strategys_mesh(two_level: list[dict[str, Any]]) -> None:
    """Only the strategy's own DTensors get the rule; a user's own DTensor meets DTensor's own error (torch has
    no rule for a c10d all-reduce on a DTensor) while the rule is installed and after; nothing stays behind."""
    for got in two_level:
        # torch's own refusal, whose words differ by release ("does not have a sharding strategy registered" on
        # 2.14, "found no DeviceMesh from dtensor args" on 2.9): both name the op
        assert "c10d.allreduce_" in got["torch_error"], got["torch_error"]
        assert got["theirs_during"] == got["torch_error"] == got["theirs_after"]
        assert got["table_restored"]
        for key, names in (("partial_refused", "Partial"), ("async_refused", "async_op=True")):
            message = got[key]
            assert "\n" not in message and names in message and "ShardedPowerSGDStrategy" in message, message
            assert "full_tensor()" in message and "strategy.reduce" in message, message
