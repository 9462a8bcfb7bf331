"""What the plugins need from torch that differs between the releases they support (2.9 to 2.14).

The plugins require ``torch>=2.9`` (``strategies/pyproject.toml`` says why that is the floor: the newest public
API they call, ``init_device_mesh(backend_override=)``). Where a torch API the strategy calls is newer than the
floor, or a private FSDP2 name moved between releases, the call goes through a function here: it uses torch's own
API where the installed release has it, and a fallback with the same effect where it does not. Each fallback is
tested on every release (``tests/test_compat.py`` forces it on the newest torch too, and compares both with
a reference computed by hand), and every private name a function here reaches is checked on every tested release
by ``tests/test_lightning_internals.py``. CI runs both files on the oldest supported torch (``make test-oldest``).

| need | torch's own API | fallback (older releases) |
| --- | --- | --- |
| parameters no rank used join FSDP2's reduce-scatter | ``FSDPModule.set_reduce_scatter_unused_params`` (2.13) | :func:`reduce_scatter_unused_params` |
| an FSDP2 unit's parameter groups | ``FSDPState._fsdp_param_groups`` (2.13, per-parameter meshes) | ``FSDPState._fsdp_param_group`` (one group) |
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "TORCH_VERSION",
    "HAS_REDUCE_SCATTER_UNUSED_PARAMS",
    "fsdp_param_groups",
    "reduce_scatter_unused_params",
    "torch_version",
]


def torch_version(version: str = torch.__version__) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"`` -> ``(2, 11)``), for messages and tests;
    the shims below test for the API itself, never for a version number."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = torch_version()

# 2.13 added it (FSDP2's counterpart of ddp's find_unused_parameters).
HAS_REDUCE_SCATTER_UNUSED_PARAMS: bool = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def fsdp_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one FSDP2 unit's state (``unit._get_fsdp_state()``).

    torch 2.13 lets one ``fully_shard`` call hold several groups (one per mesh) in ``_fsdp_param_groups``; 2.9
    to 2.12 hold at most one, in ``_fsdp_param_group`` (None for a unit that manages no parameter). 2.13 keeps
    the singular name as a property, valid only with one group, so the plural is asked first."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def reduce_scatter_unused_params(root: nn.Module, *, native: bool | None = None) -> None:
    """Every FSDP2 unit under ``root`` reduce-scatters zeros for a parameter that got no gradient on this rank.

    ``ddp(find_unused_parameters=True)``'s rule for FSDP2: when a branch runs on some ranks only, the ranks that
    skipped it must still send the same buffers, or the reduce-scatters of the node mismatch (a hang, or the
    wrong gradients mixed). torch 2.13 and later do it with ``FSDPModule.set_reduce_scatter_unused_params(True)``
    (``native=None`` picks it where present). Older releases get the same rule by wrapping each parameter
    group's ``post_backward``: a parameter that needs a gradient and has neither a gradient nor an accumulated
    one gets a zero gradient just before FSDP2 collects the gradients, which is where 2.13 adds its zeros, so
    both reduce-scatter the same buffers (``native=False`` forces this path, for the tests on newer releases).
    """
    if native is None:
        native = HAS_REDUCE_SCATTER_UNUSED_PARAMS
    if native:
        root.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        return
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module._get_fsdp_state()):  # type: ignore[operator]
                if not getattr(group, "_zero_fills_unused", False):
                    group.post_backward = functools.partial(_post_backward_with_zeros, group, group.post_backward)
                    group._zero_fills_unused = True


def _post_backward_with_zeros(group: Any, post_backward: Any, *args: Any) -> Any:
    """``FSDPParamGroup.post_backward`` after giving each unused parameter a zero gradient (see
    :func:`reduce_scatter_unused_params`). Only when this backward reduces gradients (``reduce_grads``): under
    ``set_requires_gradient_sync(False)`` FSDP2 only accumulates, and 2.13 adds no zeros there either."""
    if group.reduce_grads:
        for fsdp_param in group.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):  # never gathered: FSDP2 skips it too
                continue
            param = fsdp_param.unsharded_param
            if param.requires_grad and param.grad is None and fsdp_param.unsharded_accumulated_grad is None:
                param.grad = torch.zeros_like(param)
    return post_backward(*args)
