"""``LocalStepsStrategy`` (DiLoCo): nodes that train apart and synchronise every ``sync_every`` updates.

Real gloo processes, the tiny residual model of ``tests/test_strategy_common.py``. The exact properties are
DiLoCo's own blocking fp32 sync (``BLOCKING``); the defaults (int8, ``sync_delay=1``) in the resume test here and in
``tests/test_streaming_outer.py``:

- with one inner update per sync, outer learning rate 1 and no momentum, the outer step is the mean of the
  nodes' weights after one SGD step each from the same weights: exactly synchronous data-parallel SGD
  (``reference_sgd``), at 2 nodes x 1 and 2 nodes x 2 (FSDP2 within each node);
- replicas differ between syncs and agree after every one (``replica_divergence``), a fit that stops between syncs
  ends with one, gradient accumulation counts updates, a second fit (a new Trainer) starts a new cycle;
- a checkpoint saved mid-cycle changes nothing, and a run resumed from it (from other initial weights) lands
  exactly on the uninterrupted run's weights, in both checkpoint formats, at the defaults;
- settings that do not fit together fail in one line.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dalle_lightning_plugins.strategies.local_steps import LocalStepsStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, reference_sgd, token_dataset, trainer

LR, STEPS = 0.5, 3
BLOCKING = dict(outer_comm_dtype="float32", sync_delay=0)  # DiLoCo itself: every sync blocks, in fp32


def _weights(module: L.LightningModule, strategy: LocalStepsStrategy) -> dict[str, torch.Tensor]:
    return {n: v.detach().clone() for n, v in strategy.full_state_dict().items()}


def _dp_equivalent(rank: int, world_size: int, per_node: int) -> dict[str, torch.Tensor]:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    strategy = LocalStepsStrategy(devices_per_node=per_node, sync_every=1, outer_lr=1.0, outer_momentum=0.0, **BLOCKING)
    trainer(strategy, devices=world_size, max_steps=STEPS).fit(module, loader(token_dataset(), rank, world_size=world_size))
    return _weights(module, strategy)


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "per_node"), [(2, 1), (4, 2)])
def test_one_update_per_sync_at_outer_lr_one_is_data_parallel_sgd(world_size: int, per_node: int) -> None:
    results = run_distributed(_dp_equivalent, world_size, per_node, timeout=240)
    reference = reference_sgd(STEPS, LR, world_size)
    for name, want in reference.items():
        torch.testing.assert_close(results[0][name], want, atol=1e-6, rtol=0, msg=name)


class Divergence(L.Callback):
    """``replica_divergence`` after every update (a collective: every rank calls it)."""

    def __init__(self) -> None:
        self.after: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.after.append(trainer.strategy.replica_divergence())


def _cycles(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.AdamW, lr=0.05))
    out = {}
    for fit, (steps, accumulate) in enumerate([(5, 1), (3, 2)]):  # the second fit: a new Trainer, same model
        strategy = LocalStepsStrategy(devices_per_node=1, sync_every=2, **BLOCKING)
        divergence = Divergence()
        trainer(strategy, devices=2, max_steps=steps, accumulate_grad_batches=accumulate,
                callbacks=[divergence]).fit(module, loader(token_dataset(), rank, world_size=2))
        out[fit] = {"after": divergence.after, "end": strategy.replica_divergence(),
                    "figures": strategy.exchange_figures()}
    return out


@pytest.mark.distributed
def test_replicas_differ_between_syncs_and_agree_after_each() -> None:
    for res in run_distributed(_cycles, 2, timeout=240):
        first, second = res[0], res[1]
        # sync_every=2 over 5 updates: synced after updates 2 and 4, apart after 1, 3 and 5, then the fit's last sync
        assert [d == 0 for d in first["after"]] == [False, True, False, True, False], first["after"]
        assert first["end"] == 0.0 and first["figures"]["local_steps/syncs"] == 3
        assert first["figures"]["local_steps/updates_since_sync"] == 0
        # 3 updates of 2 micro-batches each: a sync after update 2 (micro-batch 4), and the last at the end
        assert [d == 0 for d in second["after"][1::2]] == [False, True, False], second["after"]
        assert second["end"] == 0.0 and second["figures"]["local_steps/syncs"] == 2
        # this rank's bytes: 2 syncs of the whole model in fp32 over 3 updates
        n = sum(p.numel() for p in TinyResNet().parameters())
        assert second["figures"]["local_steps/inter_node_bytes_per_update"] == pytest.approx(2 * 4 * n / 3)


EPOCH_OF_3 = token_dataset(n=4 * 2 * 3)  # 4 ranks x batch 2 x 3 updates: the checkpoint at update 3 ends an epoch
# (a plain DataLoader resumes only at an epoch's end), and with sync_every=4 it is mid-cycle


def _fit(rank: int, world_size: int, fmt: str, seed: int, ckpt_dir: Path | None = None,
         ckpt_path: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9))
    strategy = LocalStepsStrategy(devices_per_node=2, sync_every=4, checkpoint_format=fmt)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)] if ckpt_dir else []
    trainer(strategy, max_steps=6, callbacks=callbacks, enable_checkpointing=bool(ckpt_dir)).fit(
        module, loader(EPOCH_OF_3, rank), ckpt_path=ckpt_path)
    return _weights(module, strategy)


def _resume(rank: int, world_size: int, fmt: str, ckpt_dir: str) -> dict:
    external_launch_env(rank)
    saving = _fit(rank, world_size, fmt, seed=0, ckpt_dir=Path(ckpt_dir))  # saves after update 3: mid-cycle
    plain = _fit(rank, world_size, fmt, seed=0)
    mid = next(p for p in sorted(Path(ckpt_dir).iterdir()) if "step=3" in p.name)
    resumed = _fit(rank, world_size, fmt, seed=123, ckpt_path=str(mid))
    return {"saving": saving, "plain": plain, "resumed": resumed}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_mid_cycle_changes_nothing_and_resumes_exactly(tmp_path: Path, fmt: str) -> None:
    results = run_distributed(_resume, 4, fmt, str(tmp_path), timeout=300)
    res = results[0]
    for name, want in res["plain"].items():
        assert torch.equal(res["saving"][name], want), f"{name}: saving a checkpoint changed the run"
        assert torch.equal(res["resumed"][name], want), f"{name}: the resumed run differs"


def test_settings_that_do_not_fit_fail_in_one_line() -> None:
    for kwargs, match in [({"sync_every": 0}, r"sync_every=0, expected a positive"),
                          ({"sync_every": True}, r"sync_every=True"),
                          ({"outer_lr": 0.0}, r"outer_lr=0.0, expected a positive"),
                          ({"outer_momentum": 1.0}, r"outer_momentum=1.0, expected a momentum in \[0, 1\)"),
                          ({"outer_comm_dtype": "int4"}, r"outer_comm_dtype"),
                          ({"sync_every": 4, "fragments": 5}, r"fragments=5, expected 1 to sync_every=4"),
                          ({"sync_every": 4, "sync_delay": 5}, r"sync_delay=5, expected 0 to sync_every=4"),
                          ({"local_mix": 1.0}, r"local_mix=1.0, expected")]:
        with pytest.raises(ValueError, match=match):
            LocalStepsStrategy(**kwargs)
    with pytest.raises(TypeError, match="powersgd_rank"):
        LocalStepsStrategy(powersgd_rank=4)  # type: ignore[call-arg]  # no PowerSGD setting applies


class TwoOptimizers(TinyModule):
    def __init__(self) -> None:
        super().__init__(TinyResNet(), functools.partial(torch.optim.SGD, lr=0.1))
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.model.parameters(), lr=0.1), torch.optim.SGD(self.model.parameters(), lr=0.1)]


def _two_optimizers(rank: int, world_size: int) -> str:
    external_launch_env(rank)
    try:
        trainer(LocalStepsStrategy(devices_per_node=1), devices=2, max_steps=1).fit(
            TwoOptimizers(), loader(token_dataset(), rank, world_size=2))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_two_optimizers_are_refused_in_one_line() -> None:
    for message in run_distributed(_two_optimizers, 2, timeout=120):
        assert "takes one optimizer, got 2" in message and "\n" not in message, message


class WithBatchNorm(L.LightningModule):
    """Batch-norm statistics are buffers: each node keeps its own between syncs, rank 0's after each."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        self.running: list[torch.Tensor] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def on_train_batch_end(self, *args: object) -> None:
        self.running.append(self.net[1].running_mean.clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _buffers(rank: int, world_size: int) -> list[torch.Tensor]:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = WithBatchNorm()
    data = torch.utils.data.TensorDataset(torch.randn(12, 4) + 3 * rank)  # each node sees other statistics
    trainer(LocalStepsStrategy(devices_per_node=1, sync_every=2, block_patterns=["net.0"], **BLOCKING), devices=2, max_steps=3).fit(
        module, torch.utils.data.DataLoader(data, batch_size=4))
    return [*module.running, module.net[1].running_mean.clone()]


@pytest.mark.distributed
def test_buffers_stay_per_node_between_syncs_and_agree_after_each() -> None:
    first, second = run_distributed(_buffers, 2, timeout=120)
    after = [torch.equal(a, b) for a, b in zip(first, second)]
    assert after == [False, True, False, True], after  # updates 1, 2 (sync), 3, and the fit's last sync
