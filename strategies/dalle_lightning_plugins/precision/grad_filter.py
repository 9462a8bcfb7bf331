"""Autograd functions at the boundaries of a 16-bit residual branch, and the hooks that install them.

For a resblock ``x + f(x)`` the identity path carries fp32 activations and gradients; only ``f`` runs in 16-bit.
Two autograd functions sit at the branch's edges (forward reads left to right, backward right to left):

    x (fp32) --ToBranch--> f in 16-bit --FromBranch--> f(x) (fp32)
    backward:  g_x += filter(g16 / s)  <--  f backward in 16-bit  <--  (g * s) -> 16-bit

so the gradient inside the branch is the true gradient times the block's own scale ``s`` (far from fp16's
underflow), and what leaves the branch is unscaled, in fp32, with Inf/NaN set to 0 and the block flagged. The
filter keeps one overflowing block from poisoning the identity-path gradient of every earlier block (and with
it their parameter gradients and scales).

Inside the branch we use ``torch.autocast`` rather than 16-bit weight copies: parameters and their ``.grad``
stay fp32 masters without touching the module (so optimizers, EMA copies, checkpoints and FSDP2 sharding see
ordinary fp32 parameters), the casts autocast records make backward run in 16-bit and accumulate the weight
gradients (times ``s``) into fp32 ``.grad``, and activation checkpointing replays the autocast state. The hooks are
ordinary forward (pre-)hooks, so they compose with FSDP2's ``fully_shard`` hooks in either registration order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.precision.boundary_kernels import branch_grad, identity_grad, unscale_and_flag

__all__ = ["BranchBoundaries", "FromBranch", "ToBranch", "unscale_and_flag"]


class ToBranch(torch.autograd.Function):
    """Identity path -> branch: cast to 16-bit; backward unscales, filters Inf/NaN and flags the block."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: torch.dtype, boundaries: "BranchBoundaries", index: int) -> Tensor:
        ctx.in_dtype, ctx.boundaries, ctx.index = x.dtype, boundaries, index
        return x.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        # Widen, unscale, filter and flag (boundary_kernels: one kernel where fused, else three passes); the flag
        # stays on the device, so there is no host sync per block.
        boundaries, index = ctx.boundaries, ctx.index
        g = identity_grad(grad, boundaries.inv_scale_of[index], boundaries.flag_of[index], boundaries.fused)
        return g.to(ctx.in_dtype), None, None, None


class FromBranch(torch.autograd.Function):
    """Branch -> identity path: cast to the identity dtype; backward multiplies by the scale, casts to 16-bit."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, out_dtype: torch.dtype, boundaries: "BranchBoundaries", index: int) -> Tensor:
        ctx.in_dtype, ctx.boundaries, ctx.index = y.dtype, boundaries, index
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # Multiply in fp32, then narrow (one kernel where fused): beyond the 16-bit range is Inf, which the filter
        # at the other boundary catches.
        boundaries, index = ctx.boundaries, ctx.index
        return branch_grad(grad, boundaries.scale_of[index], ctx.in_dtype, boundaries.fused), None, None, None


class BranchBoundaries:
    """Installs autocast + ``ToBranch``/``FromBranch`` on a list of branches; holds the shared device tensors.

    ``scales`` (float32, one per block) is read in backward; ``flags`` (float32, one per block plus one spare
    slot the precision plugin uses for non-block parameters) is written in backward. Both move lazily to the
    device of the first activation seen, because Lightning converts the module before moving it to the device.
    """

    def __init__(self, dtype: torch.dtype, num_blocks: int, fused: bool | None = None) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype}, expected torch.float16 or torch.bfloat16")
        self.dtype = dtype
        self.fused = fused  # boundary_kernels.use_fused: None compiles each boundary into one kernel on CUDA
        self.scales = torch.ones(num_blocks, dtype=torch.float32)
        # 1 / scales, computed once per update, plus a spare 1 for the parameters outside the blocks (as flags)
        self.inv_scales = torch.ones(num_blocks + 1, dtype=torch.float32)
        self.flags = torch.zeros(num_blocks + 1, dtype=torch.float32)
        self._block_views()
        self._handles: list[RemovableHandle] = []
        self._autocast_stack: list[torch.autocast] = []

    def to(self, device: torch.device) -> None:
        if self.scales.device != device:
            self.scales = self.scales.to(device)
            self.inv_scales = self.inv_scales.to(device)
            self.flags = self.flags.to(device)
            self._block_views()

    def _block_views(self) -> None:
        """One-element views of each block's scale, reciprocal and flag, made once (not two slices per backward)."""
        self.scale_of = self.scales.split(1)
        self.inv_scale_of = self.inv_scales.split(1)
        self.flag_of = self.flags.split(1)

    def set_scales(self, scales: Tensor) -> None:
        """Copy the blocks' current scales (and their reciprocals, which every backward reads) to the device."""
        self.scales.copy_(scales)
        torch.reciprocal(self.scales, out=self.inv_scales[:-1])

    def install(self, branches: list[nn.Module]) -> None:
        self.remove()
        for index, branch in enumerate(branches):
            self._handles.append(branch.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self._handles.append(branch.register_forward_hook(self._post_hook(index), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, index: int):  # noqa: ANN202 - a closure per block
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
            device = first.device if first is not None else next(module.parameters()).device
            self.to(device)
            ctx = torch.autocast(device.type, dtype=self.dtype, cache_enabled=False)
            ctx.__enter__()
            self._autocast_stack.append(ctx)
            if not torch.is_grad_enabled():
                return args, kwargs

            def cast(t: Any) -> Any:
                if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad:
                    return ToBranch.apply(t, self.dtype, self, index)
                return t

            return _map(cast, args), _map(cast, kwargs)

        return hook

    def _post_hook(self, index: int):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            self._autocast_stack.pop().__exit__(None, None, None)
            # Without gradients the pre-hook left the inputs as they were: the output goes back to the identity
            # path's dtype, fp32 in training, but bf16 in a copy cast for sampling (generation/cast.py), whose next
            # LayerNorm has bf16 weights (the CPU's layer_norm takes no fp32 input with them).
            first = next((t for t in args if isinstance(t, Tensor) and t.is_floating_point()), None)
            identity = first.dtype if first is not None and not torch.is_grad_enabled() else torch.float32

            def cast(t: Any) -> Any:
                if not (isinstance(t, Tensor) and t.is_floating_point()):
                    return t
                if torch.is_grad_enabled() and t.requires_grad:
                    return FromBranch.apply(t, torch.float32, self, index)
                return t.to(identity)

            return _map(cast, output)

        return hook


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map`` with the common cases done directly: a branch takes and returns a tensor or a flat tuple of
    them, and a pytree flatten and unflatten per hook call is a visible share of a small model's step."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if type(tree) is tuple and not any(isinstance(t, (tuple, list, dict)) for t in tree):
        return tuple(fn(t) for t in tree)
    if type(tree) is dict and not tree:
        return tree
    return compat.tree_map(fn, tree)
