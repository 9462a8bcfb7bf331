"""FlexAttention for the prior's layouts: one compiled kernel per dtype for every layout, batch and length, and a
counted, reported recompile instead of torch's silent unfused fallback.

Why the mask's numbers are tensors: dynamo guards on what a ``mask_mod`` closes over. A closure over the layout's
kind and sizes (Python values) is a new guard per layout, dtype and shape, and after ``recompile_limit`` (8) misses
dynamo stops compiling ``flex_attention`` for the rest of the process: every later call runs the unfused path that
materialises the whole score matrix, with only a warning. Here one ``mask_mod`` serves every layout: it is the
layout's own rule, :func:`dalle_lightning.models.layout.visible`, reading ``[kind, n_text, width, window, half]``
from a small integer tensor, which dynamo lifts as an input (guarded on its dtype and shape, not its values); the
kernel evaluates it only on the blocks the block mask marks partial. The batch dimension is marked dynamic, so a
last partial batch or a validation batch of another size reuses the kernel; a new sequence length (a sampling
prefix) compiles once more, after which dynamo makes the length dynamic too.

Should a run still reach the limit (another model in the same process using FlexAttention with many masks), the
policy of :mod:`dalle_lightning.models.recompiles` applies: one line and the unfused path for the new shapes, or, in
strict mode, :class:`FlexRecompileError`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

from dalle_lightning.models.layout import AttentionLayout, visible
from dalle_lightning.models.recompiles import CompiledFunction, RecompileLimitError
from dalle_lightning_plugins.fast_paths import FastPath


log = logging.getLogger(__name__)


class FlexRecompileError(RecompileLimitError):
    """FlexAttention would have fallen back to its unfused path (dynamo's recompile limit; strict mode)."""


def flex_mask_mod(
    layout: AttentionLayout, device: torch.device | str | None = None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The layout's mask as a FlexAttention ``mask_mod(b, h, q, kv)``: the layout's rule (index arithmetic only, no
    dense lookup), so ``create_block_mask`` skips whole blocks, and the same code for every layout."""
    params = layout.params(device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return visible(q, kv, params)

    return mask_mod


@functools.lru_cache(maxsize=64)
def flex_block_mask(layout: AttentionLayout, length: int, device: torch.device) -> Any:
    """A cached FlexAttention ``BlockMask`` for a sequence of ``length`` positions."""
    return create_block_mask(flex_mask_mod(layout, device), None, None, length, length, device=device)


_COMPILED_FLEX = CompiledFunction("flex_attention", torch_flex_attention, option="model.attn_impl=sparse",
                                  error=FlexRecompileError, what="compiling FlexAttention for new input shapes")


# A compile that fails (a torch release or a GPU it never ran on) is not the recompile limit: the run goes on with
# the eager kernel and one line (dalle_lightning_plugins.fast_paths; strict mode raises).
_FLEX_PATH = FastPath("torch.compile of FlexAttention", "model.attn_impl=sparse", site="compiled_flex",
                      passthrough=(RecompileLimitError,))


def cpu_flex_compiles() -> bool:
    """Whether torch's compiled CPU FlexAttention kernel is used on this CPU: only where it has AVX-512.

    On an AVX2-only machine (torch 2.9.1 and 2.14.1) the compiled kernel was measured wrong: 1.8 to 2.2 away from the
    eager kernel on the prior's conv layout and on a plain causal mask of 72 positions, NaN rows or a freed-pointer
    abort on other runs of the same call; the eager kernel agrees with dense attention to 5e-7 there. The CPU's
    vector set is torch's own reading (``torch.backends.cpu.get_cpu_capability``)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


_CPU_EAGER_SAID: list[bool] = []


def compiled_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """``flex_attention`` compiled (the fused block-sparse kernel).

    Inside a compiled region (the prior's ``compile=True``) the call is traced into that region's graph; outside,
    it goes through one ``torch.compile`` of ``flex_attention`` with the batch dimension dynamic, counted and
    limited as :mod:`dalle_lightning.models.recompiles` says. Should the compile fail, this call and every later
    one run ``flex_attention`` eagerly (it writes out the score matrix), with one line."""
    if q.device.type == "cpu" and not cpu_flex_compiles():
        return _cpu_eager_flex(q, k, v, block_mask)  # a compiled region (the prior's compile=True) too
    if torch.compiler.is_compiling():
        return torch_flex_attention(q, k, v, block_mask=block_mask)
    return _FLEX_PATH.run(lambda: _COMPILED_FLEX(q, k, v, block_mask=block_mask),
                          lambda: _eager_flex(q, k, v, block_mask))


@torch.compiler.disable
def _cpu_eager_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """The eager kernel where the compiled CPU one is wrong (:func:`cpu_flex_compiles`), said once. Kept out of any
    compiled graph: traced into one (a compiled prior), FlexAttention would become the compiled CPU kernel."""
    if not _CPU_EAGER_SAID:
        _CPU_EAGER_SAID.append(True)
        log.warning("FlexAttention runs its eager kernel on this CPU (%s, no AVX-512): torch's compiled CPU kernel "
                    "gives wrong values there; model.attn_impl=sparse is the fast kernel on a CPU",
                    torch.backends.cpu.get_cpu_capability())
    return _eager_flex(q, k, v, block_mask)


def _eager_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """The fallback, without torch's own warning about it: the fallback's one line has said it already."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return torch_flex_attention(q, k, v, block_mask=block_mask)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """FlexAttention with the layout's block mask, compiled into the fused block-sparse kernel. On CPU only the
    forward compiles (torch has no CPU FlexAttention backward): with gradients it runs the unfused eager path,
    which is useful to check the mask, not for speed."""
    layout.image_positions(q.shape[-2])  # a sequence longer than the stream is a one-line error
    block_mask = flex_block_mask(layout, q.shape[-2], q.device)
    if q.is_cuda or not (torch.is_grad_enabled() and q.requires_grad):
        return compiled_flex(q, k, v, block_mask)
    return torch_flex_attention(q, k, v, block_mask=block_mask)
