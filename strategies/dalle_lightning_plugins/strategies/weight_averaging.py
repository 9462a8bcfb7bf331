"""Lightning's own weight averaging (``WeightAveraging``, ``EMAWeightAveraging``) on a sharded module: the averaged
copy is sharded as the module is, for the stage.

Lightning's callback deep-copies the LightningModule in its ``setup``, before the strategy shards it, and each update
then reads every parameter of the module into its copy: a whole tensor against a DTensor shard, which DTensor
refuses. Here, once the stage's module is sharded, the copy's parameters become DTensors of the same layout (each
rank slices its own part of the whole value it holds: no communication), so every update, swap and copy the
callback makes is elementwise on shards: the arithmetic of ``ddp``, on 1/N of the values. Its state dict stays
whole (a checkpoint holds what ``ddp``'s holds), a whole state dict loads into it (a resumed fit), and when the
module is whole again after the stage the copy is too (:func:`whole_averages`). The hooks this needs are on the
callback's copy and on the root's children for the stage only, and come off with it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies.sharded_root import reshard_all

if TYPE_CHECKING:
    import lightning.pytorch as pl

# Averaged copies sharded by shard_averages: copy -> (its hooks' handles, each parameter's device before).
_SHARDED: weakref.WeakKeyDictionary[nn.Module, tuple[list[RemovableHandle], dict[str, torch.device]]] = (
    weakref.WeakKeyDictionary())


def _averaged_copies(trainer: pl.Trainer) -> list[nn.Module]:
    copies = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        averaged = compat.averaged_model(callback)
        if averaged is not None:
            copies.append(averaged.module)
    return copies


def _replace_parameters(module: nn.Module, make: Any) -> dict[str, torch.device]:
    """Register ``make(name, p)`` (None: keep ``p``) in place of each parameter; ties stay ties. Returns the
    replaced parameters' devices."""
    made: dict[int, nn.Parameter] = {}
    devices = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        new = made.get(id(p))
        if new is None:
            value = make(name, p)
            if value is None:
                continue
            new = made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
        devices[name] = p.device
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner).register_parameter(leaf, new)
    return devices


@torch.no_grad()
def shard_averages(trainer: pl.Trainer, module: nn.Module) -> Callable[[], None] | None:
    """Every averaged copy of a Lightning ``WeightAveraging`` callback sharded as ``module``'s parameters are.
    Returns the undo for the stage's end, whichever way it ends (:func:`end_averages`), or None where there is no
    copy; a failure on the way runs it at once."""
    copies = _averaged_copies(trainer)
    if not copies:
        return None
    undo = functools.partial(end_averages, trainer)
    try:
        _shard_copies(copies, dict(module.named_parameters(remove_duplicate=False)))
    except BaseException:
        undo()
        raise
    return undo


def _shard_copies(copies: list[Any], live: dict[str, nn.Parameter]) -> None:
    for averaged in copies:
        if averaged in _SHARDED:
            continue

        def shard(name: str, p: nn.Parameter) -> torch.Tensor | None:
            target = live.get(name)
            if not isinstance(target, DTensor) or isinstance(p, DTensor):
                return None
            return distribute_tensor(p.detach().to(target.device), target.device_mesh, target.placements,
                                     src_data_rank=None)

        devices = _replace_parameters(averaged, shard)
        handles = [averaged.register_state_dict_post_hook(functools.partial(_whole_state, devices)),
                   averaged.register_load_state_dict_pre_hook(_sharded_load)]
        _SHARDED[averaged] = (handles, devices)


@torch.no_grad()
def whole_averages(trainer: pl.Trainer) -> None:
    """Collective: every averaged copy whole again, on the device it had, without the hooks (the stage's end)."""
    for averaged in _averaged_copies(trainer):
        handles, devices = _SHARDED.pop(averaged, ([], {}))
        for handle in handles:
            handle.remove()
        _replace_parameters(averaged, lambda name, p: p.full_tensor().to(devices.get(name, p.device))
                            if isinstance(p, DTensor) else None)


def end_averages(trainer: pl.Trainer) -> None:
    """The end of a stage that sharded the averaged copies, on every path: after a stage that ran to its end
    (``full_weights_after=False`` too) the copies are whole, as under ``ddp`` and as the callback made them
    (collective); after an error (a peer may be gone: no collective) they keep their shards. Either way their hooks
    come off and no entry of the stage is left here."""
    if trainer.state.status == TrainerStatus.RUNNING:
        whole_averages(trainer)
    for averaged in [a for a in _averaged_copies(trainer) if a in _SHARDED]:
        for handle in _SHARDED.pop(averaged)[0]:
            handle.remove()


def _whole_state(devices: dict[str, torch.device], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: Any) -> None:
    """State dict post-hook (collective): the whole values, as the copy holds them under ``ddp``."""
    for key in [k for k, v in state_dict.items() if k.startswith(prefix) and isinstance(v, DTensor)]:
        state_dict[key] = state_dict[key].full_tensor().to(devices.get(key[len(prefix):], state_dict[key].device))


def _sharded_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load state dict pre-hook: a whole value for a DTensor parameter becomes this rank's slice of it."""
    for name, p in module.named_parameters():
        value = state_dict.get(prefix + name)
        if isinstance(p, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value.detach().to(p.device), p.device_mesh, p.placements,
                                                          src_data_rank=None)


def load_whole_into_shards(root: nn.Module) -> None:
    """The LightningModule's ``load_state_dict`` takes whole values during a sharded stage, as under ``ddp`` (a
    resumed ``WeightAveraging`` reloads the module's own weights so): each child of ``root`` turns them
    into its shards first."""
    handles = [part.register_load_state_dict_pre_hook(functools.partial(_resharded_load, root)) for part in root.children()]
    if getattr(root, "originals", None) is not None:  # the user's children: the hooks go at the stage's end
        root.originals.handles.extend(handles)


def _resharded_load(root: nn.Module, module: nn.Module, state_dict: dict[str, Any], prefix: str, *rest: Any) -> None:
    reshard_all(root)  # the registered parameters are the shards (a forward without backward leaves them gathered)
    _sharded_load(module, state_dict, prefix, *rest)
