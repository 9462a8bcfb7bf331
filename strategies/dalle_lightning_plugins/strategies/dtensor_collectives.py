"""Lightning's collectives on sharded values: ``reduce``, ``all_gather`` and ``broadcast`` take DTensors.

Under FSDP2 a parameter and its gradient are DTensors sharded over the node's devices (the ``"shard"`` axis of
the mesh, :mod:`dalle_lightning_plugins.strategies.mesh`), and so is whatever a LightningModule computes from them:
``p.grad.sum()`` is a DTensor with a ``Partial`` placement, each rank holding the sum of its own shard.
``self.log(p.grad.sum(), sync_dist=True)`` reaches ``strategy.reduce`` (Lightning's ``LightningModule.log`` hands
``trainer.strategy.reduce`` to the result collection as its sync function, called on the step's value and on the
epoch's accumulated value), and Lightning's ``_sync_ddp`` ran ``all_reduce`` on the DTensor itself, which
DTensor has no rule for (``c10d.allreduce_.default does not have a sharding strategy registered``).

:class:`DTensorCollectives` gives ``ddp``'s answer for the same full tensor: a DTensor first becomes its full
value on this rank (``full_tensor()``, a collective over the DTensor's own mesh, the node's devices: every rank of
the node takes part, as every rank takes part in the collective that follows), then the usual collective runs over
the whole world (or the ``group`` given), so a mean is the mean over every rank of the full-tensor value, nodes
included. Plain tensors and other objects pass through unchanged.

A LightningModule may also call ``torch.distributed`` itself on a gradient, as Lightning's own manual-optimization
tests do (``torch.distributed.all_reduce(self.layer.weight.grad.data)``); :func:`enable_raw_collectives` gives
DTensor the rule it lacks for ``all_reduce`` and ``broadcast``, with the same meaning: the collective runs on the
full value and each rank keeps its part of the result, so the in-place result is what ``ddp`` gives.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from typing_extensions import override


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
    """Mixin placed before ``ModelParallelStrategy`` in a strategy's bases (see the module docstring)."""

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, DTensor):  # anything else as the parent has it (a non-tensor comes back unreduced)
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    @override
    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        return super().all_gather(full_value(tensor), group=group, sync_grads=sync_grads)  # type: ignore[misc]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # Every rank converts (the full tensor is a collective), though only ``src``'s value is sent.
        return super().broadcast(full_value(obj), src=src)  # type: ignore[misc]



def _local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor laid out as ``like`` whose full value is ``full`` (no collective:
    every rank holds ``full``). A ``Partial`` dimension keeps the value on its first coordinate, zeros elsewhere,
    so that the pending reduction gives ``full`` back."""
    mesh, placements = like.device_mesh, list(like.placements)
    keep = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(placements) if isinstance(p, Partial))
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = distribute_tensor(full, mesh, plain, src_data_rank=None).to_local()
    return local if keep else torch.zeros_like(local)


def _on_full_values(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``c10d.allreduce_``/``c10d.broadcast_`` on DTensors: the op on their full values, each keeping its part."""
    tensors = list(args[0])
    fulls = [t.full_tensor().contiguous() if isinstance(t, DTensor) else t for t in tensors]
    _, work = op_call(fulls, *args[1:], **kwargs)
    work.wait()  # the parts are copied out now, so the caller's wait() (if async) finds them done
    with torch.no_grad():
        for t, full in zip(tensors, fulls):
            if isinstance(t, DTensor):
                t._local_tensor.copy_(_local_part(full, t))
    return tensors, work


def enable_raw_collectives() -> None:
    """Let ``torch.distributed.all_reduce`` and ``broadcast`` take DTensors (see the module docstring).

    Process-wide and idempotent: the rule is DTensor's custom-op table, which has no entry for these ops (they
    raise ``does not have a sharding strategy registered`` without it)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (torch.ops.c10d.allreduce_.default, torch.ops.c10d.broadcast_.default):
        handlers.setdefault(op, _on_full_values)
