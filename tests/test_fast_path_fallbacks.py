"""Every fast path falls back (``dalle_lightning_plugins.fast_paths``): a compile or a CUDA graph capture that fails
at first use is forced on the CPU (the compile or the capture patched to raise), and each test checks the one line
a user sees, that the run went on, and that its results equal the eager path's, computed independently; strict
mode raises instead. Compiled regions, FlexAttention, the fused gradient boundaries and the decode step's capture,
the last inside a training run's FID and sample-grid callbacks."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from dalle_lightning.generation import graph_decode, sampling
from dalle_lightning.models import flex, prior as prior_module
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.models.layout import AttentionLayout
from dalle_lightning.models.sparse_attention import attention
from dalle_lightning_plugins.precision import boundary_kernels
from dalle_lightning_plugins import fast_paths
from dalle_lightning_plugins.fast_paths import FastPath, strict_fast_paths

COMPILE_ERROR = ("backend='inductor' raised:\n"
                 "CalledProcessError: Command '['gcc', 'kernel.c']' returned non-zero exit status 1.")
CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Fallback mode (whatever the suite's env sets), a fresh errors file, and no fast path marked failed before
    or after (a failure is sticky for the process)."""
    errors = tmp_path / "fast_path_errors.log"
    monkeypatch.setenv(fast_paths.ERRORS_ENV, str(errors))
    fast_paths.reset_reports()
    with strict_fast_paths(False):
        yield errors
    fast_paths.reset_reports()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == fast_paths.__name__]


def check_line(caplog: pytest.LogCaptureFixture, errors: Path, what: str, option: str, error: str) -> None:
    """Exactly one line: what failed, the error's gist, the option that turns the path off, where the error went."""
    (line,) = lines(caplog)
    assert line.startswith(f"{what} failed (") and f"Turn it off with {option}" in line, line
    assert error in line and line.endswith(f"full error in {errors}"), line
    kept = errors.read_text()
    assert kept.startswith(f"--- {what}") and "Traceback (most recent call last)" in kept
    assert error.split(": ")[0] in kept and error.split(": ")[1].rstrip(":") in kept  # the type and the message


# ------------------------------------------------------------------------------------------- the policy itself
def test_a_failure_falls_back_once_reports_once_and_strict_mode_raises(caplog: pytest.LogCaptureFixture,
                                                                      fresh: Path) -> None:
    calls: list[str] = []

    def fast() -> int:
        calls.append("fast")
        raise RuntimeError("no kernel image is available for execution on the device")

    path = FastPath("the test kernel", "test.fused=false")
    assert [path.run(fast, lambda: 7) for _ in range(3)] == [7, 7, 7]
    assert calls == ["fast"]  # sticky: a failed path is not tried again
    check_line(caplog, fresh, "the test kernel", "test.fused=false", "RuntimeError: no kernel image is available")

    second = FastPath("the test kernel", "test.fused=false")  # a second site sharing the name: no second line
    assert second.run(fast, lambda: 8) == 8 and len(lines(caplog)) == 1
    assert fresh.read_text().count("Traceback") == 2  # but both errors are kept

    with strict_fast_paths(True), pytest.raises(RuntimeError, match="no kernel image"):
        FastPath("another kernel", "x=false").run(fast, lambda: 9)


def test_an_error_of_the_input_is_raised_from_the_plain_path_and_keeps_the_fast_one(
        caplog: pytest.LogCaptureFixture) -> None:
    path = FastPath("the test kernel", "test.fused=false")

    def plain() -> int:
        raise ValueError("tokens of shape (3,); expected [batch, 16]")

    with pytest.raises(ValueError, match="expected \\[batch, 16\\]"):
        path.run(lambda: int("x"), plain)
    assert not path.failed and not lines(caplog)
    assert path.run(lambda: 1, lambda: 2) == 1


def test_the_line_reaches_a_script_that_configured_no_logging(tmp_path: Path) -> None:
    """Python's last-resort handler prints a WARNING of an unconfigured logger on stderr: the user sees it."""
    import subprocess
    import sys

    # The module alone, by its path: the package's __init__ would import torch, seconds for nothing here.
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('fast_paths', {fast_paths.__file__!r})\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "module.fall_back(\"CUDA graph capture of the prior's decode step\", 'graphs=false',\n"
            "                 RuntimeError('boom'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "", fast_paths.ERRORS_ENV: str(tmp_path / "e.log")})
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (f"CUDA graph capture of the prior's decode step failed (RuntimeError: boom); "
                                   f"running the eager path instead. Turn it off with graphs=false; full error in "
                                   f"{tmp_path / 'e.log'}")


# ------------------------------------------------------------------------------------------- compiles
def broken(name: str, calls: list[str]) -> Callable[..., Any]:
    """A compiled function failing at its first call, as one does when inductor cannot build its kernels."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        raise RuntimeError(COMPILE_ERROR)

    return call


@pytest.fixture
def broken_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``torch.compile`` returning :func:`broken` functions; the regions and boundary kernels this process compiled
    earlier are compiled anew (and again after the test)."""
    calls: list[str] = []
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: broken(fn.__qualname__, calls))
    for region in (prior_module._QKV, prior_module._OUT, prior_module._MLP):
        monkeypatch.setattr(region._compiled, "_compiled", None)
    boundary_kernels._compiled.cache_clear()
    yield calls
    boundary_kernels._compiled.cache_clear()


def tiny_prior(compile: bool | str) -> DallePrior:  # noqa: A002
    torch.manual_seed(0)
    return DallePrior(text_vocab_size=20, text_len=4, image_vocab_size=16, image_grid=4, n_layer=2, n_head=2,
                      d_head=8, attn_impl="sparse", compile=compile)


def test_a_failed_region_compile_trains_on_the_eager_branches(broken_compile: list[str], fresh: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    text, image = torch.randint(1, 20, (3, 4)), torch.randint(0, 16, (3, 16))
    results = {}
    for compiled in (True, False):
        model = tiny_prior(compiled)
        for _ in range(2):  # a second step tries no compile again
            loss = model(text, image)["loss"]
        loss.backward()
        results[compiled] = (loss, [p.grad for p in model.parameters()])
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    assert sorted(set(broken_compile)) == ["AttentionBranch._out", "AttentionBranch._qkv", "MlpBranch._body"]
    assert len(broken_compile) == 3  # once per region, then eager
    check_line(caplog, fresh, "torch.compile of the model's residual branches", "model.compile=false",
               "RuntimeError: backend='inductor' raised: CalledProcessError")


def test_a_failed_region_compile_raises_in_strict_mode(broken_compile: list[str]) -> None:
    text, image = torch.randint(1, 20, (3, 4)), torch.randint(0, 16, (3, 16))
    with strict_fast_paths(True), pytest.raises(RuntimeError, match="backend='inductor' raised"):
        tiny_prior(True)(text, image)


def test_a_failed_flex_compile_attends_eagerly(monkeypatch: pytest.MonkeyPatch, fresh: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # The compiled flex_attention patched, not torch.compile: torch's eager flex_attention compiles (backend eager).
    calls: list[str] = []
    monkeypatch.setattr(flex._COMPILED_FLEX, "_compiled", broken("flex_attention", calls))
    monkeypatch.setattr(flex, "cpu_flex_compiles", lambda: True)  # the compiled path is tried on any CPU here
    layout = AttentionLayout("conv", n_text=5, height=4, width=4, conv_kernel=3)
    q, k, v = torch.randn(3, 2, 2, 21, 8).unbind(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch's own warning of the unfused path: the line said it
        got = attention(q, k, v, layout, "flex")
        again = attention(q, k, v, layout, "flex")
        want = attention(q, k, v, layout, "dense")  # the reference kernel, written out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, got) and calls == ["flex_attention"]
    check_line(caplog, fresh, "torch.compile of FlexAttention", "model.attn_impl=sparse",
               "RuntimeError: backend='inductor' raised:")
    with strict_fast_paths(True), pytest.raises(RuntimeError, match="inductor"):
        fast_paths.reset_reports()
        attention(q, k, v, layout, "flex")


def test_failed_boundary_kernels_take_the_eager_passes(broken_compile: list[str], fresh: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    grad = torch.randn(4, 6).to(torch.bfloat16)
    grad[1, 2] = float("inf")
    inv_scale, scale = torch.tensor([0.25]), torch.tensor([4.0])
    flag, want_flag = torch.zeros(1), torch.zeros(1)
    got = boundary_kernels.identity_grad(grad, inv_scale, flag, fused=True)
    want = boundary_kernels.identity_grad_eager(grad, inv_scale, want_flag)
    assert torch.equal(got, want) and torch.equal(flag, want_flag) and flag.item() == 1.0
    narrowed = boundary_kernels.branch_grad(want, scale, torch.bfloat16, fused=True)
    assert torch.equal(narrowed, boundary_kernels.branch_grad_eager(want, scale, torch.bfloat16))
    assert sorted(broken_compile) == ["_branch_grad_math", "_identity_grad_math"]
    check_line(caplog, fresh, "the fused gradient-boundary kernels (torch.compile)", "fused_boundaries=False",
               "RuntimeError: backend='inductor' raised:")


# ------------------------------------------------------------------------------------------- CUDA graph capture
def graph_prior() -> DallePrior:
    torch.manual_seed(0)
    return DallePrior(text_vocab_size=50, text_len=6, image_vocab_size=40, image_grid=4, n_layer=2, n_head=2,
                      d_head=16, row_window=2, attn_impl="sparse").eval()


@pytest.fixture
def failing_capture(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The graph path taken on the CPU (``use_graphs`` says yes) with a capture that fails as CUDA's does."""
    calls: list[int] = []

    def capture(step: Callable[[], torch.Tensor], device: torch.device) -> Any:
        calls.append(1)
        raise RuntimeError(CAPTURE_ERROR)

    monkeypatch.setattr(sampling, "use_graphs", lambda mode, device, model=None: mode is not False)
    monkeypatch.setattr(graph_decode, "capture", capture)
    return calls


def test_a_failed_capture_samples_the_eager_tokens(failing_capture: list[int], fresh: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model, text = graph_prior(), torch.randint(1, 50, (4, 6))

    def draw(graphs: bool | str) -> torch.Tensor:
        return sampling.sample_image_tokens(model, text, cond_scale=3.0, top_k=8, graphs=graphs,
                                            generator=torch.Generator().manual_seed(2))

    want = draw(False)
    assert torch.equal(draw("auto"), want) and torch.equal(draw("auto"), want)
    assert failing_capture == [1]  # the second call does not try again
    check_line(caplog, fresh, "CUDA graph capture of the prior's decode step", "graphs=false",
               f"RuntimeError: {CAPTURE_ERROR}")
    fast_paths.reset_reports()
    with strict_fast_paths(True), pytest.raises(RuntimeError, match="stream is capturing"):
        draw("auto")


def replaying_capture(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[Any, torch.Tensor]:
    """A CPU stand-in for torch's CUDA graph: every replay runs the captured step again and writes its result into
    the one output buffer, which the caller holds; the graph's own semantics, without a GPU."""
    out = step()

    class Replay:
        def replay(self) -> None:
            out.copy_(step())

    return Replay(), out


def test_a_graph_step_returns_logits_the_next_replay_does_not_overwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    model, text = graph_prior(), torch.randint(1, 50, (3, 6))
    monkeypatch.setattr(graph_decode, "capture", replaying_capture)
    eager_cache, graph_cache = prior_module.KVCache(), prior_module.KVCache()
    with torch.no_grad():
        logits = model.prefill(text, None, eager_cache)
        model.prefill(text, None, graph_cache)
        step = graph_decode.GraphDecoder(model, graph_cache, torch.zeros(3, dtype=torch.long))
        kept, want = [], []
        for n in range(model.image_len - 1):
            token = logits.argmax(-1)
            logits = model.decode(token, eager_cache)
            kept.append(step(token, n))
            want.append(logits)
    assert step.captures == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, want))  # each one still holds its own step's logits


# ------------------------------------------------------------------------------------------- inside a training run
def fit_with_callbacks(tmp_path: Path) -> tuple[float, torch.Tensor]:
    """One update and one validation with the FID and sample-grid callbacks of the prior; their FID and grid."""
    from dalle_lightning_callbacks.fid import FIDCallback
    from dalle_lightning_callbacks.sample_grid import SampleGrid
    from tests.test_fid import features
    from tests.test_sample_grid import batches, module

    fid = FIDCallback(every_n_epochs=1, num_images=8, feature_extractor=features, feature_dim=12)
    grid = SampleGrid(num_images=4, columns=2, scale=1, dirpath=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=2,
                         num_sanity_val_steps=0, logger=False, callbacks=[fid, grid], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data = DataLoader(batches(), batch_size=None)
    trainer.fit(module(), train_dataloaders=data, val_dataloaders=data)
    assert trainer.state.finished and grid.last_path is not None
    from PIL import Image
    import numpy as np

    return fid.last[fid.metric_name], torch.from_numpy(np.asarray(Image.open(grid.last_path)))


def test_a_failed_capture_in_the_fid_and_grid_callbacks_does_not_end_training(
        monkeypatch: pytest.MonkeyPatch, failing_capture: list[int], fresh: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with monkeypatch.context() as eager:
        eager.setattr(sampling, "use_graphs", lambda mode, device, model=None: False)
        want_fid, want_grid = fit_with_callbacks(tmp_path / "eager")
    got_fid, got_grid = fit_with_callbacks(tmp_path / "graphs")
    assert failing_capture == [1]
    assert got_fid == want_fid and torch.equal(got_grid, want_grid)
    check_line(caplog, fresh, "CUDA graph capture of the prior's decode step", "graphs=false",
               f"RuntimeError: {CAPTURE_ERROR}")
