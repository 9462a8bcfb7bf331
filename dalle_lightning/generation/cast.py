"""The prior's weights cast once to the compute dtype for sampling, as gpt-fast samples.

A decode step at a small batch reads every weight once and does little else, so its time is the bytes it reads.
Under ``torch.autocast`` each linear layer casts its fp32 weight to 16 bits at every call; autocast keeps the cast
copies in a cache, but a CUDA graph capture may not allocate from that cache, so a captured step read the fp32
weights, wrote the 16-bit copies and read them again at every token: 3-4x the bytes of the weights in 16 bits.
gpt-fast samples from a model whose weights are in the compute dtype and runs without autocast; here the same:
:func:`sampling_model` makes the copy once per call (or :class:`~dalle_lightning.generation.generate.Generator`
once per generator), and the step reads 16-bit weights only.

The copy keeps in fp32 what the prior computes in fp32 under autocast too: the final LayerNorm and the two heads
(``DallePrior._heads``: the paper keeps unembeddings and logits in fp32). The rest, the residual stream included,
computes in the compute dtype, as gpt-fast's does; the drawn tokens are those of this copy, eager or graphed.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dalle_lightning_plugins.dtypes import resolve_dtype

FP32_MODULES = ("ln_f", "text_head", "image_head")  # DallePrior._heads computes these in fp32 whatever the dtype
SAMPLING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

M = TypeVar("M", bound=nn.Module)


def check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A compute dtype for sampling from a dtype or its name (``bf16``, ``fp16``, ``fp32``); ``None`` passes."""
    return resolve_dtype(dtype, allowed=SAMPLING_DTYPES, what="sampling dtype")


def weights_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating weights outside :data:`FP32_MODULES` (the first one found)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and not _kept_fp32(name):
            return p.dtype
    return torch.float32


def sharded(model: nn.Module) -> bool:
    """Whether a strategy shards the model's parameters: DTensors (a copy would be a copy of one shard), or FSDP2
    units, whose parameters are whole only inside the strategy's ``full_parameters()`` (where a callback samples)
    and whose copy would carry the units' hooks and process group."""
    return any(isinstance(p, DTensor) for p in model.parameters()) or any(
        isinstance(m, FSDPModule) for m in model.modules())


# Lightning's precision names, by the dtype their forward computes in (``trainer.precision``; the precision plugin
# ``ResblockScalingPrecision`` reports ``bf16-mixed`` or ``16-mixed`` after its branch dtype).
PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}


def precision_dtype(precision: str | None) -> torch.dtype | None:
    """The compute dtype of a Lightning precision name, for sampling as the model trains: ``bf16-mixed`` and
    ``bf16-true`` give bf16, ``16-mixed`` and ``16-true`` fp16, ``32-true`` fp32; any other (``64-true``,
    ``transformer-engine``, none) gives None: the weights' own."""
    if precision is None:
        return None
    return PRECISION_DTYPES.get(str(precision).partition("-")[0])


def _kept_fp32(name: str) -> bool:
    return name.split(".")[0] in FP32_MODULES


def sampling_copy(model: M, dtype: torch.dtype) -> M:
    """A copy of ``model`` in eval mode for sampling in ``dtype``: its floating parameters and buffers cast (those of
    :data:`FP32_MODULES` kept fp32 and shared with ``model``), no gradients; ``model`` is left as it was.

    Made through ``deepcopy`` with the cast tensors in its memo, so the fp32 weights are never copied whole first."""
    memo: dict[int, object] = {}
    for name, p in model.named_parameters():
        target = torch.float32 if _kept_fp32(name) or not p.is_floating_point() else dtype
        memo[id(p)] = nn.Parameter(p.detach().to(target), requires_grad=False)
    for name, b in model.named_buffers():
        memo[id(b)] = b.to(dtype) if b.is_floating_point() and not _kept_fp32(name) else b
    return copy.deepcopy(model, memo).eval()


def sampling_model(model: M, device: torch.device, dtype: torch.dtype | str | None = None) -> tuple[M, bool]:
    """``(module to sample with, whether to sample without autocast)`` for a compute ``dtype``.

    ``dtype=None`` takes autocast's dtype where autocast is on for ``device``, else the weights' own. Where the
    weights differ from it, they are cast once into a copy (:func:`sampling_copy`) and sampling runs without
    autocast. Without autocast and a ``dtype``, nothing changes. A sharded model is sampled as it is, under the
    caller's autocast: its copy would hold one shard."""
    want = check_dtype(dtype)
    autocast = torch.is_autocast_enabled(device.type)
    if want is None:
        if not autocast:
            return model, False
        want = torch.get_autocast_dtype(device.type)
    if sharded(model):
        if dtype is not None and want != weights_dtype(model):
            raise ValueError(f"sampling dtype={dtype} for a sharded model; expected its weights' own "
                             f"({weights_dtype(model)}), or none under autocast")
        return model, False
    if weights_dtype(model) == want:
        return model, True
    return sampling_copy(model, want), True
