"""Attention kernels of the DALL-E prior: sparse (blocked), dense-mask reference, FlexAttention, and one-query decode.

All take ``q, k, v: [B, H, L, D]`` over the stream ``n_text`` text positions + up to ``height * width`` image
positions (``L`` may stop early, e.g. while sampling) and an :class:`~dalle_lightning.models.layout.AttentionLayout`,
whose geometry (which key each query sees) is written once, in :mod:`dalle_lightning.models.layout`: the dense
reference reads its mask, this module's blocked and decode kernels derive their index tables from that mask, and
FlexAttention (:mod:`dalle_lightning.models.flex`) evaluates the same rule per block. Every kind puts text keys and
image keys into ONE softmax.

Why the sparse path is sparse: an image query's keys are all text keys (shared, one ``[N, n_text]`` product) plus
a few image keys that sit in a fixed geometric place, so the image part is computed on reshaped views instead of
the ``N x N`` square:

- ``row`` and ``conv`` (*band* attention): the raster sequence is cut into rows of ``width`` tokens; query row
  ``r`` meets key rows ``r - nb .. r`` only (``nb = 1`` for the default row window, ``kernel // 2`` for conv),
  built from ``nb + 1`` shifted slices of the key rows (``_bands``). Cost ``N * (nb + 1) * width`` instead of ``N^2``.
- ``column``: the grid is transposed (as the paper does) so each column is a short causal sequence of ``height``
  tokens. Cost ``N * height``.

Text queries use causal attention over the text keys only (text never sees the image).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dalle_lightning.models.flex import flex_attention
from dalle_lightning.models.layout import AttentionLayout, text_causal_mask

ATTENTION_IMPLS = ("auto", "sparse", "dense", "flex")


# ---------------------------------------------------------------------------------------------- index tables
@functools.lru_cache(maxsize=64)
def _dense_mask(layout: AttentionLayout, device: torch.device) -> torch.Tensor:
    return layout.full_mask(device)


@functools.lru_cache(maxsize=64)
def _causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """The text region's mask, built once per length and device instead of in every call of every layer."""
    return text_causal_mask(length, device)


@functools.lru_cache(maxsize=64)
def band_tables(layout: AttentionLayout, device: torch.device) -> tuple[int, torch.Tensor]:
    """``(nb, mask[height, width, n_text + (nb + 1) * width])`` for band attention, derived from the dense mask.

    Entry ``[r, c, n_text + j]`` says whether query ``(r, c)`` sees image key ``(r - nb) * width + j``; the first
    ``n_text`` entries (text keys) are all ``True``. ``nb`` is the largest row distance the mask allows.
    """
    h, w = layout.height, layout.width
    m = layout.image_mask(device)
    rows = torch.arange(h * w, device=device) // w
    qa, kb = m.nonzero(as_tuple=True)
    nb = int((rows[qa] - rows[kb]).max())
    r = torch.arange(h, device=device).view(h, 1, 1)
    c = torch.arange(w, device=device).view(1, w, 1)
    j = torch.arange((nb + 1) * w, device=device).view(1, 1, -1)
    q_idx = (r * w + c).expand(h, w, (nb + 1) * w)
    k_idx = ((r - nb) * w + j).expand(h, w, (nb + 1) * w)
    band = (k_idx >= 0) & m[q_idx, k_idx.clamp(min=0)]
    text = torch.ones(h, w, layout.n_text, dtype=torch.bool, device=device)
    return nb, torch.cat([text, band], dim=-1)


@functools.lru_cache(maxsize=64)
def column_tables(layout: AttentionLayout, device: torch.device) -> torch.Tensor:
    """``mask[height, n_text + height]`` for transposed column attention: all text keys, causal within the column."""
    h = layout.height
    text = torch.ones(h, layout.n_text, dtype=torch.bool, device=device)
    return torch.cat([text, text_causal_mask(h, device)], dim=-1)


@functools.lru_cache(maxsize=64)
def decode_tables(layout: AttentionLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)``, both ``[N, K]``: for image query ``n`` the stream positions of its keys (text, then its
    mask row of image keys), padded to the longest row ``K``. Used by :func:`decode_attention`."""
    t, length = layout.n_text, layout.n_text + layout.n_image
    m = _dense_mask(layout, device)[t:]
    k = int(m.sum(dim=1).max())
    pos = torch.arange(length, device=device).expand_as(m)
    index = torch.where(m, pos, length).sort(dim=1).values[:, :k]
    valid = index < length
    return index.clamp(max=length - 1), valid


# ---------------------------------------------------------------------------------------------- kernels
def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax in the scores' own dtype, masking in place (``scores`` is a fresh product or concatenation
    that nothing else reads). PyTorch's softmax kernels accumulate 16-bit inputs in fp32 on CPU and CUDA, so a
    widening copy would change nothing in the forward and cost two passes over the largest tensor of the layer
    each way; only the output is rounded, as the value product reads it in 16 bits anyway."""
    return scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention (the text region). On CPU it is written out: PyTorch's CPU flash kernel has a fixed
    cost that dominates short sequences such as the demo's text region, where these few matmuls are several
    times cheaper (docs/results.md)."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _written_out(q, k, v, _causal_mask(q.shape[-2], q.device))


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention as two matmuls and a softmax: the CPU path of the short, dense attention calls."""
    return _softmax((q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-1, -2), mask) @ v


def _split(q: torch.Tensor, layout: AttentionLayout) -> tuple[int, int]:
    """``(n, rows)``: image positions present and whole rows needed to hold them."""
    n = layout.image_positions(q.shape[-2])
    return n, math.ceil(n / layout.width)


def _bands(x: torch.Tensor, nb: int, rows: int, w: int) -> torch.Tensor:
    """``[B, H, rows * w, D] -> [B, H, rows, (nb + 1) * w, D]``: for each row ``r`` the rows ``r - nb .. r`` (zeros
    before the first). Built from ``nb + 1`` shifted slices: a strided ``unfold`` view gives the same values without
    the copy, but its backward (``unfold_backward``) is a visible share of a demo prior step, while the slices'
    backward costs almost nothing."""
    b, h, _, d = x.shape
    padded = F.pad(x, (0, 0, nb * w, 0)).view(b, h, rows + nb, w, d)
    return torch.cat([padded[:, :, i : i + rows] for i in range(nb + 1)], dim=3)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """Blocked attention whose cost grows with the attended positions (see the module docstring)."""
    t, w = layout.n_text, layout.width
    n, rows = _split(q, layout)
    if n <= 0:
        return causal_attention(q, k, v)
    # split (not slicing): its backward is one concatenation instead of a zero-filled copy per slice.
    (qt, qi), (kt, ki), (vt, vi) = (x.split([t, n], dim=-2) for x in (q, k, v))
    text_out = causal_attention(qt, kt, vt)
    b, h, _, d = q.shape
    pad = rows * w - n
    qi, ki, vi = (F.pad(x, (0, 0, 0, pad)) for x in (qi, ki, vi))
    qi = qi * (1.0 / math.sqrt(d))
    # Text keys are shared by every image query: one plain [rows*width, t] product (no per-row broadcast copies).
    text_scores = (qi @ kt.transpose(-1, -2)).view(b, h, rows, w, t)
    qi = qi.view(b, h, rows, w, d)
    if layout.kind == "column":
        mask = column_tables(layout, q.device)[:rows, : t + rows]
        qc = qi.transpose(2, 3)  # [B, H, width, rows, D]: each column a short causal sequence
        kc, vc = (x.view(b, h, rows, w, d).transpose(2, 3) for x in (ki, vi))
        scores = torch.cat([text_scores.transpose(2, 3), qc @ kc.transpose(-1, -2)], dim=-1)
        p_text, p_image = _softmax(scores, mask).split([t, rows], dim=-1)
        image_out = (p_image @ vc).transpose(2, 3)
        p_text = p_text.transpose(2, 3)
    else:
        nb, mask = band_tables(layout, q.device)
        mask = mask[:rows]
        span = (nb + 1) * w
        kb, vb = (_bands(x, nb, rows, w) for x in (ki, vi))  # [B, H, rows, span, D]: key rows r-nb..r
        scores = torch.cat([text_scores, qi @ kb.transpose(-1, -2)], dim=-1)
        p_text, p_image = _softmax(scores, mask).split([t, span], dim=-1)
        image_out = p_image @ vb
    out = p_text.reshape(b, h, rows * w, t) @ vt + image_out.reshape(b, h, rows * w, d)
    return torch.cat([text_out, out[..., :n, :]], dim=-2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """Reference: scaled dot-product attention over the whole ``L x L`` square with the boolean mask."""
    _split(q, layout)
    length = q.shape[-2]
    mask = _dense_mask(layout, q.device)[:length, :length]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layout: AttentionLayout,
                     image_pos: int | torch.Tensor) -> torch.Tensor:
    """One image query ``q: [B, H, 1, D]`` at image index ``image_pos`` against the cache ``kv_cache: [2, B, H, L, D]``
    (keys, values), gathering only the positions of its mask row (text + its few image keys): O(attended) per
    generated token, one gather and one fused attention call per layer. ``image_pos`` may be a one-element tensor
    on the device: every shape is then the same at every position, as a CUDA graph replaying the step needs."""
    index, valid = decode_tables(layout, q.device)
    if isinstance(image_pos, torch.Tensor):
        row, mask = index.index_select(0, image_pos.view(1)).view(-1), valid.index_select(0, image_pos.view(1))
    else:
        row, mask = index[image_pos], valid[image_pos].view(1, -1)
    keys, values = kv_cache.index_select(3, row).unbind(0)
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    # Written out on CPU for the same reason as causal_attention: one query meets few keys.
    return _written_out(q, keys, values, mask)


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto``: ``flex`` on CUDA (the fused kernel; the blocked one is the slowest there and takes 1.6x the
    memory), ``sparse`` elsewhere (FlexAttention has no CPU backward)."""
    if impl == "auto":
        return "flex" if device.type == "cuda" else "sparse"
    return impl


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, impl: str = "sparse"
) -> torch.Tensor:
    """Dispatch to the ``impl`` kernel (``auto``, ``sparse``, ``dense`` or ``flex``)."""
    impl = resolve_impl(impl, q.device)
    if impl == "sparse":
        return sparse_attention(q, k, v, layout)
    if impl == "dense":
        return dense_attention(q, k, v, layout)
    if impl == "flex":
        return flex_attention(q, k, v, layout)
    raise ValueError(f"attn_impl={impl!r}; expected one of {ATTENTION_IMPLS}")
