"""Lightning's one-file checkpoint for a sharded model: what ``ddp`` writes, so its loaders read it both ways.

A ``ddp`` checkpoint holds the whole ``state_dict`` and each optimizer's ``optimizer.state_dict()``, whose
parameters are numbered in the order of the optimizer's parameter groups. PyTorch's distributed state-dict API
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) speaks of the same state keyed by parameter name.
These helpers convert the one into the other for saving, and load the whole state into sharded parameters, so
``LightningModule.load_from_checkpoint`` reads what the sharding strategy writes and the strategy resumes from
what ``ddp`` wrote.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from dalle_lightning_plugins.io.rank_state import as_data, from_wire, to_wire


def optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state (``get_optimizer_state_dict``) -> ``optimizer.state_dict()``'s numbering."""
    if not state:
        return state  # ranks other than 0 hold nothing when the state was gathered to rank 0
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]],
    }


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load ``optimizer.state_dict()``-style state holding whole tensors into an optimizer of sharded parameters.

    Number i is the i-th parameter of ``optimizer``'s groups, in order, as ``torch.optim`` numbers them; every
    state tensor shaped like its parameter (momentum, Adam's moments) becomes this rank's shard of it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {
        i: {k: like(v, params[i]) if isinstance(v, torch.Tensor) and v.shape == params[i].shape else v
            for k, v in per_param.items()}
        for i, per_param in state["state"].items()
    }
    optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})


def like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` (a full tensor every rank holds) in ``param``'s layout: this rank's shard if ``param`` is one."""
    if isinstance(param, DTensor):
        return distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return whole.to(param.device, param.dtype)


def gather_to_rank0(value: Any, where: str = "state") -> list[Any] | None:
    """Collective: every rank's ``value`` (tensors and plain values: :func:`~dalle_lightning_plugins.io.rank_state.
    as_data`) in a list by global rank on rank 0 (None on the others). On the wire as plain values and raw tensor
    bytes (``to_wire``): ``gather_object`` pickles, and a pickled tensor goes through ``torch.save``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [as_data(value, where)]
    wired = gather_plain_to_rank0(to_wire(value, where))
    return None if wired is None else [from_wire(skeleton, raw) for skeleton, raw in wired]


def gather_plain_to_rank0(value: Any) -> list[Any] | None:
    """Collective: every rank's ``value`` (plain values only, no tensors) in a list by global rank on rank 0."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out
