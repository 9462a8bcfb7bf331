"""What callbacks need to know about sharded models: how to see whole parameters, and which tensors to touch.

Two small protocols, so the callbacks work under any strategy:

- ``trainer.strategy.full_parameters()``: an optional context manager (``ShardedPowerSGDStrategy`` has one)
  inside which every parameter is whole on every rank. Callbacks that reach a model outside its ``forward``
  (sampling with a cache, reconstructions) enter it on every rank; strategies without it need nothing.
- FSDP2 (``torch.distributed.fsdp.fully_shard``) swaps a unit's registered parameters for unsharded copies
  between its forward and its reshard (the root unit keeps them after a forward without backward). Code that
  edits parameters in place (an EMA) first calls :func:`reshard`, so it edits the sharded originals.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

FULL_PARAMETERS_METHOD = "full_parameters"


def full_parameters(trainer: Any) -> AbstractContextManager[Any]:
    """The strategy's ``full_parameters()`` context, or a no-op for strategies whose parameters are whole."""
    method = getattr(getattr(trainer, "strategy", None), FULL_PARAMETERS_METHOD, None)
    return method() if callable(method) else nullcontext()


def reshard(trainer: Any, module: nn.Module) -> None:
    """Return every FSDP2 unit of the trained model (and ``module``) to its shards; no-op without FSDP2."""
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    roots = [wrapped] if isinstance(wrapped, nn.Module) else []
    if not any(module is m for root in roots for m in root.modules()):
        roots.append(module)  # the LightningModule is not inside the strategy's wrapper: walk it too
    for root in roots:
        for unit in root.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (in-place edits reach the DTensor), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
