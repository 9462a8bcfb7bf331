"""The attention layout of the DALL-E prior: which key each query may see, written once for every kernel.

The prior sees one stream: a *text region* of ``n_text`` positions (the learned start vector, then the caption
tokens) followed by an *image region* of ``height * width`` positions in raster order. A query (row) may attend to
a key (column) where :func:`visible` says so; every layout is causal: nobody sees a later position.

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

Why one rule in one module: the dense reference (a boolean mask), the blocked kernel (index tables derived from
that mask, :mod:`dalle_lightning.models.sparse_attention`) and FlexAttention (a ``mask_mod`` evaluated per block,
:mod:`dalle_lightning.models.flex`) all read :func:`visible`, so a change of geometry reaches every kernel at once
instead of being kept in step by a test. :func:`visible` is index arithmetic over integer tensors with the layout's
numbers in a tensor too (:meth:`AttentionLayout.params`): the dense builders call it on broadcast ``arange``\\ s, and
FlexAttention traces it with scalar indices, where numbers held in a tensor keep dynamo from guarding on each
layout (see :mod:`dalle_lightning.models.flex`).

Windows scale with the grid by default (see :func:`default_conv_kernel`) so tiny demo grids keep the paper's
proportions. The dense builders are O(N^2) in memory: use them for tests, the dense reference path and to derive
the compact index tables of the blocked kernel, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_KINDS = ("row", "column", "conv")
KIND_CODES = {kind: code for code, kind in enumerate(ATTENTION_KINDS)}  # the kind as :func:`visible` reads it


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
    """``kind`` if it is one of :data:`ATTENTION_KINDS`, else a one-line error naming it."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {kind!r} is unknown; expected one of {ATTENTION_KINDS}")
    return kind


def visible(q: torch.Tensor, kv: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Whether stream position ``q`` may attend to stream position ``kv`` (integer tensors that broadcast).

    ``params`` is :meth:`AttentionLayout.params`, ``int[5]``: the kind's code, ``n_text``, ``width``, the row
    ``window`` and the conv ``kernel // 2``. The three kinds' conditions are all computed and one is picked with
    ``where``, so the same code serves every layout without a Python branch on the kind (FlexAttention compiles it
    once for all layouts).
    """
    kind, t, w, window, half = params[0], params[1], params[2], params[3], params[4]
    qi, ki = q - t, kv - t  # raster indices inside the image (negative in the text region)
    row_ok = qi - ki <= window
    column_ok = (qi % w) == (ki % w)
    conv_ok = (torch.abs(qi // w - ki // w) <= half) & (torch.abs(qi % w - ki % w) <= half)
    image_ok = torch.where(kind == KIND_CODES["row"], row_ok,
                           torch.where(kind == KIND_CODES["column"], column_ok, conv_ok))
    # Text queries see earlier text only (causality suffices); image queries see all text and their image keys.
    return (kv <= q) & ((kv < t) | ((q >= t) & image_ok))


@dataclass(frozen=True)
class AttentionLayout:
    """Geometry of one attention layer: its image->image kind, the text-region length and the image grid.

    ``row_window`` and ``conv_kernel`` default to the grid-scaled sizes (:func:`default_row_window`,
    :func:`default_conv_kernel`); each is checked where its kind uses it. Frozen and hashable: the kernels cache
    their index tables and block masks per layout.
    """

    kind: str
    n_text: int
    height: int
    width: int
    row_window: int | None = None
    conv_kernel: int | None = None

    def __post_init__(self) -> None:
        check_kind(self.kind)
        if self.n_text < 1:
            raise ValueError(f"n_text={self.n_text}; expected at least 1 text position (the start token)")
        if self.height < 1 or self.width < 1:
            raise ValueError(f"grid {self.height}x{self.width}; expected positive height and width")
        if self.kind == "row" and self.window < 0:
            raise ValueError(f"row_window={self.window}; expected a number of earlier tokens >= 0")
        if self.kind == "conv" and (self.kernel < 1 or self.kernel % 2 == 0):
            raise ValueError(f"conv_kernel={self.kernel}; expected a positive odd size")

    @property
    def n_image(self) -> int:
        return self.height * self.width

    @property
    def length(self) -> int:
        """Positions of the whole stream: ``n_text + height * width``."""
        return self.n_text + self.n_image

    @property
    def window(self) -> int:
        return default_row_window(self.width) if self.row_window is None else self.row_window

    @property
    def kernel(self) -> int:
        return default_conv_kernel(self.width) if self.conv_kernel is None else self.conv_kernel

    def image_positions(self, length: int) -> int:
        """How many image positions a sequence of ``length`` stream positions holds (``<= 0``: text only); a
        sequence longer than the stream is a one-line error."""
        if length > self.length:
            raise ValueError(
                f"sequence of {length} positions; expected at most n_text + height * width = {self.length}"
            )
        return length - self.n_text

    def params(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``int32[5]`` for :func:`visible`: the kind's code, ``n_text``, ``width``, row ``window``, ``kernel // 2``."""
        values = [KIND_CODES[self.kind], self.n_text, self.width, self.window, self.kernel // 2]
        return torch.tensor(values, dtype=torch.int32, device=device)

    def mask(self, start: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[L - start, L - start]``: :func:`visible` for queries and keys at stream positions ``start .. L``."""
        idx = torch.arange(start, self.length, device=device)
        return visible(idx.view(-1, 1), idx.view(1, -1), self.params(device))

    def full_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[L, L]`` over the whole stream."""
        return self.mask(0, device)

    def image_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[N, N]``: the image -> image block (``N = height * width``)."""
        return self.mask(self.n_text, device)


def text_causal_mask(n_text: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool[n_text, n_text] lower-triangular mask: the text region (and the blocked kernel's transposed columns,
    each a short causal sequence)."""
    return torch.ones(n_text, n_text, dtype=torch.bool, device=device).tril()
