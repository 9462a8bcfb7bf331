"""A deep residual toy model whose branch gradients span more binades than fp16 holds under one loss scale.

The per-resblock precision plugin exists for this situation: fp32 stem -> ``depth`` blocks ``x + gain * f(x)``
-> fp32 head, with the gains shrinking by ``2**-decay`` per block towards the input, so the early branches'
gradients are ``~2**-(decay * depth)`` times the last ones'. Its tests check gradient fidelity on it and
``benchmarks/gradient_fidelity.py`` measures it; both use this one definition and the helpers below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.helpers.grad_poison import overflow_grad


class Branch(nn.Module):
    """Linear -> GELU -> Linear. ``poison`` injects an overflow into backward at its "input" or "hidden" layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.poison: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.poison == "input":
            x = overflow_grad(x)
        h = F.gelu(self.fc1(x))
        if self.poison == "hidden":
            h = overflow_grad(h)
        return self.fc2(h)


class Block(nn.Module):
    """``x + gain * branch(x)``; the gain is an fp32 parameter outside the branch, as in the paper."""

    def __init__(self, width: int, gain: float) -> None:
        super().__init__()
        self.branch = Branch(width)
        self.gain = nn.Parameter(torch.tensor([gain]))  # 1-D: FSDP2 cannot shard scalars

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gain * self.branch(x)


class DeepResidual(nn.Module):
    """fp32 stem -> ``depth`` blocks -> fp32 head. Gains shrink by 2**-decay per block towards the input, so the
    branches' gradients span ~decay*depth binades: more than fp16 can hold under one scale."""

    def __init__(self, depth: int = 32, width: int = 16, decay: float = 1.25) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, 2.0 ** (-decay * (depth - 1 - i))) for i in range(depth))
        self.head = nn.Linear(width, width)
        self.identity_grads: dict[int, Tensor] | None = None  # set to {} to record dL/d(input of block i)

    def resblocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}.branch", b.branch) for i, b in enumerate(self.blocks)]

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            if self.identity_grads is not None and x.requires_grad:
                x.register_hook(lambda g, i=i: self.identity_grads.__setitem__(i, g))  # type: ignore[union-attr]
            x = block(x)
        return self.head(x)


def regression_data(width: int = 16, n: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Fixed random inputs and targets of a regression on the model's width."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def squared_error(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Summed, not averaged: the loss scale of the last blocks then sits near fp16's top, as in a real model."""
    return ((model(x) - y) ** 2).sum()


def branch_grads(model: DeepResidual) -> list[Tensor]:
    """Each block's branch gradients, flattened, in float64 for exact comparisons."""
    return [torch.cat([p.grad.flatten() for p in b.branch.parameters()]).double() for b in model.blocks]


def cosine(a: Tensor, b: Tensor) -> float:
    """In float64 without an eps clamp: the early blocks' true gradients are ~1e-11 (F.cosine_similarity's eps
    of 1e-8 would report 0)."""
    return (a @ b / (a.norm() * b.norm())).item() if a.norm() > 0 else 0.0


@contextlib.contextmanager
def autocast_branches(model: DeepResidual) -> Iterator[None]:
    """The global-scale baseline: the same branches in fp16 via autocast, fp32 identity, no per-block scaling."""
    stack: list[torch.autocast] = []

    def pre(module: nn.Module, args: tuple) -> None:
        stack.append(torch.autocast("cpu", dtype=torch.float16, cache_enabled=False))
        stack[-1].__enter__()

    def post(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        stack.pop().__exit__(None, None, None)
        return out.float()

    branches = [b.branch for b in model.blocks]
    handles = [h for m in branches for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def plugin_update(plugin: Any, optimizer: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor) -> None:
    """One update through the precision plugin's ``optimizer_step``, its closure running forward and backward."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = squared_error(model, x, y)
        loss.backward()
        return loss

    plugin.optimizer_step(optimizer, model, closure)
