"""Issue 61: for a Lightning user, ``ShardedPowerSGDStrategy`` behaves as ``ddp`` where Lightning's own tests look.

* After ``fit``, ``validate``, ``test`` and ``predict`` the module's parameters and buffers are plain tensors holding
  the whole values, equal to ``ddp``'s for the same seed (the conformance module, a stranger's ``nn.Sequential``
  with ``block_classes=[nn.Linear]``, the project's prior); a second ``fit`` shards them again and continues as
  ``ddp`` does; ``full_weights_after=False`` keeps them sharded, and a second ``fit`` on the kept units starts
  from rank 0's buffers as ``ddp``'s fresh wrapper does.
* One ``torch.save`` per checkpoint on rank 0 and none on the others, as Lightning's ``ModelCheckpoint`` tests count.
* Every precision string ``ddp`` takes trains as under ``ddp``, or is refused in one line naming the strategy.

One launch of 2 gloo processes runs every case under both strategies (start-up is the expensive part).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning, StochasticWeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_callbacks.ema import EMA
from dalle_lightning_plugins.strategies.precision_choice import PRECISIONS
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers import conformance as C
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env

LAYOUTS = ("ddp", "dpn2")
STAGES = ("fit", "validate", "test", "predict", "refit")
AFTER_FIT_MODELS = ("plain", "stranger", "prior")
PRECISION_TOLERANCE = {"16-true": 1e-3, "bf16-true": 4e-3}  # a 16-bit format's rounding; others: exact


def snapshot(module: nn.Module) -> dict[str, Any]:
    """Every parameter and buffer as the user sees them, and how many are DTensors."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    values = {n: t.detach().float().cpu().clone() for n, t in tensors if not isinstance(t, DTensor)}
    return {"values": values, "dtensors": sum(isinstance(t, DTensor) for _, t in tensors)}


class Stranger(L.LightningModule):
    """A stranger's module, as in Lightning's tests: an ``nn.Sequential`` of ``nn.Linear`` and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CountSaves(ModelCheckpoint):
    """Lightning's ``ModelCheckpointTestInvocations``: ``torch.save`` calls between train start and end, and the
    strategy's ``save_checkpoint`` calls."""

    saves = strategy_saves = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._save, torch.save = torch.save, Mock(wraps=torch.save)  # type: ignore[method-assign]
        trainer.strategy.save_checkpoint = Mock(wraps=trainer.strategy.save_checkpoint)  # type: ignore[method-assign]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.saves = torch.save.call_count  # type: ignore[attr-defined]
        self.strategy_saves = trainer.strategy.save_checkpoint.call_count  # type: ignore[attr-defined]
        torch.save = self._save  # type: ignore[method-assign]


def _strategy(layout: str, **kwargs: Any) -> Any:
    if layout == "ddp":
        return C.strategy("ddp")
    return ShardedPowerSGDStrategy(devices_per_node=2, timeout=C.CASE_LIMIT, **kwargs)


def _stages(layout: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = C.Plain()
    trainer = C.make_trainer(layout)
    out: dict[str, Any] = {}
    trainer.fit(module, C.loader(rank))
    out["fit"] = snapshot(module)
    # what Lightning's tests do with a module after fit: arithmetic with a copy, flattening
    before = [p.detach().clone() for p in module.parameters()]
    out["vector"] = torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()
    trainer.validate(module, C.loader(rank))
    out["validate"] = snapshot(module)
    trainer.test(module, C.loader(rank))
    out["test"] = snapshot(module)
    out["predictions"] = torch.cat(trainer.predict(module, C.loader(rank)))  # type: ignore[arg-type]
    out["predict"] = snapshot(module)
    module(torch.zeros(1, 4, dtype=torch.long))  # a single-process forward on one rank only, as under ddp
    C.fit(layout, module, rank)  # a new Trainer, same module: sharded again, continues from the whole weights
    out["refit"] = snapshot(module)
    out["moved"] = torch.tensor(max((a - b).abs().max().item() for a, b in zip(module.parameters(), before)))
    return out


def _after_fit(model: str, layout: str, rank: int, workdir: Path) -> dict[str, Any]:
    """What Lightning's model pipeline and a user do with a module and Trainer after ``fit``: restore a checkpoint
    into it (``trainer._checkpoint_connector.restore``, as ``tests_pytorch/helpers/pipelines.py``), load a state
    dict, ``torch.save`` the module and the Trainer, ``deepcopy`` the module. On the conformance module, a
    stranger's ``nn.Sequential`` and the project's prior."""
    torch.manual_seed(0)
    if model == "plain":
        module, loader, strategy = C.Plain(), C.loader(rank), _strategy(layout)
    elif model == "stranger":
        module, data = Stranger(), TensorDataset(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
        loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, C.WORLD, rank, shuffle=False))
        strategy = _strategy(layout, block_classes=[nn.Linear])
    else:
        from tests.test_strategy_exact_models import LR, prior_module, rank_loader

        module, prior_data = prior_module()
        module.optimizer_factory = functools.partial(torch.optim.SGD, lr=LR)  # as Hydra's partial: it pickles
        loader = rank_loader(prior_data, rank)
        strategy = C.strategy("ddp", find_unused=True) if layout == "ddp" else _strategy(layout)
    trainer = C.make_trainer(layout, strategy_=strategy, max_steps=2)
    trainer.fit(module, loader)
    path = workdir / f"after-fit-{model}-{layout}.ckpt"
    trainer.save_checkpoint(path)
    fitted = snapshot(module)["values"]
    out: dict[str, Any] = {}
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    trainer._checkpoint_connector.restore(str(path))
    out["restored"] = snapshot(module)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    module.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    out["loaded"] = snapshot(module)
    saved_module = workdir / f"module-{model}-{layout}-{rank}.pt"
    saved_trainer = workdir / f"trainer-{model}-{layout}-{rank}.pt"
    torch.save(trainer.model, saved_module)
    torch.save(trainer, saved_trainer)
    out["model_is_module"] = trainer.model is module  # ddp unwraps its DistributedDataParallel at the end
    out["pickled_module"] = snapshot(torch.load(saved_module, weights_only=False))
    out["pickled_trainer"] = snapshot(torch.load(saved_trainer, weights_only=False).lightning_module)
    out["deepcopy"] = snapshot(copy.deepcopy(module))
    out["fitted"] = {"values": fitted, "dtensors": 0}
    return out


class MySWA(StochasticWeightAveraging):
    """A user's subclass, as Lightning's own SWA test writes one."""


def _refused_callbacks(rank: int) -> dict[str, str]:
    """Lightning callbacks that rewrite parameters FSDP2 shards: refused in one line before anything is sharded."""
    out = {}
    for name, callback in (("StochasticWeightAveraging", MySWA(swa_lrs=0.1)),
                           ("ModelPruning", ModelPruning("l1_unstructured", amount=0.5))):
        try:
            C.fit("dpn2", C.Plain(), rank, strategy_=_strategy("dpn2"), callbacks=[callback])
            out[name] = "trained"
        except ValueError as error:
            out[name] = str(error)
    return out


def _one_device(rank: int, world_size: int) -> dict[str, Any]:
    """The same Trainer code on one device (Lightning's ``devices=1`` tests): one node of one, trained as ddp."""
    external_launch_env(rank)
    out = {}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        module = C.Plain()
        strategy = _strategy(layout)
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  use_distributed_sampler=False).fit(module, C.loader(rank))
        out[layout] = snapshot(module)
    return out


def _kept_sharded(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = C.Plain()
    C.fit("dpn2", module, rank, strategy_=_strategy("dpn2", full_weights_after=False))
    out = {"fit_dtensors": snapshot(module)["dtensors"]}
    C.fit("dpn2", module, rank, strategy_=_strategy("dpn2", full_weights_after=False))
    out["refit"] = C.full_weights(module)
    return out


def _kept_refit_buffers(layout: str, rank: int) -> torch.Tensor:
    """One Trainer fits a batch-norm module twice, ``full_weights_after=False`` (its units reused), the first fit
    ending in validation (no grad: ddp broadcasts nothing before the next forward), each rank changing its running
    statistics between the fits: the second fit's first forward takes rank 0's, as a fresh ``ddp`` wrapper does."""
    from tests.helpers.lightning_patterns import NormedRefit

    torch.manual_seed(0)
    module = NormedRefit()
    data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)),
                         torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, C.WORLD, rank, shuffle=False))
    trainer = C.make_trainer(layout, strategy_=_strategy(layout, block_patterns=["body.*"], full_weights_after=False),
                             max_steps=2, val_check_interval=2, limit_val_batches=1)
    trainer.fit(module, loader, loader)
    with torch.no_grad():
        module.norm.running_mean.mul_(rank + 2)
    trainer.fit_loop.epoch_loop.max_steps += 1  # ends on a training step: no validation broadcast after it
    trainer.fit(module, loader, loader)
    return module.norm.running_mean.detach().clone()


def _stranger(layout: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Stranger()
    data = TensorDataset(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, C.WORLD, rank, shuffle=False))
    before = [p.detach().clone() for p in module.parameters()]
    strategy = _strategy(layout, block_classes=[nn.Linear])
    C.make_trainer(layout, strategy_=strategy, max_steps=2).fit(module, loader)
    changed = [torch.any(p - b != 0) for p, b in zip(module.parameters(), before)]  # Lightning's check
    return {**snapshot(module), "changed": torch.tensor(all(changed))}


def _prior(layout: str, rank: int) -> dict[str, Any]:
    from tests.test_strategy_exact_models import prior_module, rank_loader

    module, data = prior_module()
    strategy = C.strategy("ddp", find_unused=True) if layout == "ddp" else _strategy(layout)
    C.make_trainer(layout, strategy_=strategy, max_steps=2).fit(module, rank_loader(data, rank))
    return snapshot(module)


def _checkpoint_saves(layout: str, rank: int, workdir: Path, fmt: str = "full") -> tuple[int, int, int]:
    """``torch.save`` calls, ``strategy.save_checkpoint`` calls, checkpoints on disk."""
    torch.manual_seed(0)
    dirpath = workdir / f"{layout}-{fmt}"
    counter = CountSaves(dirpath=dirpath, save_top_k=-1, every_n_train_steps=1)
    strategy = _strategy(layout, **({} if fmt == "full" else {"checkpoint_format": fmt}))
    C.fit(layout, C.Plain(), rank, strategy_=strategy, callbacks=[counter], enable_checkpointing=True)
    return counter.saves, counter.strategy_saves, len(list(dirpath.glob("*.ckpt")))


def _ema_resumed_finished(layout: str, rank: int, workdir: Path) -> dict[str, Any]:
    """``trainer.save_checkpoint`` after ``fit`` (whole weights), then a resume of that finished run: no training
    loop runs, and EMA hands its (sharded) average to the whole module in ``on_fit_end``."""
    path = workdir / f"ema-{layout}.ckpt"
    torch.manual_seed(0)
    C.fit(layout, C.Plain(), rank, max_steps=2, callbacks=[EMA(decay=0.5)], strategy_=_strategy(layout)
          ).save_checkpoint(path)
    torch.manual_seed(1)
    module = C.Plain()
    C.fit(layout, module, rank, max_steps=2, ckpt_path=path, callbacks=[EMA(decay=0.5)], strategy_=_strategy(layout))
    return snapshot(module)


def _precision(layout: str, rank: int, precision: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = C.Plain()
    C.fit(layout, module, rank, strategy_=_strategy(layout), precision=precision, max_steps=2)
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def _worker(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    external_launch_env(rank)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        out[("stages", layout)] = _stages(layout, rank)
        for model in AFTER_FIT_MODELS:
            out[("after_fit", model, layout)] = _after_fit(model, layout, rank, Path(workdir))
        out[("stranger", layout)] = _stranger(layout, rank)
        out[("prior", layout)] = _prior(layout, rank)
        out[("kept_refit_buffers", layout)] = _kept_refit_buffers(layout, rank)
        out[("saves", layout)] = _checkpoint_saves(layout, rank, Path(workdir))
        out[("ema", layout)] = _ema_resumed_finished(layout, rank, Path(workdir))
        for precision in PRECISIONS:
            out[("precision", precision, layout)] = _precision(layout, rank, precision)
    out[("saves", "dpn2-sharded")] = _checkpoint_saves("dpn2", rank, Path(workdir), "sharded")
    out["kept_sharded"] = _kept_sharded(rank)
    out["refused"] = _refused_callbacks(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("like_ddp")
    return run_distributed(_worker, C.WORLD, str(workdir), timeout=600)


def _assert_same(ours: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert sorted(ours) == sorted(ddp)
    for name in ddp:
        torch.testing.assert_close(ours[name], ddp[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_whole_plain_weights_after_each_stage(results: list[dict[str, Any]], stage: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("stages", "dpn2")], rank_out[("stages", "ddp")]
        assert ours[stage]["dtensors"] == 0
        _assert_same(ours[stage]["values"], ddp[stage]["values"])
    theirs = results[0][("stages", "dpn2")]
    torch.testing.assert_close(theirs["vector"], results[0][("stages", "ddp")]["vector"], atol=1e-6, rtol=0)
    torch.testing.assert_close(theirs["predictions"], results[0][("stages", "ddp")]["predictions"], atol=1e-5, rtol=0)
    assert theirs["moved"] > 0  # the second fit trained


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["stranger", "prior", "ema"])
def test_whole_plain_weights_of_other_modules(results: list[dict[str, Any]], case: str) -> None:
    for rank_out in results:
        ours, ddp = rank_out[(case, "dpn2")], rank_out[(case, "ddp")]
        assert ours["dtensors"] == 0
        _assert_same(ours["values"], ddp["values"], atol=1e-5)
        if case == "stranger":
            assert bool(ours["changed"]) and bool(ddp["changed"])


@pytest.mark.distributed
@pytest.mark.parametrize("model", AFTER_FIT_MODELS)
@pytest.mark.parametrize("use", ["restored", "loaded", "pickled_module", "pickled_trainer", "deepcopy"])
def test_module_and_trainer_usable_after_fit(results: list[dict[str, Any]], model: str, use: str) -> None:
    """Restoring a checkpoint into the fitted module, loading a state dict, ``torch.save`` of the module and the
    Trainer and ``deepcopy`` work as under ddp and give the fitted weights (ddp's, plain)."""
    for rank_out in results:
        ours, ddp = rank_out[("after_fit", model, "dpn2")], rank_out[("after_fit", model, "ddp")]
        assert ours[use]["dtensors"] == 0 and ours["model_is_module"] and ddp["model_is_module"]
        _assert_same(ours[use]["values"], ours["fitted"]["values"])
        _assert_same(ours[use]["values"], ddp[use]["values"], atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("callback", ["StochasticWeightAveraging", "ModelPruning"])
def test_callbacks_rewriting_shards_refused_in_one_line(results: list[dict[str, Any]], callback: str) -> None:
    for rank_out in results:
        message = rank_out["refused"][callback]
        assert "\n" not in message
        assert message.startswith(f"ShardedPowerSGDStrategy(devices_per_node=2) cannot run {callback}: ")
        assert "devices_per_node=1" in message


@pytest.mark.distributed
def test_one_device_is_one_node_of_one() -> None:
    [got] = run_distributed(_one_device, 1, timeout=120)
    assert got["dpn2"]["dtensors"] == 0
    _assert_same(got["dpn2"]["values"], got["ddp"]["values"])


@pytest.mark.distributed
def test_full_weights_after_false_keeps_shards(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        kept = rank_out["kept_sharded"]
        assert kept["fit_dtensors"] > 0
        _assert_same(kept["refit"], rank_out[("stages", "ddp")]["refit"]["values"])


@pytest.mark.distributed
def test_kept_sharded_refit_starts_from_rank_0s_buffers(results: list[dict[str, Any]]) -> None:
    ddp = [r[("kept_refit_buffers", "ddp")] for r in results]
    assert not torch.equal(ddp[0], ddp[1]), "each rank's last batch moved its own statistics"
    for rank, rank_out in enumerate(results):
        torch.testing.assert_close(rank_out[("kept_refit_buffers", "dpn2")], ddp[rank], atol=1e-6, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.distributed
def test_one_torch_save_per_checkpoint(results: list[dict[str, Any]]) -> None:
    """``ModelCheckpoint(save_top_k=-1)`` every step for 3 steps: 3 ``torch.save`` on rank 0, none on rank 1, one
    ``strategy.save_checkpoint`` per checkpoint on every rank, 3 checkpoints on disk, as ddp. The sharded format
    (DCP: ``torch.save`` per tensor on every rank) matches ddp in the last two only (docs/plugins.md)."""
    assert [r[("saves", "ddp")] for r in results] == [(3, 3, 3), (0, 3, 3)]
    assert [r[("saves", "dpn2")] for r in results] == [(3, 3, 3), (0, 3, 3)]
    assert [r[("saves", "dpn2-sharded")][1:] for r in results] == [(3, 3), (3, 3)]


@pytest.mark.distributed
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_strings_train_as_ddp(results: list[dict[str, Any]], precision: str) -> None:
    for rank_out in results:
        _assert_same(rank_out[("precision", precision, "dpn2")], rank_out[("precision", precision, "ddp")],
                     atol=PRECISION_TOLERANCE.get(precision, 1e-6))


@pytest.mark.parametrize("precision", ["64-true"])  # transformer-engine: tests/test_strategy_precision.py
def test_other_precision_strings_refused_in_one_line(precision: str) -> None:
    with pytest.raises(ValueError) as raised:
        L.Trainer(strategy=ShardedPowerSGDStrategy(devices_per_node=2), precision=precision, accelerator="cpu",
                  devices=2, logger=False)
    message = str(raised.value)
    assert "\n" not in message and "ShardedPowerSGDStrategy" in message and repr(precision) in message
    assert "'32-true'" in message and "Fabric" not in message and "ModelParallelStrategy" not in message


@pytest.mark.parametrize("strategy", ["instance", "name"])
def test_16_mixed_string_accepted(strategy: str) -> None:
    chosen: Any = ShardedPowerSGDStrategy(devices_per_node=2) if strategy == "instance" else "sharded_powersgd"
    trainer = L.Trainer(strategy=chosen, precision="16-mixed", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardedPowerSGDStrategy)


def test_full_weights_after_checked() -> None:
    with pytest.raises(ValueError, match="full_weights_after='yes'"):
        ShardedPowerSGDStrategy(full_weights_after="yes")
