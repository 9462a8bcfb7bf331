"""Whole plain weights after a stage, as ``ddp`` leaves a module (``full_weights_after``), and the callbacks whose whole
copies of the parameters FSDP2's shards cannot follow.

A part :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy` holds and calls at
its setup and teardown; it owns ``full_weights_after`` and ``"auto"``'s decision, and is handed everything else.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.environments.peer_loss import lost_peer
from dalle_lightning_plugins.strategies import plain_weights
from dalle_lightning_plugins.strategies.carried import SHARDED_ROOT_ATTR, carry
from dalle_lightning_plugins.strategies.sharded_root import ShardedRoot
from dalle_lightning_plugins.strategies.roll_call import RollCall
from dalle_lightning_plugins.strategies.weight_averaging import whole_averages

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from dalle_lightning_plugins.strategies.stage_model import ShardedModel

# full_weights_after="auto": whole weights after a stage when the whole model takes at most this share of the
# memory free to each rank (the host's available memory divided among its processes, where the whole weights land;
# on a GPU, the smaller of that and the device's free memory: free_bytes_per_rank).
FULL_WEIGHTS_MEMORY_SHARE = 0.5


class WholeWeights:
    """The strategy's end of a stage: whole plain weights where ``full_weights_after`` says so; and whether a
    validate, test or predict stage runs on whole weights from its start, as under ``ddp``.

    It owns ``full_weights_after`` and ``"auto"``'s decision (made once, a collective); the strategy hands it the
    module, the stage's :class:`~dalle_lightning_plugins.strategies.stage_model.ShardedModel` and its process facts,
    and sets its ``model`` to what :meth:`leave` returns."""

    def __init__(self, full_weights_after: bool | str, owner: str) -> None:
        if not (full_weights_after is True or full_weights_after is False or full_weights_after == "auto"):
            raise ValueError(f"full_weights_after={full_weights_after!r}, expected 'auto', True or False")
        self.full_weights_after = full_weights_after
        self.decision: bool | None = None  # "auto"'s decision, made once
        self.owner = owner  # the strategy's class name, for its lines
        self.roll_call = RollCall()  # after an error: whether the node's ranks are all here to gather (each stage's)

    def leave(self, module: nn.Module, stage: ShardedModel, shard_size: int, root_device: torch.device,
              num_processes: int) -> nn.Module | None:
        """The module after a stage, on the CPU as ``ddp`` leaves it: its own children back, holding the whole values
        (``full_weights_after``; a collective, at the end of a stage that ran to its end), or the module kept
        sharded (``full_weights_after=False``). After a stage that failed or was interrupted a peer may be gone: the
        gather runs only where every rank of the node is there (:meth:`_restore_after_error`). Either way the
        strategy's hooks come off.
        Returns the strategy's model from now on (the plain module, as ``ddp`` unwraps its wrapper), or None where it
        stays."""
        root = stage.root
        trainer = compat.attached_trainer(module)
        ours = root is not None and root.owner is module
        if ours:
            root.remove_owner_hooks()
        ended = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        sharded = ours and isinstance(root, FSDPModule) and bool(root.originals) and not plain_weights.is_plain(root)
        carried = ours and isinstance(root, FSDPModule) and not root.originals  # left sharded by full_weights_after
        if not ended:
            if sharded and self._whole_after_error(module, root_device, num_processes):
                return self._restore_after_error(module, root)
            if sharded or carried:  # full_weights_after=False: the shards stay, as after a stage that ends
                plain_weights.release_originals(root)
                carry(module, SHARDED_ROOT_ATTR, (root, shard_size))
                return None
            if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):  # (a failed setup)
                module.cpu()  # as ddp (Strategy.teardown), after an error too
                return module
            return None
        if not (sharded or carried):  # one device per node, or a stage run on the whole module
            module.cpu()  # as ddp (Strategy.teardown): a module whole on every rank ends on the CPU
            return module
        if not root.originals or not self.want(module, root_device, num_processes):
            plain_weights.release_originals(root)
            carry(module, SHARDED_ROOT_ATTR, (root, shard_size))
            return None
        whole_averages(trainer)
        return self._gathered(module, root)  # as ddp unwraps its DistributedDataParallel: the plain module

    @staticmethod
    def _gathered(module: nn.Module, root: ShardedRoot) -> nn.Module:
        """Collective over the node: the user's children back holding the whole trained values, the module on the
        CPU (its own tensors, outside its children, too), nothing carried to a next Trainer."""
        plain_weights.to_plain(root, torch.device("cpu"))
        carry(module, SHARDED_ROOT_ATTR, None)
        module.cpu()
        return module

    def on_exception(self, exception: BaseException) -> None:
        """A stage ended by a collective that failed (a lost peer, a timeout: ``lost_peer``) gathers nothing after it:
        the node's ranks restore alone, without waiting for this one."""
        if lost_peer(exception):
            self.roll_call.give_up()

    def _whole_after_error(self, module: nn.Module, root_device: torch.device, num_processes: int) -> bool:
        """``full_weights_after`` without a collective: ``"auto"`` not yet decided judges this rank's memory alone."""
        if self.full_weights_after is True or self.full_weights_after is False:
            return self.full_weights_after
        if self.decision is not None:
            return self.decision
        return plain_weights.whole_bytes(module) <= FULL_WEIGHTS_MEMORY_SHARE * free_bytes_per_rank(root_device,
                                                                                                  num_processes)

    def _restore_after_error(self, module: nn.Module, root: ShardedRoot) -> nn.Module:
        """The user's children back on the CPU, their own objects, whole. Where every rank of the node reached its
        teardown (:class:`~dalle_lightning_plugins.strategies.roll_call.RollCall`: an error every rank raised, Ctrl-C)
        they gather the trained values, as after a stage that ends. Otherwise there is no collective (a peer is
        gone, or blocked in one of the step's): where the stage released a tensor's storage, it holds this rank's
        trained shard and NaN elsewhere, said in one line, with the way back (a checkpoint)."""
        if self.roll_call.all_here():  # every rank of the node is here: the collective can run
            try:
                return self._gathered(module, root)
            except (RuntimeError, dist.DistError) as error:  # a communicator the error broke: each rank alone then
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                rank_zero_warn(f"{self.owner}: gathering the shards after the error failed ({first})")
        partial = plain_weights.restore_after_error(root, torch.device("cpu"))
        carry(module, SHARDED_ROOT_ATTR, None)
        module.cpu()
        rank_zero_warn(
            f"{self.owner}: the stage ended without finishing, so the ranks did not gather the shards; "
            + (f"{type(module).__name__}'s sharded parameters hold this rank's trained shard and NaN elsewhere: "
               "resume from a checkpoint (trainer.fit(model, ckpt_path=...))" if partial else
               f"{type(module).__name__}'s children hold the weights from before the stage"))
        return module

    def whole_stage(self, module: nn.Module, stage: str, root_device: torch.device, num_processes: int) -> bool:
        """Collective: whether a validate, test or predict stage runs on the whole module, as ``ddp`` does (a step
        may read ``self.layer.weight`` outside its block's forward): when whole weights are wanted after a stage.
        Otherwise one line names the option."""
        if self.want(module, root_device, num_processes):
            return True
        rank_zero_info(
            f"{self.owner}(full_weights_after={self.full_weights_after!r}): {stage} runs on this rank's "
            "shards, where a step reading a parameter outside its block's forward (self.layer.weight.item()) sees "
            f"a shard, empty on some ranks; full_weights_after=True runs {stage} on whole weights, as ddp")
        return False

    def want(self, module: nn.Module, root_device: torch.device, num_processes: int) -> bool:
        """Whether whole weights are wanted after a stage; ``"auto"`` decides once, the same on every rank."""
        if self.full_weights_after is not True and self.full_weights_after is not False:  # "auto", decided once
            if self.decision is None:
                need = plain_weights.whole_bytes(module)
                free = free_bytes_per_rank(root_device, num_processes)
                fits = torch.tensor([float(need <= FULL_WEIGHTS_MEMORY_SHARE * free)], device=root_device)
                dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every rank the same decision: it is a collective
                self.decision = bool(fits.item())
                mib = 2**20
                counted = "the host's share, or the GPU's if smaller" if root_device.type == "cuda" else "the host's"
                rank_zero_info(  # one line per strategy
                    f"{self.owner}(full_weights_after='auto'): the whole model takes {need / mib:.2f} MiB against "
                    f"{free / mib:.0f} MiB free per rank on rank 0 ({counted}), so validate, test and predict run on "
                    "whole weights and after each stage its parameters "
                    + ("are whole plain tensors, as under ddp" if self.decision else
                       "stay sharded DTensors (full_weights_after=True forces whole ones)"))
            return self.decision
        return bool(self.full_weights_after)


def host_bytes_per_rank(num_processes: int) -> float:
    """The host's available memory over the processes of this node (``/proc/meminfo``'s ``MemAvailable``)."""
    available = 0.0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = float(line.split()[1]) * 1024
    except OSError:
        available = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return available / max(1, num_processes)


def free_bytes_per_rank(root_device: torch.device, num_processes: int) -> float:
    """Memory free to this rank for a whole copy of the model. Whole weights land on the CPU after a stage (as
    ``ddp`` leaves a module), one copy per process of the node, so the host's share always counts; on a GPU the
    device's free memory counts too (validate, test and predict run on whole weights there): the smaller of the two.
    A GPU's free memory alone passed a model the host could not hold once per rank."""
    host = host_bytes_per_rank(num_processes)
    if root_device.type == "cuda":
        return min(host, float(torch.cuda.mem_get_info(root_device)[0]))
    return host


# Lightning callbacks that change parameters in ways FSDP2's shards cannot follow (with their reason and the way out).
_WHOLE_COPY_CALLBACKS = {
    "StochasticWeightAveraging": "it copies the model's parameters into a whole copy it made before sharding "
    "(Lightning refuses it under its own FSDP strategy too); use an EMA callback that handles shards "
    "(dalle_lightning_callbacks.ema.EMA)",
    "ModelPruning": "it re-registers each pruned weight as weight_orig times a mask, which FSDP2's shards cannot follow",
}


def refuse_whole_copy_callbacks(trainer: pl.Trainer, shard_size: int) -> None:
    """One line before anything is sharded, instead of a DTensor traceback an epoch later."""
    if shard_size <= 1:
        return  # devices_per_node=1: parameters stay whole, as under ddp
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        # by class name along the MRO: a subclass of Lightning's callback (as tests and users write) is refused too
        name = next((c.__name__ for c in type(callback).__mro__ if c.__name__ in _WHOLE_COPY_CALLBACKS), None)
        if name is not None:
            raise ValueError(
                f"ShardedPowerSGDStrategy(devices_per_node={shard_size}) cannot run {name}: "
                f"{_WHOLE_COPY_CALLBACKS[name]}; or pass devices_per_node=1 (parameters whole, PowerSGD between all "
                "devices)")
