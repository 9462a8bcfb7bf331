"""Whole plain weights after a sharded stage, as ``ddp`` leaves a module: the LightningModule gets its own children
back from the stand-ins (:func:`to_plain`, a gather over the node; :func:`restore_after_error`, each rank alone),
the stand-ins go back in for a checkpoint saved after ``fit`` (:func:`from_plain`), or the user's children are
dropped where the module stays sharded (:func:`release_originals`). Which of these a stage's end takes is
:mod:`~dalle_lightning_plugins.strategies.whole_weights`' decision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from dalle_lightning_plugins.strategies import stand_ins
from dalle_lightning_plugins.strategies.sharded_root import ShardedRoot, reshard_all


def _remove_guards(root: ShardedRoot) -> None:
    for handle in root.guards:
        handle.remove()
    root.guards.clear()


def restore_after_error(root: ShardedRoot, device: torch.device) -> bool:
    """No collective (a stage that failed or was interrupted; a peer may be gone): the LightningModule gets its own
    children back, each rank alone (:func:`~dalle_lightning_plugins.strategies.stand_ins.restore_locally`). Returns
    whether released tensors came back from this rank's shards only. A no-op for a root without stand-ins."""
    if not getattr(root, "originals", None):
        return False
    _remove_guards(root)
    if not is_plain(root):
        reshard_all(root)
        stand_ins.put_back(root.owner, root.originals)
    return stand_ins.restore_locally(root, root.released, device)


def whole_bytes(module: nn.Module) -> int:
    """Bytes of every parameter of ``module`` whole (what :func:`to_plain` puts on each rank): a DTensor counts
    its global size."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def is_plain(root: nn.Module) -> bool:
    """Whether ``root``'s LightningModule holds the user's own children again (:func:`to_plain`), not the sharded
    stand-ins (:func:`from_plain` puts those back). False for a root without stand-ins (one device per node)."""
    originals = getattr(root, "originals", None)
    return bool(originals) and all(getattr(root.owner, n) is child for n, child in originals.items())


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


@torch.no_grad()
def to_plain(root: ShardedRoot, device: torch.device | None = None) -> None:
    """Collective over the shard axis: the LightningModule gets its own children back, holding the trained values
    whole, as ``ddp`` leaves a module after ``fit``; :func:`from_plain` puts the sharded stand-ins back.

    Each stand-in tensor is gathered (``DTensor.full_tensor()``, one at a time: the peak is one parameter) into the
    user's tensor of the same name (:func:`~dalle_lightning_plugins.strategies.stand_ins.give_back`; one whose
    storage the stage released is allocated anew, on ``device`` if given), so the user's parameter objects, classes
    and hooks are those they had before the stage. The stand-ins stay with ``root`` (the optimizer's parameters).
    """
    if is_plain(root) or not getattr(root, "originals", None):
        return
    reshard_all(root)
    _remove_guards(root)
    stand_ins.put_back(root.owner, root.originals)
    stand_ins.give_back(root, root.released, device)


@torch.no_grad()
def from_plain(root: ShardedRoot) -> None:
    """Undo :func:`to_plain` (no collective): the sharded stand-ins back into the LightningModule, each rank taking
    its shard of what the user's tensors hold now, so what a user did to the plain module after a stage (an update,
    ``load_state_dict``) is in the shards (a checkpoint saved after ``fit``). A no-op when the stand-ins are in."""
    if not is_plain(root):
        return
    module = root.owner
    current = dict(_named_tensors(module))
    for name in root.originals:
        setattr(module, name, getattr(root, name))
    for name, value in _named_tensors(root):
        source = current[name].detach().to(value.device, value.dtype)
        if isinstance(value, DTensor):
            source = distribute_tensor(source, value.device_mesh, value.placements, src_data_rank=None)
        value.copy_(source)


def release_originals(root: ShardedRoot) -> None:
    """The module stays sharded after the stage (``full_weights_after=False``): the user's own children are dropped,
    so that only the shards take memory; a later stage reuses the stand-ins."""
    _remove_guards(root)
    root.released.clear()
    object.__setattr__(root, "originals", None)

