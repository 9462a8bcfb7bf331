"""Identity in forward, a chosen non-finite gradient in backward: how tests inject overflows where they want them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class _MapGrad(torch.autograd.Function):
    """Forward returns ``x``; backward returns ``fn(grad)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.fn(grad), None


def overflow_grad(x: Tensor) -> Tensor:
    """Backward multiplies by 1e30, which overflows any 16-bit gradient to Inf (as a real overflow would)."""
    return _MapGrad.apply(x, lambda g: g * 1e30)


def inf_grad(x: Tensor) -> Tensor:
    """Backward replaces the gradient by +Inf in any dtype."""
    return _MapGrad.apply(x, lambda g: torch.full_like(g, math.inf))
