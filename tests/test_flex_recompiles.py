"""FlexAttention never falls back to its unfused path: one compiled kernel per dtype for every layout and batch.

Counted with dynamo's own counters over what a run meets: the three layouts of the paper's pattern, training-size
batches, a last partial batch, validation batches of another size, and two dtypes. On the CPU only the forward
compiles (torch has no CPU FlexAttention backward), so the CPU test runs forwards; on CUDA a Lightning fit with
validation runs forward and backward. A run that would exceed dynamo's limit fails with one line in strict mode
(the suite's), and in a user's run goes on with the unfused path for the new shapes only, after one line.
"""

from __future__ import annotations

import logging
from typing import Any
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from dalle_lightning.models import recompiles
from dalle_lightning.models import flex
from dalle_lightning.models.flex import FlexRecompileError, compiled_flex, cpu_flex_compiles, flex_block_mask
from dalle_lightning.models.layout import AttentionLayout
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.models.sparse_attention import dense_attention
from dalle_lightning_plugins.fast_paths import reset_reports, strict_fast_paths

# The compiled CPU kernel runs only where torch's CPU vector set is AVX-512 (models/flex.py, cpu_flex_compiles).
needs_compiled_cpu_flex = pytest.mark.skipif(
    not cpu_flex_compiles(), reason=f"this CPU ({torch.backends.cpu.get_cpu_capability()}) runs FlexAttention's eager "
    "kernel: torch's compiled CPU kernel was measured wrong without AVX-512")

TINY = dict(text_vocab_size=64, text_len=8, image_vocab_size=64, image_grid=4, n_layer=6, n_head=2, d_head=16)


def _flex_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
@needs_compiled_cpu_flex
def test_flex_compiles_once_per_dtype_over_layouts_batches_and_validation() -> None:
    torch._dynamo.reset()
    counters.clear()
    recompiles.reset_counts()
    torch.manual_seed(0)
    model = DallePrior(**TINY, attn_impl="flex").eval()
    assert set(model.attention_types()) == {"row", "column", "conv"}
    reference = DallePrior(**TINY, attn_impl="dense").eval()
    reference.load_state_dict(model.state_dict())
    sizes = [16, 16, 16, 5, 24, 24, 3]  # train-size batches, a last partial one, validation batches and its last
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile.*")  # the unfused fallback's warning
        for dtype in (torch.float32, torch.bfloat16):
            for b in sizes:
                text = torch.randint(0, 64, (b, 8))
                image = torch.randint(0, 64, (b, 16))
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    got = model(text, image)["loss"]
                    want = reference(text, image)["loss"]
                torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    # 6 layers x 14 batches: one graph per dtype (the batch dimension is dynamic from the first call), as dynamo
    # counts them and as the run's logs do (compile/graphs/flex_attention)
    assert _flex_graphs() == 2, dict(counters["stats"])
    assert recompiles.graphs_per_region() == {"flex_attention": 2}


@pytest.mark.slow
@needs_compiled_cpu_flex
def test_hitting_the_recompile_limit_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """Strict mode raises :class:`FlexRecompileError`; a user's run gets one line and the unfused path for the new
    shapes (equal to the dense reference), while the kernel compiled before the limit stays in use."""
    torch._dynamo.reset()
    recompiles.reset_counts()
    reset_reports()
    layout = AttentionLayout("row", 5, 3, 3)
    q, k, v = torch.randn(3, 2, 2, 13, 8).unbind(0)  # three inputs: torch 2.11's CPU lowering refuses one for all
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    mask = flex_block_mask(layout, 13, q.device)
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
            compiled_flex(q, k, v, mask)  # the one allowed graph
            with pytest.raises(FlexRecompileError,  # strict mode (the suite's): the one-line error
                               match=r"recompile_limit \(1\) with inputs \(2, 2, 13, 8\) torch.bfloat16"):
                compiled_flex(q16, k16, v16, mask)
            with strict_fast_paths(False), caplog.at_level(logging.WARNING), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*without torch.compile.*")  # the unfused path, expected
                for _ in range(2):
                    got = compiled_flex(q16, k16, v16, mask)
                    torch.testing.assert_close(got, dense_attention(q16, k16, v16, layout), atol=2e-2, rtol=0)
                torch.testing.assert_close(compiled_flex(q, k, v, mask), dense_attention(q, k, v, layout),
                                           atol=1e-5, rtol=0)
        lines = [r.getMessage() for r in caplog.records if "compiling FlexAttention for new input shapes" in r.getMessage()]
        assert len(lines) == 1 and "Turn it off with model.attn_impl=sparse" in lines[0], lines
    finally:
        torch._dynamo.reset()
        recompiles.reset_counts()
        reset_reports()


def test_a_cpu_without_avx512_runs_the_eager_kernel_said_once(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Where the compiled CPU kernel is not used, every call runs the eager kernel (dense attention's values), nothing
    is compiled, and one line says so per process."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(flex, "_CPU_EAGER_SAID", [])
    torch._dynamo.reset()
    recompiles.reset_counts()
    layout = AttentionLayout("conv", 8, 8, 8)
    q, k, v = torch.randn(3, 2, 3, 72, 16).unbind(0)
    mask = flex_block_mask(layout, 72, q.device)
    with torch.no_grad(), caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own unfused-path warning is not printed either
        for _ in range(2):
            torch.testing.assert_close(compiled_flex(q, k, v, mask), dense_attention(q, k, v, layout), atol=1e-5, rtol=0)
    lines = [r.getMessage() for r in caplog.records if "eager kernel on this CPU" in r.getMessage()]
    assert len(lines) == 1 and "(AVX2, no AVX-512)" in lines[0], lines
    assert "flex_attention" not in recompiles.graphs_per_region()  # the project's compiled kernel never ran


def test_a_compiled_region_on_a_cpu_without_avx512_keeps_flex_out_of_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled model (the prior's ``compile=True``) on such a CPU: FlexAttention runs the eager kernel outside the
    graph (dense attention's values), never traced into it, where it would become the compiled CPU kernel."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(flex, "_CPU_EAGER_SAID", [True])
    torch._dynamo.reset()
    layout = AttentionLayout("conv", 8, 8, 8)
    q, k, v = torch.randn(3, 2, 3, 72, 16).unbind(0)
    mask = flex_block_mask(layout, 72, q.device)
    traced: list[str] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    region = torch.compile(lambda q, k, v: compiled_flex(q * 1.0, k, v, mask) + 0.0, backend=recording)
    with torch.no_grad():
        torch.testing.assert_close(region(q, k, v), dense_attention(q, k, v, layout), atol=1e-5, rtol=0)
    torch._dynamo.reset()
    assert traced, "the region was compiled"
    assert not [t for t in traced if "flex" in t], traced


@pytest.mark.cuda
def test_flex_fit_with_validation_and_a_partial_batch_compiles_once_per_dtype_on_cuda(tmp_path) -> None:
    """A real Lightning fit on CUDA (forward and backward through the fused kernel), bf16-mixed, with validation and
    a last partial batch in both loops: the whole fit compiles FlexAttention's forward and backward once."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    class Tokens(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(n)
            self.text, self.image = torch.randint(1, 64, (n, 8), generator=g), torch.randint(0, 64, (n, 16), generator=g)

        def __len__(self) -> int:
            return len(self.text)

        def __getitem__(self, i: int) -> dict:
            return {"text": self.text[i], "image": self.image[i]}

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = DallePrior(**TINY, attn_impl="flex")

        def training_step(self, batch: dict, _: int) -> torch.Tensor:
            return self.model(batch["text"], batch["image"])["loss"]

        def validation_step(self, batch: dict, _: int) -> None:
            self.log("val", self.model(batch["text"], batch["image"])["loss"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch._dynamo.reset()
    counters.clear()
    recompiles.reset_counts()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile.*")
        trainer.fit(Lit(), DataLoader(Tokens(37), batch_size=8), DataLoader(Tokens(21), batch_size=16))
    assert _flex_graphs() <= 2, dict(counters["stats"])  # training (forward + backward) and validation (no grad)
    assert recompiles.graphs_per_region()["flex_attention"] <= 2
