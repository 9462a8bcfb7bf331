"""Lightning's collectives on sharded values: ``reduce``, ``all_gather`` and ``broadcast`` take DTensors.

Under FSDP2 a parameter and its gradient are DTensors sharded over the node's devices (the ``"shard"`` axis of
the mesh, :mod:`dalle_lightning_plugins.mesh`), and so is whatever a LightningModule computes from them:
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
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
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
