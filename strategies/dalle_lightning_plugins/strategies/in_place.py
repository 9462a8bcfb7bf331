"""In-place sharding of the LightningModule's children for a sharded stage, and the way back to the user's plain module.

FSDP2 shards the user's own children (``fully_shard`` on each block, then on the root that registers them, as
Lightning's ``ModelParallelStrategy`` does): it changes each unit's class, registers hooks on it, marks the modules it
manages and replaces every managed parameter with a new DTensor parameter. :class:`InPlace` records before that each
managed parameter's own object (where it is registered, its shape and memory format) and each module's class; once a
unit is sharded the user's objects give their storage back (``param.data`` an empty tensor of the same dtype and
device: the object and its ``requires_grad`` stay), so no whole copy stays. At the stage's end :meth:`InPlace.to_plain`
gathers each parameter whole (a collective, one tensor at a time), puts it into the user's own object, sets that back
on its modules and undoes ``fully_shard`` (:func:`~dalle_lightning_plugins.compat.undo_fully_shard`); after an error
:meth:`InPlace.restore_locally` does the same without a collective (this rank's shard, NaN elsewhere).

Refused in one line, before anything is sharded: a parameter the LightningModule registers itself and a child holds
too (FSDP2 would shard one and leave the other), a gradient hook on a child's parameter (FSDP2 trains its own
parameter objects), an embedding with ``sparse=True``. Parameter groups built before the stage from the children's
parameters are handed FSDP2's (:func:`remap_optimizers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dalle_lightning_plugins import compat


def _named_tensors(module: nn.Module, remove_duplicate: bool = True) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=remove_duplicate),
            *module.named_buffers(remove_duplicate=remove_duplicate)]


def children_with_tensors(module: nn.Module) -> dict[str, nn.Module]:
    """The LightningModule's children holding parameters or buffers (those a sharded stage registers on its root)."""
    return {name: child for name, child in module.named_children()
            if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None}


def refuse_owner_ties(module: nn.Module, originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything trains: a tensor the LightningModule registers itself and a child holds too would
    be two tensors in a sharded stage (the child's sharded by FSDP2, the module's own whole)."""
    held: dict[int, str] = {}
    for name, child in originals.items():
        for sub, t in _named_tensors(child, remove_duplicate=False):
            held.setdefault(id(t), f"{name}.{sub}")
    for own, tensor in _named_tensors(module, remove_duplicate=False):
        if "." not in own and id(tensor) in held:
            raise ValueError(
                f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {type(module).__name__}.{own} is "
                f"{held[id(tensor)]} (one tensor registered on the LightningModule and in a child), which FSDP2 "
                f"would shard in the child and leave whole on the module; reach it through the child "
                f"(self.{held[id(tensor)]}) or a property, or use devices_per_node=1")


def refuse_parameter_hooks(originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything trains: a gradient hook on a child's parameter (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``), which ``ddp`` runs on every backward, would never run in a sharded
    stage, without a word: FSDP2 trains parameter objects of its own, reduce-scatters their gradients and sets them without
    autograd's hooks. The LightningModule's own parameters stay whole and keep theirs."""
    for child_name, child in originals.items():
        for name, p in child.named_parameters():
            if compat.tensor_hook_count(p):
                raise ValueError(
                    f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {child_name}.{name} has a gradient hook "
                    "(Tensor.register_hook or register_post_accumulate_grad_hook), which a sharded stage never runs: "
                    "FSDP2 trains parameters of its own in their place; use a module hook (register_full_backward_hook) "
                    "or the optimizer, or devices_per_node=1")


def refuse_sparse_gradients(originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything is sharded: an embedding with ``sparse=True`` makes a sparse gradient, which FSDP2
    cannot reduce-scatter (``ddp`` all-reduces it as it is)."""
    for child_name, child in originals.items():
        for sub, m in child.named_modules():
            if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                raise ValueError(
                    f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {f'{child_name}.{sub}'.rstrip('.')} is "
                    f"an {type(m).__name__} with sparse=True, whose sparse gradient FSDP2 cannot shard; use "
                    "sparse=False (the optimizer then gets a dense gradient) or strategy='ddp'")


def local_slice(whole: torch.Tensor, value: DTensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``value`` (a DTensor of the same global shape) holds it: a view for FSDP2's
    ``Shard(dim)`` on a 1-D mesh, else DTensor's own local split (no collective either way)."""
    mesh = value.device_mesh
    if mesh.ndim == 1 and len(value.placements) == 1 and isinstance(value.placements[0], Shard):
        dim = value.placements[0].dim
        chunks = torch.chunk(whole, mesh.size(), dim=dim)
        rank = mesh.get_local_rank()
        part = chunks[rank] if rank < len(chunks) else whole.narrow(dim, 0, 0)
        if part.shape == value.to_local().shape:
            return part
    return distribute_tensor(whole.detach().to(value.device), mesh, value.placements, src_data_rank=None).to_local()


def assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` (the user's tensor object, kept) holds ``value`` from now on. A meta tensor cannot take another
    device's storage through ``.data``; ``torch.utils.swap_tensors`` gives it one and keeps the object."""
    if not target.is_meta:
        target.data = value
        return
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
        value.__dict__.update(target.__dict__)
    torch.utils.swap_tensors(target, value)


def _channels_last(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)


@dataclass
class Kept:
    """A user's parameter object that FSDP2 replaced on its module(s) (``owners``, several for a tie)."""

    tensor: nn.Parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    channels_last: bool = False
    released: bool = False  # its storage went back (the stage holds its values in shards)
    sharded: Any = None  # FSDP2's parameter while the module is plain (:meth:`InPlace.from_plain` sets it back)
    source: torch.Tensor | None = None  # its values from before ``fully_shard``, until the stage is built

    def current(self) -> torch.Tensor:
        """The parameter registered in its place now (FSDP2's, sharded or gathered; the user's own when plain)."""
        module, name = self.owners[0]
        return getattr(module, name)

    def give(self, value: torch.Tensor) -> None:
        """The user's object holds ``value`` from now on, in the memory format it had (:func:`assign`)."""
        assign(self.tensor, value.contiguous(memory_format=torch.channels_last) if self.channels_last else value)


class InPlace:
    """The user's own parameter objects and module classes of a sharded stage's children (see the module), recorded
    before ``fully_shard``; ``plain``: the module holds them again (:meth:`to_plain`)."""

    def __init__(self, children: dict[str, nn.Module]) -> None:
        self.children = children  # the LightningModule's children the stage's root registers
        self.kept: dict[int, Kept] = {}
        self.classes: dict[int, tuple[nn.Module, type]] = {}
        for child in children.values():
            for m in child.modules():
                self.classes.setdefault(id(m), (m, type(m)))
                for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
                    kept = self.kept.setdefault(id(p), Kept(p, channels_last=_channels_last(p)))
                    if (m, name) not in kept.owners:
                        kept.owners.append((m, name))
        self.redo: list[Callable[[], None]] = []
        self.handles: list[Any] = []  # hooks the stage put on the user's modules (removed with fully_shard's)
        self.plain = False

    def ignore(self, params: set[nn.Parameter]) -> None:
        """Parameters FSDP2 leaves alone (scalars, the LightningModule's own): nothing to give back."""
        for p in params:
            self.kept.pop(id(p), None)

    def hold(self, ids: list[int]) -> None:
        """Before ``fully_shard`` (which may move them to the device): the user's values (by id), for a failure while
        the stage is built (:meth:`restore_locally` gives them back exactly) until :meth:`built`."""
        for i in ids:
            kept = self.kept.get(i)
            if kept is not None and kept.source is None and not kept.tensor.is_meta:
                kept.source = kept.tensor.data

    def built(self) -> None:
        """The stage is built: the values held for a failure go (the shards hold them now)."""
        for kept in self.kept.values():
            kept.source = None

    @torch.no_grad()
    def release(self, ids: list[int]) -> None:
        """The user's objects (by id) FSDP2 replaced give their storage back (meta ones stay meta: the shards hold
        their values from now on either way); FSDP2's parameters take the user's marks (``p.no_decay = True``)."""
        for i in ids:
            kept = self.kept.get(i)
            if kept is None or kept.released or kept.current() is kept.tensor:
                continue
            for mark, value in vars(kept.tensor).items():
                vars(kept.current()).setdefault(mark, value)
            if not kept.tensor.is_meta:
                kept.tensor.data = torch.empty(0, dtype=kept.tensor.dtype, device=kept.tensor.device)
            kept.released = True

    def released_reads(self) -> dict[int, Callable[[], torch.Tensor]]:
        """For each released user parameter (a list made before the stage may hold it): FSDP2's in its place."""
        return {i: kept.current for i, kept in self.kept.items() if kept.released}

    def _put_back(self, kept: Kept, value: torch.Tensor) -> None:
        kept.tensor.requires_grad_(value.requires_grad)  # as the stage left it (BackboneFinetuning)
        if value is not kept.tensor:  # put back already (a to_plain that failed half-way): FSDP2's stays recorded
            kept.sharded = value
        for module, name in kept.owners:
            module._parameters[name] = kept.tensor

    def _undo(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.redo = [compat.undo_fully_shard(m, cls) for m, cls in self.classes.values()]
        self.plain = True

    @torch.no_grad()
    def to_plain(self, device: torch.device | None) -> None:
        """Collective over the shard axis: each user parameter whole again, in its own object (on ``device``, else
        where it was), one at a time (the peak is one gathered tensor), set back on its modules; ``fully_shard``
        undone. A parameter the precision plugin gave another dtype keeps it, as ``ddp`` leaves it."""
        for kept in self.kept.values():
            value = kept.current()
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            target = kept.tensor
            if not kept.released and not target.is_meta and target.dtype == whole.dtype and target.shape == whole.shape:
                target.copy_(whole)
            else:
                where = device if device is not None else (target.device if not target.is_meta else torch.device("cpu"))
                kept.give(whole.detach().to(where, copy=whole is value))
                kept.released = False
            self._put_back(kept, value)
        self._undo()

    @torch.no_grad()
    def from_plain(self) -> None:
        """Undo :meth:`to_plain` (no collective): FSDP2's units and parameters back, each rank taking its shard of what
        the user's parameters hold now (an update or ``load_state_dict`` after the stage). The user's objects keep
        their storage until the next :meth:`to_plain`, which copies into them."""
        for redo in self.redo:
            redo()
        self.redo, self.plain = [], False
        for kept in self.kept.values():
            value = kept.sharded
            for module, name in kept.owners:
                module._parameters[name] = value
            source = kept.tensor.detach().to(value.device, value.dtype)
            if isinstance(value, DTensor):
                source = distribute_tensor(source, value.device_mesh, value.placements, src_data_rank=None)
            value.copy_(source)

    @torch.no_grad()
    def restore_locally(self, device: torch.device) -> bool:
        """No collective (after an error a peer may be gone): each user parameter back in its modules, whole, on
        ``device``: a released one holds this rank's trained shard in its slice and NaN elsewhere (one held while the
        stage was built, its values from before it); ``fully_shard`` undone. Returns whether any came from a shard."""
        any_released = False
        for kept in self.kept.values():
            value = kept.current()
            if kept.source is not None:  # the stage failed while it was built: the values from before it, exactly
                kept.give(kept.source.to(device))
                kept.source, kept.released = None, False
            elif kept.released:
                any_released = True
                if isinstance(value, DTensor):
                    dtype = value.dtype
                    whole = torch.full(value.shape, float("nan") if dtype.is_floating_point else 0, dtype=dtype,
                                       device=device)
                    local_slice(whole, value).copy_(value.to_local())
                else:
                    whole = value.detach().to(device, copy=True)
                kept.give(whole)
                kept.released = False
            self._put_back(kept, value)
        self._undo()
        return any_released


def remap_optimizers(optimizers: list[Any], root: nn.Module | None) -> None:
    """Parameter groups built before the stage from the user's children (in ``__init__`` or ``setup``) take FSDP2's
    parameters in their place, by identity, so they train as under ``ddp``. A no-op without a sharded stage (one
    device per node, a stage on whole weights) or on a plain module."""
    in_place = getattr(root, "originals", None)
    if in_place is None or in_place.plain:
        return
    current = {i: kept.current() for i, kept in in_place.kept.items()}
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer
        for group in optimizer.param_groups:
            group["params"] = [current.get(id(p), p) for p in group["params"]]
