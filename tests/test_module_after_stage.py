"""Issue 70: the module after any stage under ``ShardedPowerSGDStrategy(devices_per_node=2)``, against ``ddp``.

A stranger's residual model (``tests/helpers/stranger_residual.py``) on 2 gloo processes, one launch for every case:

* a fit that fails (an exception in ``training_step`` on every rank) leaves the user's own children, parameter
  objects and classes, plain whole tensors on the CPU holding ``ddp``'s weights at the failure, without the
  strategy's hooks; a new Trainer's ``fit`` on it works and, with the failed fit's checkpoint, ends on ``ddp``'s
  weights;
* a fit stopped by ``trainer.should_stop`` ends on ``ddp``'s weights, its own objects; one interrupted by Ctrl-C
  (``KeyboardInterrupt``) leaves the user's own objects, plain on the CPU, holding ``ddp``'s weights;
* a fit that fails on one rank only, its peer blocked in a collective until that times out, cannot gather: each rank
  holds its own trained shard (``ddp``'s values there) and NaN elsewhere, said in one line (the last case: the
  timed-out group is left broken);
* ``test`` on whole weights starts every rank from rank 0's parameters (ranks seeded apart), as ``ddp``'s wrapper;
* parameter groups built in ``__init__`` from the children train as under ``ddp``;
* a forward through a child referenced before the stage (a closure over ``self.blocks[0]``) trains as under
  ``ddp``; a parameter the module registers and a child holds (``self.head_w = self.out.weight``) is refused in one
  line, and so is a gradient hook on a child's parameter (``p.register_hook``), which FSDP2's parameter in its
  place would train without.
"""

from __future__ import annotations

import signal
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.stranger_residual import Block, Residual
from tests.test_strategy_common import external_launch_env

WORLD = 2
LAYOUTS = ("ddp", "dpn2")
DATA = TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1)),
                     torch.randn(24, 1, generator=torch.Generator().manual_seed(2)))
HOOK_DICTS = sorted(k for k, v in vars(nn.Module()).items() if "hook" in k and isinstance(v, dict))


def stage_trainer(layout: str, **kwargs: Any) -> L.Trainer:
    strategy = kwargs.pop("strategy", None) or (
        DDPStrategy(process_group_backend="gloo") if layout == "ddp" else
        ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[Block], timeout=60))
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=WORLD, max_steps=4, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0, use_distributed_sampler=False)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def stage_loader(rank: int) -> DataLoader:
    return DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, WORLD, rank, shuffle=False))


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}


def _objects(module: nn.Module) -> dict[str, int]:
    return {n: id(t) for n, t in [*module.named_parameters(), *module.named_buffers()]} | {
        n: id(m) for n, m in module.named_modules()}


def _plain(module: nn.Module) -> dict[str, Any]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {n: (type(t.data).__name__, str(t.device), t.requires_grad) for n, t in tensors}


class Fails(Residual):
    """Raises in ``training_step`` at step 2 (after a checkpoint at step 2)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            raise RuntimeError("a user's bug")
        return super().training_step(batch, batch_idx)


class Interrupted(Residual):
    """Ctrl-C at step 2: Lightning tears the stage down, then exits."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


class StopsAt(Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step >= 2


class GroupsInInit(Residual):
    """Parameter groups built in ``__init__`` from the children: the body slower than the rest."""

    def __init__(self) -> None:
        super().__init__()
        body = list(self.blocks.parameters())
        rest = [p for n, p in self.named_parameters() if not n.startswith("blocks.")]
        self.groups = [{"params": body, "lr": 0.01}, {"params": rest}]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.groups, lr=0.05, momentum=0.9)


class Taps(Residual):
    """A child reached through a closure made before the stage: the user's own child, which the stage shards in place,
    so the closure runs it as under ``ddp``."""

    def __init__(self) -> None:
        super().__init__()
        self.tap = lambda x, block=self.blocks[0]: block(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.tap(self.inp(batch[0])).mean() * 0


class TiedOnModule(Residual):
    def __init__(self) -> None:
        super().__init__()
        self.head_w = self.out.weight


class GradHooked(Residual):
    """A gradient hook on a child's parameter (clipping it), which ``ddp`` runs on every backward."""

    def __init__(self) -> None:
        super().__init__()
        self.out.weight.register_hook(lambda grad: grad.clamp(-0.01, 0.01))


class ReadsWeights(Residual):
    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.seen.append(self.inp.weight.sum().item())


def _failed_then_resumed(layout: str, rank: int, workdir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Fails()
    before = _objects(module)
    checkpoints = ModelCheckpoint(dirpath=workdir / layout, every_n_train_steps=2, save_top_k=-1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            stage_trainer(layout, callbacks=[checkpoints], enable_checkpointing=True).fit(module, stage_loader(rank))
        except RuntimeError as error:
            raised = str(error)
    out = {"raised": raised, "same_objects": _objects(module) == before, "plain": _plain(module),
           "weights": _weights(module),
           "hooks": {n: sum(len(getattr(m, d)) for d in HOOK_DICTS) for n, m in module.named_modules()},
           "said": [str(w.message) for w in said if "ShardedPowerSGDStrategy" in str(w.message)]}
    module.training_step = Residual.training_step.__get__(module)  # the user's bug fixed: the next fit resumes
    stage_trainer(layout, max_steps=4).fit(module, stage_loader(rank), ckpt_path=workdir / layout / "epoch=0-step=2.ckpt")
    out["resumed"] = _weights(module)
    out["same_objects_after_resume"] = _objects(module) == before
    return out


def _interrupted(layout: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Interrupted()
    before = _objects(module)
    try:
        stage_trainer(layout).fit(module, stage_loader(rank))
    except SystemExit as exit_:
        code = exit_.code
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores Ctrl-C from its shutdown on
    return {"exit": code, "same_objects": _objects(module) == before, "plain": _plain(module),
            "weights": _weights(module)}


class FailsOnRank1(Residual):
    """Raises in ``training_step`` at step 2 on rank 1 only: rank 0 goes on into the step's collectives."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2 and self.global_rank == 1:
            raise RuntimeError("a user's bug on one rank")
        return super().training_step(batch, batch_idx)


def _failed_on_one_rank(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = FailsOnRank1()
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[Block], timeout=3)
    raised = ""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            stage_trainer("dpn2", strategy=strategy).fit(module, stage_loader(rank))
        except RuntimeError as error:
            raised = str(error).splitlines()[0]
    return {"raised": raised, "weights": _weights(module), "plain": _plain(module),
            "said": [str(w.message) for w in said if "ShardedPowerSGDStrategy" in str(w.message)]}


def _stopped(layout: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Residual()
    before = _objects(module)
    stage_trainer(layout, callbacks=[StopsAt()]).fit(module, stage_loader(rank))
    return {"weights": _weights(module), "same_objects": _objects(module) == before, "plain": _plain(module)}


def _test_from_rank0(layout: str, rank: int) -> list[float]:
    torch.manual_seed(rank)  # each rank builds different weights; the test must run on rank 0's
    module = ReadsWeights()
    stage_trainer(layout).test(module, stage_loader(rank), verbose=False)
    return module.seen


def _refused(layout: str, rank: int, make: type) -> str:
    torch.manual_seed(0)
    try:
        stage_trainer(layout).fit(make(), stage_loader(rank))
    except Exception as error:  # noqa: BLE001 - the message is the outcome
        return str(error).splitlines()[0]
    return "trained"


def _worker(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    external_launch_env(rank)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        out[("failed", layout)] = _failed_then_resumed(layout, rank, Path(workdir))
        out[("stopped", layout)] = _stopped(layout, rank)
        out[("interrupted", layout)] = _interrupted(layout, rank)
        out[("test", layout)] = _test_from_rank0(layout, rank)
        torch.manual_seed(0)
        module = GroupsInInit()
        stage_trainer(layout).fit(module, stage_loader(rank))
        out[("groups", layout)] = _weights(module)
        torch.manual_seed(0)
        module = Taps()
        stage_trainer(layout).fit(module, stage_loader(rank))
        out[("taps", layout)] = _weights(module)
    out["tied"] = _refused("dpn2", rank, TiedOnModule)
    dist.barrier()
    out["grad_hook"] = _refused("dpn2", rank, GradHooked)
    dist.barrier()
    out["one_rank_failed"] = _failed_on_one_rank(rank)  # last: its timed-out group is left broken
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("after")), timeout=400)


def _assert_same(ours: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ddp)
    for name in ddp:
        torch.testing.assert_close(ours[name], ddp[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_failed_fit_leaves_the_users_module_and_the_next_fit_resumes_as_ddp(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("failed", "dpn2")], rank_out[("failed", "ddp")]
        assert ours["raised"] == ddp["raised"] == "a user's bug"
        assert ours["same_objects"] and ours["same_objects_after_resume"]
        assert ours["plain"] == ddp["plain"]  # plain tensors on the CPU, requires_grad as they were
        assert ours["hooks"] == ddp["hooks"]
        assert not ddp["said"] and not ours["said"]  # every rank was there: gathered, nothing to say
        _assert_same(ours["weights"], ddp["weights"])  # ddp's weights at the failure, whole
        _assert_same(ours["resumed"], ddp["resumed"])


def test_a_fit_failed_on_one_rank_leaves_each_rank_its_own_shard_and_says_so(results: list[dict[str, Any]]) -> None:
    for rank, rank_out in enumerate(results):
        ours, reference = rank_out["one_rank_failed"], rank_out[("stopped", "ddp")]["weights"]  # ddp after 2 steps
        if rank == 1:
            assert ours["raised"] == "a user's bug on one rank"
        else:  # its collective timed out, waiting for rank 1
            assert ours["raised"] and ours["raised"] != "a user's bug on one rank"
        assert ours["plain"] == rank_out[("stopped", "ddp")]["plain"]  # plain tensors on the CPU, as ddp leaves them
        holes = found = 0
        for name, value in ours["weights"].items():
            missing = value.isnan()
            holes, found = holes + int(missing.sum()), found + int((~missing).sum())
            # this rank's shard is ddp's value after the two steps both ranks finished; the rest is NaN, never stale
            torch.testing.assert_close(value[~missing], reference[name][~missing], atol=1e-6, rtol=0,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        assert holes > 0 and found > 0, (rank, holes, found)  # its own shards kept, the peer's it could not gather
    said = results[0]["one_rank_failed"]["said"]  # one line, on rank 0
    assert len(said) == 1 and "hold this rank's trained shard and NaN elsewhere" in said[0], said


def test_a_fit_stopped_by_should_stop_ends_as_ddp(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("stopped", "dpn2")], rank_out[("stopped", "ddp")]
        assert ours["same_objects"] and ours["plain"] == ddp["plain"]
        _assert_same(ours["weights"], ddp["weights"])


def test_an_interrupted_fit_leaves_the_users_module_as_ddp(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        ours, ddp = rank_out[("interrupted", "dpn2")], rank_out[("interrupted", "ddp")]
        assert ours["exit"] == ddp["exit"] == 1
        assert ours["same_objects"] and ours["plain"] == ddp["plain"]
        _assert_same(ours["weights"], ddp["weights"])  # gathered: every rank reached the teardown


def test_test_on_whole_weights_starts_every_rank_from_rank_0s(results: list[dict[str, Any]]) -> None:
    ddp = [r[("test", "ddp")] for r in results]
    ours = [r[("test", "dpn2")] for r in results]
    assert ddp[0] == ddp[1] and ours == ddp


def test_parameter_groups_built_in_init_train_as_ddp(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        _assert_same(rank_out[("groups", "dpn2")], rank_out[("groups", "ddp")])


def test_a_forward_through_a_child_taken_before_the_stage_trains_as_ddp(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        _assert_same(rank_out[("taps", "dpn2")], rank_out[("taps", "ddp")])


def test_a_parameter_on_the_module_tied_to_a_childs_is_refused_in_one_line(results: list[dict[str, Any]]) -> None:
    for rank_out in results:
        assert "TiedOnModule.head_w is out.weight" in rank_out["tied"], rank_out["tied"]


def test_a_gradient_hook_on_a_childs_parameter_is_refused_in_one_line(results: list[dict[str, Any]]) -> None:
    for rank_out in results:  # ddp runs it; FSDP2's own parameter objects would train without it
        assert rank_out["grad_hook"].startswith("ShardedPowerSGDStrategy(devices_per_node=2): out.weight has a "
                                                "gradient hook"), rank_out["grad_hook"]
