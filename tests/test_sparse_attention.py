"""Masks by hand, and every efficient attention kernel against the dense-mask reference (forward and backward)."""

from __future__ import annotations

import pytest
import torch

from dalle_lightning.models.flex import flex_attention
from dalle_lightning.models.layout import AttentionLayout, default_conv_kernel, layer_pattern
from dalle_lightning.models.sparse_attention import band_tables, decode_attention, dense_attention, sparse_attention


def image_mask(kind: str, height: int, width: int, **sizes: int) -> torch.Tensor:
    """The image -> image block of a layout (it does not depend on the text region's length)."""
    return AttentionLayout(kind, 1, height, width, **sizes).image_mask()


def full_mask(kind: str, n_text: int, height: int, width: int) -> torch.Tensor:
    return AttentionLayout(kind, n_text, height, width).full_mask()


def keys(mask: torch.Tensor, query: int) -> set[int]:
    return set(mask[query].nonzero().flatten().tolist())


# ---------------------------------------------------------------------------------------------- masks by hand
def test_row_mask_4x4_by_hand():
    m = image_mask("row", 4, 4)  # default window = width = 4: back to the same column one row up
    assert keys(m, 0) == {0}
    assert keys(m, 2) == {0, 1, 2}
    assert keys(m, 6) == {2, 3, 4, 5, 6}  # (1,2) sees (0,2), (0,3), (1,0), (1,1), itself
    assert keys(m, 15) == {11, 12, 13, 14, 15}
    assert int(m.sum()) == 1 + 2 + 3 + 4 + 5 * 12
    assert int(image_mask("row", 4, 4, row_window=1).sum()) == 1 + 2 * 15


def test_column_mask_4x4_by_hand():
    m = image_mask("column", 4, 4)
    assert keys(m, 1) == {1}
    assert keys(m, 13) == {1, 5, 9, 13}
    assert int(m.sum()) == 4 * (1 + 2 + 3 + 4)  # each column is causal over its 4 rows


def test_conv_mask_4x4_by_hand():
    m = image_mask("conv", 4, 4, conv_kernel=3)  # causal part of a 3x3 window centred on the query
    assert keys(m, 0) == {0}
    assert keys(m, 5) == {0, 1, 2, 4, 5}
    assert keys(m, 7) == {2, 3, 6, 7}  # right border clips the window
    assert keys(m, 12) == {8, 9, 12}  # left border
    # row 0: 1 + 2 + 2 + 2; rows 1..3: above row has 2 (border) or 3 keys, own row 1 or 2.
    per_row_above = 2 + 3 + 3 + 2
    per_row_own = 1 + 2 + 2 + 2
    assert int(m.sum()) == per_row_own + 3 * (per_row_above + per_row_own)


def test_conv_kernel_scales_with_grid():
    assert default_conv_kernel(32) == 11  # the paper's 11x11 on 32x32
    assert default_conv_kernel(8) == 3
    assert all(default_conv_kernel(w) % 2 == 1 for w in range(1, 65))


def test_full_mask_blocks():
    m = full_mask("row", 3, 2, 2)
    assert m[:3, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert not m[:3, 3:].any()  # text never sees the image
    assert m[3:, :3].all()  # image sees all text
    assert not m.triu(1).any()  # causal


def test_paper_layer_pattern():
    kinds = layer_pattern(64)
    assert kinds[:4] == ["row", "column", "row", "row"] and kinds[-1] == "conv"
    assert (kinds.count("row"), kinds.count("column"), kinds.count("conv")) == (47, 16, 1)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'diagonal'"):
        image_mask("diagonal", 4, 4)
    with pytest.raises(ValueError, match="conv_kernel=4"):
        image_mask("conv", 4, 4, conv_kernel=4)
    with pytest.raises(ValueError, match="at most"):
        q = torch.zeros(1, 1, 3 + 17, 4)
        sparse_attention(q, q, q, AttentionLayout("row", 3, 4, 4))


def test_band_is_narrow_at_paper_shape():
    """Sparse means the band spans 2 rows (row) or kernel//2 + 1 rows (conv) of the 32x32 grid, not all 32."""
    nb_row, mask_row = band_tables(AttentionLayout("row", 257, 32, 32), torch.device("cpu"))
    nb_conv, _ = band_tables(AttentionLayout("conv", 257, 32, 32), torch.device("cpu"))
    assert (nb_row, nb_conv) == (1, 5)
    assert mask_row.shape == (32, 32, 257 + 2 * 32)


# ---------------------------------------------------------------------------------------------- kernels
SETTINGS = [  # (n_text, height, width, row_window, conv_kernel)
    (8, 8, 8, None, None),
    (7, 5, 5, None, None),
    (7, 4, 6, 9, 5),  # non-square grid, window reaching two rows back, wider kernel
]


def qkv(length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length, 16, generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("kind", ["row", "column", "conv"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("partial", [False, True])
def test_sparse_matches_dense_forward_and_backward(kind, setting, partial):
    t, h, w, window, kernel = setting
    layout = AttentionLayout(kind, t, h, w, window, kernel)
    length = t + h * w - (w + 2 if partial else 0)  # partial: the image stops mid-row (as while sampling)
    grad_out = torch.randn(2, 3, length, 16, generator=torch.Generator().manual_seed(9))
    results = []
    for fn in (sparse_attention, dense_attention):
        q, k, v = qkv(length)
        out = fn(q, k, v, layout)
        (out * grad_out).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["row", "column", "conv"])
def test_no_query_sees_a_later_position(kind):
    layout = AttentionLayout(kind, 7, 5, 5)
    q, k, v = (x.detach() for x in qkv(32))
    base = sparse_attention(q, k, v, layout)
    for later in (3, 7, 12, 31):  # text and image positions
        k2, v2 = k.clone(), v.clone()
        k2[..., later, :] += 5.0
        v2[..., later, :] -= 5.0
        out = sparse_attention(q, k2, v2, layout)
        torch.testing.assert_close(out[..., :later, :], base[..., :later, :], atol=0, rtol=0)
        assert not torch.allclose(out[..., later, :], base[..., later, :])


@pytest.mark.parametrize("kind", ["row", "column", "conv"])
def test_decode_attention_matches_dense_rows(kind):
    t, h, w = 7, 5, 5
    layout = AttentionLayout(kind, t, h, w)
    q, k, v = (x.detach() for x in qkv(t + h * w))
    want = dense_attention(q, k, v, layout)
    for n in (0, 4, 5, 13, 24):
        got = decode_attention(q[..., t + n : t + n + 1, :], torch.stack([k, v]), layout, n)
        torch.testing.assert_close(got, want[..., t + n : t + n + 1, :], atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_matches_dense_on_cpu():
    """On CPU FlexAttention runs unfused (forward only): enough to check the block mask end to end."""
    layout = AttentionLayout("conv", 8, 8, 8)
    q, k, v = (x.detach() for x in qkv(72))
    torch.testing.assert_close(flex_attention(q, k, v, layout), dense_attention(q, k, v, layout), atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["row", "column", "conv"])
def test_flex_on_cuda_matches_dense_forward_and_backward(kind):
    """On CUDA FlexAttention is compiled into the fused block-sparse kernel the paper config uses (attn_impl=flex)."""
    layout = AttentionLayout(kind, 8, 8, 8)
    grad_out = torch.randn(2, 3, 72, 16, generator=torch.Generator().manual_seed(9)).cuda()
    results = []
    for fn in (flex_attention, dense_attention):
        q, k, v = (x.detach().cuda().requires_grad_() for x in qkv(72))
        out = fn(q, k, v, layout)
        (out * grad_out).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
