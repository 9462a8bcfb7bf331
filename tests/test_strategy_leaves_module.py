"""Issue 66: after a stage under ``ShardedPowerSGDStrategy`` the module is the user's own, as after ``ddp``.

A stranger's residual model (``tests/helpers/stranger_residual.py``: plain ``x + f(x)`` blocks) is fitted on 2 gloo
processes under ``ddp`` (the reference) and the strategy: 2 devices per node with and without activation
checkpointing, and 1 device per node with it (the user's blocks themselves are checkpointed there); then tested,
with a ``test_step`` that reads ``self.gain.weight.item()`` outside any forward (a shard would be empty on rank 1).
Then, in the same process:

* a user's own DTensor collective on their own mesh behaves as before the fit (torch's own outcome);
* every submodule has the user's class, ``ddp``'s hooks (every hook dict of ``nn.Module``) and ``ddp``'s attributes;
* ``pickle.dumps`` and ``torch.save`` of the module, loaded by a process that cannot import the plugins;
* the weights are ``ddp``'s.

Lightning's own ``WeightAveraging`` and ``EMAWeightAveraging`` give ``ddp``'s averages, in a plain fit and in one
resumed from a checkpoint written mid-fit. One launch runs every case (start-up is the expensive part).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.stranger_residual import WIDTH, Block, Residual
from tests.test_strategy_common import external_launch_env

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
LAYOUTS = ("ddp", "dpn2-ac", "dpn2", "dpn1-ac")
AVERAGING_LAYOUTS = ("ddp", "dpn2")
DATA = TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1)),
                     torch.randn(24, 1, generator=torch.Generator().manual_seed(2)))
HOOK_DICTS = sorted(k for k, v in vars(nn.Module()).items() if "hook" in k and isinstance(v, dict))


def _strategy(layout: str) -> Any:
    if layout == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    per_node = 1 if layout.startswith("dpn1") else 2
    exact = dict(powersgd_rank=4 * WIDTH, min_compression=0.0) if per_node == 1 else {}  # full rank: exact averaging
    return ShardedPowerSGDStrategy(devices_per_node=per_node, block_classes=[Block], timeout=90,
                                   activation_checkpointing=layout.endswith("-ac"), **exact)


def _trainer(layout: str, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=WORLD, max_steps=3, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0, use_distributed_sampler=False)
    return L.Trainer(strategy=_strategy(layout), **{**defaults, **kwargs})


def _loader(rank: int) -> DataLoader:
    return DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, WORLD, rank, shuffle=False))


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    assert not any(isinstance(t, DTensor) for _, t in tensors), [n for n, t in tensors if isinstance(t, DTensor)]
    return {n: t.detach().float().clone() for n, t in tensors}


def _own_collective() -> str:
    """A user's own all-reduce on a DTensor of their own mesh: what torch does with it (here, without a rule for
    ``c10d.allreduce_``, it raises), in one line."""
    mesh = init_device_mesh("cpu", (WORLD,))
    value = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    try:
        dist.all_reduce(value)
        return f"returned {value.to_local().tolist()}"
    except Exception as error:  # noqa: BLE001 - the outcome itself is compared
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _leaves(layout: str, rank: int, workdir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Residual()
    trainer = _trainer(layout)
    trainer.fit(module, _loader(rank))
    trainer.test(module, _loader(rank), verbose=False)
    pickled, saved = workdir / f"{layout}-{rank}.pkl", workdir / f"{layout}-{rank}.pt"
    pickled.write_bytes(pickle.dumps(module))
    torch.save(module, saved)
    return {
        "classes": {n: f"{type(m).__module__}.{type(m).__qualname__}" for n, m in module.named_modules()},
        "hooks": {n: {d: len(getattr(m, d)) for d in HOOK_DICTS} for n, m in module.named_modules()},
        "attributes": {n: sorted(vars(m)) for n, m in module.named_modules()},
        "weights": _weights(module),
        "seen": module.seen,
        "model_is_module": trainer.model is module,
        "files": [str(pickled), str(saved)],
    }


def _averaging(layout: str, rank: int, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in (("WeightAveraging", WeightAveraging), ("EMAWeightAveraging", lambda: EMAWeightAveraging(decay=0.5))):
        torch.manual_seed(0)
        module, callback = Residual(), make()
        _trainer(layout, callbacks=[callback]).fit(module, _loader(rank))
        out[name] = {"module": _weights(module), "average": _weights(callback._average_model.module)}
    # A fit that stopped after its checkpoint at step 2, resumed by a new process's Trainer up to step 4.
    dirpath = workdir / f"averaging-{layout}"
    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    _trainer(layout, callbacks=[EMAWeightAveraging(decay=0.5), checkpoints], enable_checkpointing=True
             ).fit(Residual(), _loader(rank))
    torch.manual_seed(1)
    module, callback = Residual(), EMAWeightAveraging(decay=0.5)
    _trainer(layout, callbacks=[callback], max_steps=4).fit(module, _loader(rank), ckpt_path=dirpath / "epoch=0-step=2.ckpt")
    out["resumed"] = {"module": _weights(module), "average": _weights(callback._average_model.module)}
    return out


def _worker(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    external_launch_env(rank)
    out: dict[str, Any] = {"collective_before": _own_collective()}
    for layout in LAYOUTS:
        out[("leaves", layout)] = _leaves(layout, rank, Path(workdir))
        out[("collective_after", layout)] = _own_collective()
    for layout in AVERAGING_LAYOUTS:
        out[("averaging", layout)] = _averaging(layout, rank, Path(workdir))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("leaves")
    return run_distributed(_worker, WORLD, str(workdir), timeout=300)


def _assert_same(ours: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert sorted(ours) == sorted(ddp)
    for name in ddp:
        torch.testing.assert_close(ours[name], ddp[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


SHARDED = [layout for layout in LAYOUTS if layout != "ddp"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", SHARDED)
def test_classes_hooks_and_attributes_are_ddps(results: list[dict[str, Any]], layout: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("leaves", layout)], rank_out[("leaves", "ddp")]
        assert ours["classes"] == ddp["classes"]
        assert ours["hooks"] == ddp["hooks"]
        assert ours["attributes"] == ddp["attributes"]
        assert ours["model_is_module"] and ddp["model_is_module"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", SHARDED)
def test_weights_and_a_step_reading_a_weight_are_ddps(results: list[dict[str, Any]], layout: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("leaves", layout)], rank_out[("leaves", "ddp")]
        _assert_same(ours["weights"], ddp["weights"], atol=1e-5)
        assert len(ours["seen"]) == len(ddp["seen"]) > 0
        torch.testing.assert_close(torch.tensor(ours["seen"]), torch.tensor(ddp["seen"]), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_own_dtensor_collective_as_torchs(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        for layout in LAYOUTS:
            assert rank_out[("collective_after", layout)] == rank_out["collective_before"]


UNPICKLE = r"""
import pickle, sys
class NoPlugins:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dalle_lightning_plugins", "dalle_lightning", "dalle_lightning_callbacks"):
            raise ImportError(f"{name} is not installed in this process")
sys.meta_path.insert(0, NoPlugins())
import torch
pickled, saved, out = sys.argv[1:]
with open(pickled, "rb") as f:
    a = pickle.load(f)
b = torch.load(saved, weights_only=False)
assert not any(m.startswith("dalle_lightning") for m in sys.modules), sorted(sys.modules)
torch.save([a.state_dict(), b.state_dict()], out)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_module_unpickles_without_the_plugins(results: list[dict[str, Any]], layout: str, tmp_path: Path) -> None:
    ours, ddp = results[1][("leaves", layout)], results[1][("leaves", "ddp")]
    out = tmp_path / "state.pt"
    proc = subprocess.run([sys.executable, "-c", UNPICKLE, *ours["files"], str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for state in torch.load(out):
        _assert_same({n: t.float() for n, t in state.items()}, {n: t for n, t in ddp["weights"].items()}, atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["WeightAveraging", "EMAWeightAveraging", "resumed"])
def test_lightning_weight_averaging_as_ddp(results: list[dict[str, Any]], case: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("averaging", "dpn2")][case], rank_out[("averaging", "ddp")][case]
        _assert_same(ours["average"], ddp["average"], atol=1e-5)
        _assert_same(ours["module"], ddp["module"], atol=1e-5)
