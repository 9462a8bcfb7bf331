"""Whole plain weights after a stage, as ``ddp`` leaves a module (``full_weights_after``), and the callbacks whose whole
copies of the parameters FSDP2's shards cannot follow.

A mixin of :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy`: it reads the
strategy's ``lightning_module``, ``_root``, ``root_device``, ``num_processes`` and ``full_weights_after``.
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
from dalle_lightning_plugins.strategies import fsdp_wiring
from dalle_lightning_plugins.strategies.weight_averaging import whole_averages

if TYPE_CHECKING:
    import lightning.pytorch as pl

# full_weights_after="auto": whole weights after a stage when the whole model takes at most this share of the
# memory free to each rank (the device's; on CPU, the host's available memory divided among its processes).
FULL_WEIGHTS_MEMORY_SHARE = 0.5


class WholeWeightsAfterStage:
    """The strategy's end of a stage: whole plain weights where ``full_weights_after`` says so; and whether a
    validate, test or predict stage runs on whole weights from its start, as under ``ddp``."""

    def _leave_weights_whole(self) -> None:
        """The module after a stage, on the CPU as ``ddp`` leaves it: its own children back, holding the whole values
        (``full_weights_after``; a collective, at the end of a stage that ran to its end), or the sharded stand-ins
        kept (``full_weights_after=False``). After a stage that failed or was interrupted a peer may be gone: each
        rank puts its children back alone (:meth:`_restore_after_error`). Either way the strategy's hooks come off."""
        module, root = self.lightning_module, self._root
        if module is None:
            return
        trainer = compat.attached_trainer(module)
        ours = root is not None and root.owner is module
        if ours:
            root.remove_owner_hooks()
        ended = trainer is not None and trainer.state.status == TrainerStatus.RUNNING
        sharded = ours and isinstance(root, FSDPModule) and bool(root.originals) and not fsdp_wiring.is_plain(root)
        carried = ours and isinstance(root, FSDPModule) and not root.originals  # left sharded by full_weights_after
        if not ended:
            if sharded and self._whole_after_error(module):
                self._restore_after_error(module, root)
            elif sharded or carried:  # full_weights_after=False: the shards stay, as after a stage that ends
                fsdp_wiring.release_originals(root)
                fsdp_wiring.carry(module, fsdp_wiring.SHARDED_ROOT_ATTR, (root, self.device_mesh["shard"].size()))
            elif not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):  # (a failed setup)
                module.cpu()  # as ddp (Strategy.teardown), after an error too
                self.model = module
            return
        if not (sharded or carried):  # one device per node, or a stage run on the whole module
            module.cpu()  # as ddp (Strategy.teardown): a module whole on every rank ends on the CPU
            self.model = module
            return
        if not root.originals or not self._want_full_weights(module):
            fsdp_wiring.release_originals(root)
            fsdp_wiring.carry(module, fsdp_wiring.SHARDED_ROOT_ATTR, (root, self.device_mesh["shard"].size()))
            return
        whole_averages(trainer)
        fsdp_wiring.to_plain(root, torch.device("cpu"))
        fsdp_wiring.carry(module, fsdp_wiring.SHARDED_ROOT_ATTR, None)
        module.cpu()  # the module's own tensors (outside its children) too
        self.model = module  # as ddp unwraps its DistributedDataParallel: trainer.model is the plain module

    def _whole_after_error(self, module: nn.Module) -> bool:
        """``full_weights_after`` without a collective: ``"auto"`` not yet decided judges this rank's memory alone."""
        if self.full_weights_after is True or self.full_weights_after is False:
            return self.full_weights_after
        if self._full_weights_decision is not None:
            return self._full_weights_decision
        return fsdp_wiring.whole_bytes(module) <= FULL_WEIGHTS_MEMORY_SHARE * self._free_bytes_per_rank()

    def _restore_after_error(self, module: nn.Module, root: fsdp_wiring.ShardedRoot) -> None:
        """No collective: the user's children back on the CPU, their own objects, whole. Where the stage released a
        tensor's storage, it holds this rank's trained shard and NaN elsewhere (the other shards are on the other
        ranks, which an error may have taken): said in one line, with the way back (a checkpoint)."""
        partial = fsdp_wiring.restore_after_error(root, torch.device("cpu"))
        fsdp_wiring.carry(module, fsdp_wiring.SHARDED_ROOT_ATTR, None)
        module.cpu()
        self.model = module
        rank_zero_warn(
            f"{type(self).__name__}: the stage ended without finishing, so the ranks did not gather the shards; "
            + (f"{type(module).__name__}'s sharded parameters hold this rank's trained shard and NaN elsewhere: "
               "resume from a checkpoint (trainer.fit(model, ckpt_path=...))" if partial else
               f"{type(module).__name__}'s children hold the weights from before the stage"))

    def __getstate__(self) -> dict:
        """A pickled strategy (``torch.save(trainer)`` after ``fit``, as under ``ddp``) leaves out the last stage's
        sharded stand-ins: FSDP2 makes their classes per process, which pickle cannot name; the module holds the
        weights."""
        state = super().__getstate__()  # type: ignore[misc]
        state.update(_root=None, _blocks={}, _checkpointing=None)
        return state

    def _whole_stage(self, module: nn.Module, stage: str) -> bool:
        """Collective: whether a validate, test or predict stage runs on the whole module, as ``ddp`` does (a step
        may read ``self.layer.weight`` outside its block's forward): when whole weights are wanted after a stage.
        Otherwise one line names the option."""
        if self._want_full_weights(module):
            return True
        rank_zero_info(
            f"{type(self).__name__}(full_weights_after={self.full_weights_after!r}): {stage} runs on this rank's "
            "shards, where a step reading a parameter outside its block's forward (self.layer.weight.item()) sees "
            f"a shard, empty on some ranks; full_weights_after=True runs {stage} on whole weights, as ddp")
        return False

    def _want_full_weights(self, module: nn.Module) -> bool:
        if self.full_weights_after is not True and self.full_weights_after is not False:  # "auto", decided once
            if self._full_weights_decision is None:
                need = fsdp_wiring.whole_bytes(module)
                free = self._free_bytes_per_rank()
                fits = torch.tensor([float(need <= FULL_WEIGHTS_MEMORY_SHARE * free)], device=self.root_device)
                dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # every rank the same decision: it is a collective
                self._full_weights_decision = bool(fits.item())
                mib = 2**20
                rank_zero_info(  # one line per strategy
                    f"{type(self).__name__}(full_weights_after='auto'): the whole model takes {need / mib:.2f} MiB "
                    f"against {free / mib:.0f} MiB free per rank on rank 0, so validate, test and predict run on "
                    "whole weights and after each stage its parameters "
                    + ("are whole plain tensors, as under ddp" if self._full_weights_decision else
                       "stay sharded DTensors (full_weights_after=True forces whole ones)"))
            return self._full_weights_decision
        return bool(self.full_weights_after)

    def _free_bytes_per_rank(self) -> float:
        """Memory free to this rank: its CUDA device's, or the host's available memory over its processes."""
        if self.root_device.type == "cuda":
            return float(torch.cuda.mem_get_info(self.root_device)[0])
        available = 0.0
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = float(line.split()[1]) * 1024
        except OSError:
            available = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return available / max(1, self.num_processes)


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
