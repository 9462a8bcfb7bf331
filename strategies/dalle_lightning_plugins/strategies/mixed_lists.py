"""The optimizer's side of a sharded stage with whole parameters beside the shards: ``foreach`` calls on both.

A parameter the LightningModule registers itself (not in a child) stays a plain tensor on every rank, beside the
children's DTensor shards. ``torch.nn.utils.clip_grad_norm_`` (Lightning's ``gradient_clip_val``) hands all
gradients to one ``torch._foreach_norm``, which DTensor refuses ("got mixed torch.Tensor and DTensor"). During the
optimizer step (:class:`MixedLists`, around Lightning's step, after the closure: no compiled region runs there) a ``foreach`` call given both kinds
sees each plain tensor as a replicated DTensor on the shards' mesh: a view of the same storage, so a write in place
(``_foreach_mul_`` by the clip coefficient) writes the user's tensor, and the total norm counts every parameter
once, as ``ddp``'s does. Calls with one kind are left alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode


class MixedLists(TorchFunctionMode):
    """Plain tensors as replicated DTensors in ``foreach`` calls that mix them with DTensors (see the module)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo traces an active mode: nothing added to a compiled region's graph
            return func(*args, **kwargs)
        if getattr(func, "__name__", "").startswith("_foreach_"):
            args = tuple(_as_dtensors(a) for a in args)
            kwargs = {k: _as_dtensors(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _as_dtensors(value: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        return value
    mesh = next((t.device_mesh for t in value if isinstance(t, DTensor)), None)
    if mesh is None or all(isinstance(t, DTensor) or not isinstance(t, torch.Tensor) for t in value):
        return value
    return type(value)(
        DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
        for t in value
    )
