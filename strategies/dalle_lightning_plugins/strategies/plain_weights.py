"""Whole plain weights after a sharded stage, as ``ddp`` leaves a module: the LightningModule's children hold the
user's own parameter objects again, gathered whole, with ``fully_shard`` undone (:func:`to_plain`, a gather over the
node; :func:`restore_after_error`, each rank alone), FSDP2's units and parameters go back in for a checkpoint saved
after ``fit`` (:func:`from_plain`), or the user's objects are dropped where the module stays sharded
(:func:`release_originals`). Which of these a stage's end takes is
:mod:`~dalle_lightning_plugins.strategies.whole_weights`' decision; the records are
:class:`~dalle_lightning_plugins.strategies.in_place.InPlace`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from dalle_lightning_plugins.strategies.sharded_root import ShardedRoot, reshard_all


def restore_after_error(root: ShardedRoot, device: torch.device) -> bool:
    """No collective (a stage that failed or was interrupted; a peer may be gone): the user's own parameter objects
    back, each rank alone (:meth:`~dalle_lightning_plugins.strategies.in_place.InPlace.restore_locally`). Returns
    whether released parameters came back from this rank's shards only. A no-op for a root without records."""
    if root.originals is None or root.originals.plain:
        return False
    reshard_all(root)
    return root.originals.restore_locally(device)


def whole_bytes(module: nn.Module) -> int:
    """Bytes of every parameter of ``module`` whole (what :func:`to_plain` puts on each rank): a DTensor counts
    its global size."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def is_plain(root: nn.Module) -> bool:
    """Whether ``root``'s LightningModule holds the user's own parameter objects again (:func:`to_plain`), not FSDP2's
    (:func:`from_plain` puts those back). False for a root without records (one device per node)."""
    originals = getattr(root, "originals", None)
    return originals is not None and originals.plain


@torch.no_grad()
def to_plain(root: ShardedRoot, device: torch.device | None = None) -> None:
    """Collective over the shard axis: the LightningModule's children hold the user's own parameter objects with the
    trained values whole, their classes and hooks as before the stage, as ``ddp`` leaves a module after ``fit``;
    :func:`from_plain` shards them again. FSDP2's parameters stay with ``root`` (the optimizer's)."""
    if getattr(root, "originals", None) is None or is_plain(root):
        return
    reshard_all(root)
    root.originals.to_plain(device)


@torch.no_grad()
def from_plain(root: ShardedRoot) -> None:
    """Undo :func:`to_plain` (no collective): FSDP2's units and parameters back in the user's modules, each rank
    taking its shard of what the user's parameters hold now, so what a user did to the plain module after a stage
    (an update, ``load_state_dict``) is in the shards (a checkpoint saved after ``fit``). A no-op when sharded."""
    if is_plain(root):
        root.originals.from_plain()


def release_originals(root: ShardedRoot) -> None:
    """The module stays sharded after the stage (``full_weights_after=False``): the user's own parameter objects are
    dropped, so that only the shards take memory; a later stage reuses the units."""
    object.__setattr__(root, "originals", None)
