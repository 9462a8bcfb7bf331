"""FlexAttention for the prior's layouts: one compiled kernel per dtype for every layout, batch and length, and a
one-line error instead of torch's silent unfused fallback.

Why the mask's numbers are tensors: dynamo guards on what a ``mask_mod`` closes over. A closure over the layout's
kind and sizes (Python values) is a new guard per layout, dtype and shape, and after ``recompile_limit`` (8) misses
dynamo stops compiling ``flex_attention`` for the rest of the process: every later call runs the unfused path that
materialises the whole score matrix, with only a warning. Here one ``mask_mod`` serves every layout: it reads
``[kind, n_text, width, window, half]`` from a small integer tensor, which dynamo lifts as an input (guarded on its
dtype and shape, not its values), and picks the kind's condition with ``where``; the kernel evaluates it only on the
blocks the block mask marks partial. The batch dimension is marked dynamic, so a last partial batch or a
validation batch of another size reuses the kernel; a new sequence length (a sampling prefix) compiles once more,
after which dynamo makes the length dynamic too.

Should a run still exhaust the limit (another model in the same process using FlexAttention with many masks), the
call fails with :class:`FlexRecompileError`, one line naming the limit, instead of slowing down silently.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from dalle_lightning_plugins.recompiles import strict_recompiles

if TYPE_CHECKING:
    from dalle_lightning.models.sparse_attention import AttentionLayout

KIND_CODES = {"row": 0, "column": 1, "conv": 2}


class FlexRecompileError(RuntimeError):
    """FlexAttention would have fallen back to its unfused path (dynamo's recompile limit)."""


def mask_params(layout: AttentionLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """``int32[5]``: the layout's ``kind`` code, ``n_text``, ``width``, row ``window`` and conv ``kernel // 2``."""
    values = [KIND_CODES[layout.kind], layout.n_text, layout.width, layout.window, layout.kernel // 2]
    return torch.tensor(values, dtype=torch.int32, device=device)


def flex_mask_mod(layout: AttentionLayout, device: torch.device | str | None = None):
    """The layout's mask as a FlexAttention ``mask_mod(b, h, q, kv)``: index arithmetic only (no dense lookup), so
    ``create_block_mask`` skips whole blocks, and the same code for every layout (see the module docstring)."""
    params = mask_params(layout, device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kind, t, w, window, half = params[0], params[1], params[2], params[3], params[4]
        qi, ki = q - t, kv - t
        row_ok = qi - ki <= window
        column_ok = (qi % w) == (ki % w)
        conv_ok = (torch.abs(qi // w - ki // w) <= half) & (torch.abs(qi % w - ki % w) <= half)
        image_ok = torch.where(kind == 0, row_ok, torch.where(kind == 1, column_ok, conv_ok))
        # Text queries see earlier text only (causality suffices); image queries see all text and masked image.
        return (kv <= q) & ((kv < t) | ((q >= t) & image_ok))

    return mask_mod


@functools.lru_cache(maxsize=64)
def flex_block_mask(layout: AttentionLayout, length: int, device: torch.device):
    """A cached FlexAttention ``BlockMask`` for a sequence of ``length`` positions."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(flex_mask_mod(layout, device), None, None, length, length, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def compiled_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """``flex_attention`` compiled (the fused block-sparse kernel), never the unfused fallback.

    Inside a compiled region (the prior's ``compile=True``) the call is traced into that region's graph; outside,
    it goes through one ``torch.compile`` of ``flex_attention`` with the batch dimension dynamic, and dynamo's
    recompile limit raises instead of falling back."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask)
    for x in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(x, 0)
    try:
        with strict_recompiles():
            return _compiled_flex()(q, k, v, block_mask=block_mask)
    except Exception as error:  # dynamo wraps the limit error in its own types, which vary across versions
        if "recompile_limit" in str(error) or "cache_size_limit" in str(error):
            raise FlexRecompileError(
                f"flex_attention hit torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit}) "
                f"with q {tuple(q.shape)} {q.dtype}; expected one compiled kernel per dtype (raise the limit, or use "
                "attn_impl=sparse)"
            ) from None
        raise
