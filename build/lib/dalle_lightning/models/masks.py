"""Dense boolean attention masks of the DALL-E prior: the reference every efficient kernel is tested against.

The prior sees one stream: a *text region* of ``n_text`` positions (the learned start vector, then the caption
tokens) followed by an *image region* of ``height * width`` positions in raster order. All masks are ``True``
where a query (row) may attend to a key (column) and are causal: nobody sees a later position.

- text -> text: causal; text -> image: never (the image comes later);
- image -> text: always (all text keys share the image queries' softmax);
- image -> image, one of three kinds (paper, appendix B.1 / figure 11), with ``a`` the query's and ``b`` the key's
  raster index inside the image and ``(r, c)`` their row and column:

  * ``row``: ``0 <= a - b <= window``: the previous ``window`` tokens and itself. With the default
    ``window = width`` that reaches back exactly to the same column one row up (``width + 1`` keys).
  * ``column``: ``b <= a`` and ``c_b == c_a``: the query's own column in earlier rows, and itself.
  * ``conv``: the *causal neighbourhood* of a ``kernel x kernel`` window centred on the query:
    ``b <= a``, ``|r_a - r_b| <= kernel // 2`` and ``|c_a - c_b| <= kernel // 2``. So the ``kernel // 2`` rows
    above (full kernel width, clipped at the borders) plus the query's own row up to and including itself; for the
    paper's 11x11 that is at most 5 * 11 + 6 = 61 keys.

Windows scale with the grid by default (see :func:`default_conv_kernel`) so tiny demo grids keep the paper's
proportions. These builders are vectorised but O(N^2) in memory: use them for tests, the dense reference path
and to derive the compact index tables of the sparse kernels, never per step.
"""

from __future__ import annotations

import torch

ATTENTION_KINDS = ("row", "column", "conv")


def layer_pattern(n_layer: int) -> list[str]:
    """The paper's per-layer attention kinds: for layer ``i = 1..n_layer-1`` ``column`` if ``(i - 2) % 4 == 0``
    else ``row``; the last layer ``conv``. For 64 layers: 47 row, 16 column, 1 conv; it begins row, column, row, row.
    """
    if n_layer < 1:
        raise ValueError(f"n_layer={n_layer}; expected at least 1 layer")
    kinds = ["column" if (i - 2) % 4 == 0 else "row" for i in range(1, n_layer)]
    return kinds + ["conv"]


def default_row_window(width: int) -> int:
    """``width``: back to the same column one row up (the paper's 4x4 figure)."""
    return width


def default_conv_kernel(width: int) -> int:
    """The paper's 11x11 on a 32-wide grid, scaled to ``width`` and rounded up to an odd size of at least 3."""
    k = max(3, round(11 * width / 32))
    return k if k % 2 == 1 else k + 1


def check_kind(kind: str) -> str:
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {kind!r} is unknown; expected one of {ATTENTION_KINDS}")
    return kind


def image_mask(
    kind: str,
    height: int,
    width: int,
    *,
    row_window: int | None = None,
    conv_kernel: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool[N, N] image -> image mask (``N = height * width``) of the given ``kind``, see the module docstring."""
    check_kind(kind)
    if height < 1 or width < 1:
        raise ValueError(f"grid {height}x{width}; expected positive height and width")
    n = height * width
    a = torch.arange(n, device=device).view(n, 1)
    b = torch.arange(n, device=device).view(1, n)
    causal = b <= a
    if kind == "row":
        window = default_row_window(width) if row_window is None else row_window
        if window < 0:
            raise ValueError(f"row_window={window}; expected a number of earlier tokens >= 0")
        return causal & (a - b <= window)
    if kind == "column":
        return causal & (a % width == b % width)
    kernel = default_conv_kernel(width) if conv_kernel is None else conv_kernel
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"conv_kernel={kernel}; expected a positive odd size")
    half = kernel // 2
    near_rows = (a // width - b // width).abs() <= half
    near_cols = (a % width - b % width).abs() <= half
    return causal & near_rows & near_cols


def text_causal_mask(n_text: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool[n_text, n_text] lower-triangular mask of the text region."""
    return torch.ones(n_text, n_text, dtype=torch.bool, device=device).tril()


def full_mask(
    kind: str,
    n_text: int,
    height: int,
    width: int,
    *,
    row_window: int | None = None,
    conv_kernel: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool[L, L] mask of the whole stream, ``L = n_text + height * width``: text causal, text -> image never,
    image -> text always, image -> image by ``kind``."""
    n = height * width
    mask = torch.zeros(n_text + n, n_text + n, dtype=torch.bool, device=device)
    mask[:n_text, :n_text] = text_causal_mask(n_text, device)
    mask[n_text:, :n_text] = True
    mask[n_text:, n_text:] = image_mask(
        kind, height, width, row_window=row_window, conv_kernel=conv_kernel, device=device
    )
    return mask
