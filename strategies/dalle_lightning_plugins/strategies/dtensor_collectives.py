"""Lightning's collectives on sharded values: ``reduce``, ``all_gather`` and ``broadcast`` take DTensors.

Under FSDP2 a parameter and its gradient are DTensors sharded over the node's devices (the ``"shard"`` axis of
the mesh, :mod:`dalle_lightning_plugins.strategies.mesh`), and so is whatever a LightningModule computes from them:
``p.grad.sum()`` is a DTensor with a ``Partial`` placement, each rank holding the sum of its own shard.
``self.log(p.grad.sum(), sync_dist=True)`` reaches ``strategy.reduce`` (Lightning's ``LightningModule.log`` hands
``trainer.strategy.reduce`` to the result collection as its sync function, called on the step's value and on the
epoch's accumulated value), and Lightning's ``_sync_ddp`` ran ``all_reduce`` on the DTensor itself, which
DTensor has no rule for (``c10d.allreduce_.default does not have a sharding strategy registered``).

:class:`DTensorCollectives` (a part the strategy holds) gives ``ddp``'s answer for the same full tensor: a DTensor first becomes its full
value on this rank (``full_tensor()``, a collective over the DTensor's own mesh, the node's devices: every rank of
the node takes part, as every rank takes part in the collective that follows), then the usual collective runs over
the whole world (or the ``group`` given), so a mean is the mean over every rank of the full-tensor value, nodes
included. Plain tensors and other objects pass through unchanged.

A LightningModule may also call ``torch.distributed`` itself on a gradient, as Lightning's own manual-optimization
tests do (``torch.distributed.all_reduce(self.layer.weight.grad.data)``). DTensor has no rule for ``all_reduce`` and
``broadcast`` (torch raises ``does not have a sharding strategy registered``); :class:`RawCollectives` gives it one
for the strategy's own DTensors, for one stage: installed in DTensor's table of op handlers at the stage's
``setup_environment``, removed at its teardown (whatever was there before is put back), and acting only on DTensors
whose mesh is the strategy's. The collective runs on the full value and each rank keeps its part of the result, so
the in-place result is what ``ddp`` gives. Any other DTensor (a user's own tensor parallelism, another strategy's)
meets DTensor's own behaviour, during the stage and after it. Two cases are refused in one line rather than done
another way than asked: ``async_op=True`` (the full value is gathered and copied back, which cannot be deferred to
the caller's ``wait()``), and a ``Partial`` DTensor (a reduction still pending: its value is split over the ranks as
no plain tensor is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from dalle_lightning_plugins import compat


def full_value(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor or a collection) replaced by its full tensor on this rank.

    Collective over each DTensor's mesh when it holds a DTensor; a plain tensor or object is returned as is.
    """
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value
    return apply_to_collection(value, DTensor, DTensor.full_tensor)


class DTensorCollectives:
    """A strategy's part for Lightning's collectives on sharded values (see the module): the values its ``reduce``,
    ``all_gather`` and ``broadcast`` hand to Lightning's own, and the raw ``torch.distributed`` rule of each stage.
    Stateless between stages: a stage's rule is installed at its ``setup_environment`` and removed at its
    teardown, whichever way it ends."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the strategy's class name, for the one-line refusals

    @staticmethod
    def to_reduce(tensor: Any) -> Any:
        """What ``reduce`` hands on: a DTensor's full value; anything else as it is (Lightning returns a non-tensor
        unreduced)."""
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    @staticmethod
    def to_send(value: Any) -> Any:
        """What ``all_gather`` and ``broadcast`` hand on: every DTensor in ``value`` as its full value (every rank
        converts, though a broadcast sends only ``src``'s)."""
        return full_value(value)

    def raw_collectives_for_stage(self, mesh: DeviceMesh) -> Callable[[], None]:
        """``torch.distributed.all_reduce``/``broadcast`` on the DTensors of ``mesh`` (the strategy's), until this
        stage's teardown runs the returned undo (:class:`RawCollectives`)."""
        raw = RawCollectives(mesh, self.owner)
        raw.install()
        return raw.uninstall


def _local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor laid out as ``like`` (no ``Partial`` placement) whose full value is
    ``full`` (no collective: every rank holds ``full``)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


ASYNC_ARGUMENT = ("async_op", "asyncOp")  # the c10d ops' flag, by the names torch releases give it


class RawCollectives:
    """``torch.distributed.all_reduce``/``broadcast`` on the DTensors of one mesh (a strategy's), for one stage."""

    def __init__(self, mesh: DeviceMesh, owner: str) -> None:
        self.owner = owner  # the strategy's name, for the one-line refusals
        # The mesh and its named sub-meshes, compared as DTensor compares meshes (ranks, shape, dimension names; not
        # process groups): DTensor's caches hand a result the equal mesh of an earlier stage, and a user's own mesh
        # differs in its dimension names ("replicate", "shard") or its ranks.
        self.meshes = [mesh, *(mesh[name] for name in mesh.mesh_dim_names or ())]
        self.previous: dict[Any, Any] = {}  # op -> the handler it had before install (None: none)

    @staticmethod
    def ops() -> tuple[Any, ...]:
        return torch.ops.c10d.allreduce_.default, torch.ops.c10d.broadcast_.default

    def install(self) -> None:
        handlers = compat.dtensor_op_handlers()
        for op in self.ops():
            self.previous[op] = handlers.get(op)
            handlers[op] = self.handle

    def uninstall(self) -> None:
        """DTensor's table as it was before :meth:`install` (an entry someone set over this one meanwhile stays)."""
        handlers = compat.dtensor_op_handlers()
        for op, before in self.previous.items():
            if handlers.get(op) == self.handle:
                if before is None:
                    del handlers[op]
                else:
                    handlers[op] = before
        self.previous.clear()

    def owns(self, value: DTensor) -> bool:
        return value.device_mesh in self.meshes

    def handle(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dtensors = [t for t in args[0] if isinstance(t, DTensor)]
        if not dtensors or not all(self.owns(t) for t in dtensors):
            return self._as_without(op, args, kwargs)
        name = "all_reduce" if op is self.ops()[0] else "broadcast"
        if compat.op_argument(op, args, kwargs, ASYNC_ARGUMENT):
            raise RuntimeError(
                f"torch.distributed.{name}(..., async_op=True) on a DTensor {self.owner} sharded: it runs on the "
                f"full value and cannot return before it is copied back; pass async_op=False, or use "
                f"strategy.reduce / self.all_gather, or value.full_tensor()")
        if any(p.is_partial() for t in dtensors for p in t.placements):
            raise RuntimeError(
                f"torch.distributed.{name} on a DTensor with a Partial placement ({self.owner}'s shards, a "
                f"reduction still pending, e.g. p.grad.sum()): call value.full_tensor() first, or strategy.reduce")
        return _on_full_values(op, args, kwargs)

    def _as_without(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What DTensor does without this rule: the handler there was before, or DTensor's own dispatch again."""
        before = self.previous.get(op)
        if before is not None:
            return before(op, args, kwargs)
        handlers = compat.dtensor_op_handlers()
        mine = handlers.pop(op)
        try:
            return op(*args, **kwargs)
        finally:
            handlers[op] = mine


def _on_full_values(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``c10d.allreduce_``/``c10d.broadcast_`` on DTensors: the op on their full values, each keeping its part."""
    tensors = list(args[0])
    fulls = [t.full_tensor().contiguous() if isinstance(t, DTensor) else t for t in tensors]
    _, work = op_call(fulls, *args[1:], **kwargs)
    work.wait()  # synchronous calls only (async_op=True is refused): the parts are copied out now
    with torch.no_grad():
        for t, full in zip(tensors, fulls):
            if isinstance(t, DTensor):
                t.to_local().copy_(_local_part(full, t))
    return tensors, work
