"""The arithmetic of a 16-bit branch's two gradient boundaries, fused into one pass each where it is compiled.

Backward through a branch ``x + f(x)`` crosses two boundaries (:mod:`dalle_lightning_plugins.precision.grad_filter`):

- leaving the identity path into the branch: ``(g * s) -> 16-bit``;
- leaving the branch back to the identity path: ``g16 -> fp32``, ``/ s``, non-finite values set to 0 and the
  block flagged when there was one.

Written as separate tensor operations the second is three passes over the branch's activation gradient (widening
copy, GradScaler's unscale-and-check writing the flag, ``nan_to_num_``); the first is one (the product narrowed as
it is stored). On a GPU, where an update is bound by memory traffic, the three passes cost more than the scaling
is worth. Compiled (``torch.compile``,
shapes dynamic, so one graph serves every block, batch and length) each boundary is one kernel that reads the
gradient once and writes it once; the flag is a reduction in the same kernel.

``fused=None`` (the default) compiles where the gradients are on CUDA and keeps the eager passes elsewhere: on a
CPU each new graph costs seconds of C++ compilation, while the passes of a small model's branch cost microseconds.
Both paths give the same values: the eager one is the reference the fused one is tested against.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.fast_paths import FastPath

_RECOMPILE_LIMIT = 32  # graphs per boundary function: dtypes x memory formats (contiguous, channels-last)


def identity_grad_eager(grad: Tensor, inv_scale: Tensor, flag: Tensor) -> Tensor:
    """``grad`` (16-bit, scaled) -> fp32 unscaled with non-finite values zeroed; ``flag`` (1 element) set to 1 if
    there was one. Three passes: a widening copy, the fused unscale-and-check GradScaler uses, the filter."""
    g = grad.to(torch.float32, copy=True)
    unscale_and_flag([g], inv_scale, flag)
    return torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)


def branch_grad_eager(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad`` (fp32) times the block's ``scale`` in fp32, narrowed as it is stored (one pass, the product never
    materialised in fp32): a product beyond the 16-bit range becomes Inf, which the other boundary's filter catches."""
    return torch.mul(grad.to(torch.float32), scale, out=torch.empty_like(grad, dtype=dtype))


def _identity_grad_math(grad: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    g = grad.to(torch.float32) * inv_scale
    finite = torch.isfinite(g)
    return torch.where(finite, g, 0.0), (~finite).any().to(torch.float32)


def _branch_grad_math(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (grad.to(torch.float32) * scale).to(dtype)


@functools.lru_cache(maxsize=None)
def _compiled(name: str):  # noqa: ANN202 - a compiled callable
    fn = {"identity": _identity_grad_math, "branch": _branch_grad_math}[name]
    return torch.compile(fn, dynamic=True)


def _call_compiled(name: str, *args: object) -> object:
    """A compiled boundary function, with dynamo's recompile limit raised for it and made an error: not dynamo's
    silent eager fallback, but the boundary's own (``_FUSED``: one line and the eager passes, or in strict mode the
    error). The functions are compiled with dynamic shapes, so only dtypes and memory formats make new graphs.
    Both settings are restored after the call, for the rest of the process; set as attributes, which costs a third
    of ``config.patch`` (this runs twice per branch and backward)."""
    config = compat.dynamo_config()
    limit, fail = config.recompile_limit, config.fail_on_recompile_limit_hit
    config.recompile_limit, config.fail_on_recompile_limit_hit = max(limit, _RECOMPILE_LIMIT), True
    try:
        return _compiled(name)(*args)
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = limit, fail


# A compile that fails (a torch release or a GPU it never ran on) must not end a run over a few memory passes: the
# boundary goes on with its eager passes, with one line (fast_paths; strict mode raises). One per boundary.
_OPTION = "fused_boundaries=False (dalle-train: precision.fused_boundaries=false)"
_FUSED = {name: FastPath("the fused gradient-boundary kernels (torch.compile)", _OPTION, site=name)
          for name in ("identity", "branch")}


def use_fused(fused: bool | None, grad: Tensor) -> bool:
    """Whether a boundary with this setting fuses for ``grad`` (``None``: on CUDA; never inside a compile)."""
    if torch.compiler.is_compiling():
        return False
    return grad.is_cuda if fused is None else bool(fused)


def identity_grad(grad: Tensor, inv_scale: Tensor, flag: Tensor, fused: bool | None = None) -> Tensor:
    """:func:`identity_grad_eager` in one kernel where fused (the flag is raised by a second, 1-element one)."""
    if not use_fused(fused, grad):
        return identity_grad_eager(grad, inv_scale, flag)

    def fast() -> Tensor:
        out, found = _call_compiled("identity", grad, inv_scale.to(grad.device))
        torch.maximum(flag, found.to(flag.device), out=flag)
        return out

    return _FUSED["identity"].run(fast, lambda: identity_grad_eager(grad, inv_scale, flag))


def branch_grad(grad: Tensor, scale: Tensor, dtype: torch.dtype, fused: bool | None = None) -> Tensor:
    """:func:`branch_grad_eager` in one kernel where fused."""
    if not use_fused(fused, grad):
        return branch_grad_eager(grad, scale, dtype)
    return _FUSED["branch"].run(lambda: _call_compiled("branch", grad, scale.to(grad.device), dtype),
                                lambda: branch_grad_eager(grad, scale, dtype))


def unscale_and_flag(grads: list[Tensor], inv_scale: Tensor, flag: Tensor) -> None:
    """Multiply ``grads`` (one device) by ``inv_scale`` in place and set the 1-element ``flag`` to 1 if any value
    is non-finite, with the fused kernel GradScaler uses; it writes the flag in place when both share a device."""
    device = grads[0].device
    if flag.device == device:
        compat.amp_unscale_and_check(grads, flag, inv_scale.to(device))
        return
    found = torch.zeros(1, dtype=torch.float32, device=device)
    compat.amp_unscale_and_check(grads, found, inv_scale.to(device))
    torch.maximum(flag, found.to(flag.device), out=flag)
