"""Recompiles of the model's compiled functions: counted per region, warned once, an error only in strict mode.

Dynamo itself decides when a graph is new and when the limit is hit; these tests count its graphs with a backend
that records every graph it is handed and every call of one (as fast as ``eager``: a second or two a test; the
plugins' test compiles one C++ kernel), and compare every result with the function run eagerly. The suite runs in strict mode (tests/conftest.py); the
tests of a user's run turn it off.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dalle_lightning.models import recompiles
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.models.recompiles import CompiledFunction, RecompileLimitError, graphs_per_region, settle
from dalle_lightning_plugins.fast_paths import ERRORS_ENV, reset_reports, strict, strict_fast_paths

TINY = dict(text_vocab_size=32, text_len=4, image_vocab_size=32, image_grid=2, n_layer=2, n_head=2, d_head=8)


class Recording:
    """A ``torch.compile`` backend that runs each graph as it is and counts graphs and their calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


def _affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@pytest.fixture
def fresh() -> Iterator[None]:
    """Dynamo's caches, the functions' counts and the fast-path reports as a new process has them."""
    torch._dynamo.reset()
    recompiles.reset_counts()
    reset_reports()
    yield
    torch._dynamo.reset()
    recompiles.reset_counts()
    reset_reports()
    recompiles._FUNCTIONS.pop("test.affine", None)


def test_the_suite_runs_in_strict_mode() -> None:
    assert strict()


def test_a_limit_hit_in_a_users_run_is_one_line_and_only_the_new_shapes_run_eagerly(
    fresh: None, caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ERRORS_ENV, str(tmp_path / "errors.log"))
    backend = Recording()
    f = CompiledFunction("test.affine", _affine, option="model.compile=false", backend=backend)
    x = torch.arange(6.0)
    with strict_fast_paths(False), torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        assert f(x).equal(_affine(x))  # the one graph the limit allows
        for dtype in (torch.float64, torch.float16, torch.float64):  # new shapes past the limit: eager, no error
            y = x.to(dtype)
            assert f(y).equal(_affine(y))
        calls = backend.calls
        assert f(x).equal(_affine(x))
    assert backend.calls == calls + 1, "the graph compiled before the limit must stay in use"
    assert (backend.graphs, f.graphs, f.limit_hits) == (1, 1, 1)
    lines = [r.getMessage() for r in caplog.records if "test.affine" in r.getMessage()]
    assert lines == [
        "compiling the model's regions for new input shapes failed (RecompileLimitError: test.affine hit "
        "torch._dynamo.config.recompile_limit (1) with inputs (6,) torch.float64); running the eager path instead. "
        f"Turn it off with model.compile=false; full error in {tmp_path / 'errors.log'}"
    ]
    assert "FailOnRecompileLimitHit" in (tmp_path / "errors.log").read_text()  # dynamo's own error, in full


def test_a_limit_hit_in_strict_mode_raises_one_line_every_time(fresh: None) -> None:
    f = CompiledFunction("test.affine", _affine, option="model.compile=false", backend=Recording())
    x = torch.arange(6.0)
    with torch._dynamo.config.patch(recompile_limit=1):  # strict: the suite's default
        f(x)
        for _ in range(2):  # a raised limit is not turned into a silent fallback for the next call
            with pytest.raises(RecompileLimitError, match=r"^test\.affine hit torch\._dynamo\.config\.recompile_limit "
                               r"\(1\) with inputs \(6,\) torch\.float64\nexpected at most 1 graphs: raise the limit, "
                               r"or turn compiling off with model\.compile=false$"):
                f(x.double())
        assert f(x).equal(_affine(x))
    assert f.limit_hits == 2


def test_the_batch_dimension_is_dynamic_from_the_first_call(fresh: None) -> None:
    """Training batches, the last partial batch and validation batches of another size: one graph, not three."""
    backend = Recording()
    f = CompiledFunction("test.affine", _affine, option="model.compile=false", backend=backend)
    for b in (16, 16, 5, 24, 3):
        x = torch.randn(b, 4)
        assert f(x).equal(_affine(x))
    assert (f.graphs, backend.graphs) == (1, 1)
    static = CompiledFunction("test.affine", _affine, option="model.compile=false", backend=Recording(),
                              dynamic_batch=False)
    for b in (16, 5):
        static(torch.randn(b, 4))
    assert static.graphs == 2  # without the mark, dynamo compiles again before it makes the size dynamic


def test_a_graph_after_start_up_is_warned_once_per_process_and_counted(
    fresh: None, caplog: pytest.LogCaptureFixture
) -> None:
    f = CompiledFunction("test.affine", _affine, option="model.compile=false", backend=Recording())
    x = torch.arange(6.0)
    with caplog.at_level(logging.WARNING):
        f(x)
        f(x.double())  # start-up: counted, no line
        settle()
        f(x.half())
        f(torch.arange(6))
        f(x)  # compiled already: nothing new
    lines = [r.getMessage() for r in caplog.records if "after start-up" in r.getMessage()]
    assert lines == [
        "test.affine compiled graph 3 after start-up, for inputs (6,) torch.float16 (a shape or mode the first epoch "
        "did not bring); recompiles are counted per region in compile/graphs/* and not printed again. At 8 graphs a "
        "region runs new shapes eagerly (strict mode, DALLE_LIGHTNING_STRICT_FAST_PATHS=1, raises there)."
    ]
    assert graphs_per_region()["test.affine"] == 4


def test_a_fit_compiles_validation_at_start_up_and_logs_graphs_per_region(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The prior's real regions in a Lightning fit (two epochs, validation, last partial batches in both loops):
    the validation graphs exist before the first update (a sanity-check batch the callback adds, which leaves the
    random generators as they were), nothing compiles after the first epoch, the CSV log holds each region's graphs
    (one with gradients in training, one in validation), and the loss is the uncompiled model's."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from dalle_lightning.lit.compiled_graphs import CompiledGraphs

    for f in recompiles._FUNCTIONS.values():  # the regions as they are, traced and guarded; run without inductor
        monkeypatch.setattr(f, "backend", Recording())
        monkeypatch.setattr(f, "_compiled", None)
    regions = ("prior.AttentionBranch._qkv", "prior.AttentionBranch._out", "prior.MlpBranch._body")

    class Lit(pl.LightningModule):
        def __init__(self, compile: bool) -> None:  # noqa: A002 - the model's own argument
            super().__init__()
            torch.manual_seed(0)
            self.model = DallePrior(**TINY, attn_impl="sparse", compile=compile)
            self.at_first_update: dict[str, int] | None = None
            self.rng_at_first_update: torch.Tensor | None = None

        def on_train_start(self) -> None:
            self.at_first_update = graphs_per_region()
            self.rng_at_first_update = torch.get_rng_state()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            return self.model(*batch)["loss"]

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
            torch.rand(())  # validation draws, as the dVAE's Gumbel noise does
            self.log("val/loss", self.model(*batch)["loss"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(1, 32, (14, 4), generator=g), torch.randint(0, 32, (14, 4), generator=g))
    losses, modules = [], []
    for compile_ in (False, True):
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=CSVLogger(tmp_path, name=str(compile_)),
                             callbacks=[CompiledGraphs()], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1)
        modules.append(Lit(compile_))
        with caplog.at_level(logging.WARNING):
            trainer.fit(modules[-1], DataLoader(data, batch_size=4), DataLoader(data, batch_size=6))  # last: 2, 2
        losses.append(trainer.callback_metrics["val/loss"])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    assert modules[0].at_first_update == {}  # uncompiled: no sanity check added, nothing compiled
    assert modules[1].at_first_update == {r: 1 for r in regions}  # the validation graphs, before any update
    assert modules[1].rng_at_first_update.equal(modules[0].rng_at_first_update)  # training draws as without it
    assert not [r for r in caplog.records if "after start-up" in r.getMessage()]
    with open(next((tmp_path / "True").rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    last = {k: float(v) for row in rows for k, v in row.items() if k.startswith("compile/") and v}
    assert last == {**{f"compile/graphs/{r}": 2.0 for r in regions}, "compile/limit_hits": 0.0}


def test_the_plugins_boundary_kernels_hit_the_limit_as_the_models_regions_do(
    fresh: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The plugins keep their own policy (they never import ``dalle_lightning``): the limit raised for the boundary
    functions and made an error, which their fast path reports in one line (eager passes, equal values) or raises
    in strict mode."""
    from dalle_lightning_plugins.precision import boundary_kernels

    monkeypatch.setenv(ERRORS_ENV, str(tmp_path / "errors.log"))
    monkeypatch.setattr(boundary_kernels, "_RECOMPILE_LIMIT", 1)
    grad, scale = torch.randn(4, 8), torch.tensor(256.0)
    with torch._dynamo.config.patch(recompile_limit=1):
        first = boundary_kernels.branch_grad(grad, scale, torch.bfloat16, fused=True)  # the one graph allowed
        assert first.equal(boundary_kernels.branch_grad_eager(grad, scale, torch.bfloat16))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # strict: dynamo's error, not a slow path
            boundary_kernels.branch_grad(grad, scale, torch.float16, fused=True)
        with strict_fast_paths(False), caplog.at_level(logging.WARNING):
            for _ in range(2):
                got = boundary_kernels.branch_grad(grad, scale, torch.float16, fused=True)
                assert got.equal(boundary_kernels.branch_grad_eager(grad, scale, torch.float16))
    lines = [r.getMessage() for r in caplog.records if "gradient-boundary" in r.getMessage()]
    assert len(lines) == 1 and "FailOnRecompileLimitHit" in lines[0], lines
