"""The attention layout's one rule (``models/layout.py``) against the paper's definitions, and the model modules'
imports without a circle.

The reference here is written apart from the project's code: each query and key placed on the grid by its row and
column, and the paper's three kinds applied to those coordinates in plain Python. The dense mask and the
FlexAttention ``mask_mod`` (evaluated by torch's ``create_mask``, as FlexAttention evaluates it) must equal it; the
blocked and decode kernels are checked against the dense mask in ``test_sparse_attention.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from dalle_lightning.models.flex import flex_block_mask, flex_mask_mod
from dalle_lightning.models.layout import AttentionLayout

MODELS = Path(__file__).resolve().parents[1] / "dalle_lightning" / "models"
LAYOUTS = [  # (n_text, height, width, row_window, conv_kernel)
    (8, 8, 8, None, None),
    (7, 5, 5, None, None),
    (7, 4, 6, 9, 5),  # non-square grid, window reaching two rows back, wider kernel
    (1, 3, 7, 0, 1),  # one text position, a window of the query alone, a 1x1 kernel
]


def paper_mask(kind: str, n_text: int, height: int, width: int, window: int, kernel: int) -> torch.Tensor:
    """Query by query, key by key: causal; text sees earlier text; image sees all text and, by ``kind``, the
    previous ``window`` image tokens (row), its own column (column), or the causal part of the ``kernel`` window
    around it (conv)."""
    length = n_text + height * width
    rows = []
    for q in range(length):
        row = []
        for k in range(length):
            if k > q:
                seen = False
            elif k < n_text:
                seen = True
            elif q < n_text:
                seen = False  # text never sees the image
            else:
                (rq, cq), (rk, ck) = divmod(q - n_text, width), divmod(k - n_text, width)
                if kind == "row":
                    seen = (q - k) <= window
                elif kind == "column":
                    seen = cq == ck
                else:
                    seen = abs(rq - rk) <= kernel // 2 and abs(cq - ck) <= kernel // 2
            row.append(seen)
        rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("kind", ["row", "column", "conv"])
@pytest.mark.parametrize("setting", LAYOUTS)
def test_dense_and_flex_masks_are_the_papers(kind: str, setting: tuple) -> None:
    layout = AttentionLayout(kind, *setting)
    want = paper_mask(kind, layout.n_text, layout.height, layout.width, layout.window, layout.kernel)
    assert layout.full_mask().equal(want)
    assert layout.image_mask().equal(want[layout.n_text :, layout.n_text :])
    flex = create_mask(flex_mask_mod(layout), 1, 1, layout.length, layout.length, "cpu")
    assert flex[0, 0].equal(want)
    assert flex_block_mask(layout, layout.length, torch.device("cpu")).shape[-2:] == (layout.length, layout.length)


def test_the_default_windows_are_the_papers_at_32_wide() -> None:
    layout = AttentionLayout("conv", 257, 32, 32)
    assert (layout.window, layout.kernel) == (32, 11)
    inner = 10 * 32 + 15  # a query 5 rows and columns or more from every border
    assert int(layout.image_mask()[inner].sum()) == 5 * 11 + 6  # the paper's 11x11: 5 rows above, 6 of its own


def test_each_size_is_checked_where_its_kind_uses_it() -> None:
    AttentionLayout("row", 3, 4, 4, conv_kernel=4)  # a conv size a row layer never reads
    with pytest.raises(ValueError, match="conv_kernel=4"):
        AttentionLayout("conv", 3, 4, 4, conv_kernel=4)
    with pytest.raises(ValueError, match="row_window=-1"):
        AttentionLayout("row", 3, 4, 4, row_window=-1)
    with pytest.raises(ValueError, match="grid 0x4"):
        AttentionLayout("column", 3, 0, 4)


def _model_imports(path: Path) -> set[str]:
    """The ``dalle_lightning.models`` modules a file imports, at any depth (type-checking blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dalle_lightning.models."):
            found.add(node.module.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[-1] for a in node.names if a.name.startswith("dalle_lightning.models.")}
    return found


def test_the_model_modules_import_one_another_without_a_circle() -> None:
    graph = {p.stem: _model_imports(p) for p in MODELS.glob("*.py")}
    assert graph["layout"] == set(), "the geometry imports none of the kernels"
    assert {"layout"} <= graph["flex"] and "sparse_attention" not in graph["flex"]
    assert {"layout", "flex"} <= graph["sparse_attention"]

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        for dep in graph.get(name, ()):
            visit(dep, (*path, name))

    for name in graph:
        visit(name, ())
