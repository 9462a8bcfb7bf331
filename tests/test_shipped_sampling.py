"""Sampling in the compute dtype where the project samples, and the fast-path errors file where a run keeps its logs.

- ``dalle-generate dtype=auto|fp32|bf16|fp16``: the prior's weights cast once (``generation/cast.py``); ``auto`` is
  bf16 on a GPU that computes it natively and fp32 elsewhere, so on the CPU the tokens are those of the fp32 prior
  (a bad value is one line: ``tests/test_bad_inputs.py``).
- The FID and sample-grid callbacks sample (``PriorModule.fid_generate``) in the training precision's compute dtype:
  ``32-true`` the fp32 model itself, ``bf16-mixed`` and the precision plugin in bf16 a bf16 copy, without autocast.
- Every command sets ``DALLE_LIGHTNING_FAST_PATH_ERRORS`` to ``<run dir>/fast_path_errors.log`` unless the user set
  it, so a fallback's one line names a file beside the run's log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from dalle_lightning import hardware
from dalle_lightning.generation import graph_decode, sampling
from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins import fast_paths
from dalle_lightning_plugins.fast_paths import strict_fast_paths
from tests.conftest import CONF, run_app
from tests.test_eval_report import work  # noqa: F401  (the tiny saved pipeline)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[DallePrior, torch.dtype, bool]]:
    """For every decode step: the module it ran, the dtype of that module's layer weights, whether autocast was on."""
    record: list[tuple[DallePrior, torch.dtype, bool]] = []
    decode_at = DallePrior.decode_at

    def decoding(self: DallePrior, *args: Any) -> torch.Tensor:
        record.append((self, self.layers[0].mlp.fc.weight.dtype, torch.is_autocast_enabled("cpu")))
        return decode_at(self, *args)

    monkeypatch.setattr(DallePrior, "decode_at", decoding)
    return record


# ------------------------------------------------------------------------------------------------ dalle-generate
def generate(work: Path, out: Path, *overrides: str) -> Any:  # noqa: F811
    from dalle_lightning.cli import generate as app

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return app.run(compose("generate", overrides=[f"paths.work_dir={work}", "clip=null", "num_candidates=2",
                                                      "prompts=[a red square,a blue circle]", f"out_dir={out}",
                                                      *overrides]))


def test_dalle_generate_samples_in_its_dtype_and_auto_is_fp32_on_the_cpu(
        work: Path, steps: list[tuple[DallePrior, torch.dtype, bool]]) -> None:  # noqa: F811
    from dalle_lightning.generation.generate import Generator

    auto = generate(work, work / "auto")
    assert steps and {(dtype, autocast) for _, dtype, autocast in steps} == {(torch.float32, False)}
    steps.clear()
    bf16 = generate(work, work / "bf16", "dtype=bf16")
    assert steps and {(dtype, autocast) for _, dtype, autocast in steps} == {(torch.bfloat16, False)}
    assert len({id(module) for module, _, _ in steps}) == 1  # one copy for the whole command
    gen = Generator.from_files(work / "prior.pt", work / "dvae.pt", work / "tokenizer.json", dtype="bf16")
    want = gen.generate(["a red square", "a blue circle"], num_candidates=2, cond_scale=2.5, graphs=False)
    assert torch.equal(bf16.tokens, want.tokens)
    fp32 = Generator.from_files(work / "prior.pt", work / "dvae.pt", work / "tokenizer.json")
    assert torch.equal(auto.tokens, fp32.generate(["a red square", "a blue circle"], num_candidates=2,
                                                  cond_scale=2.5, graphs=False).tokens)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_on_a_gpu_that_has_it_and_fp32_on_any_cpu(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(hardware, "native_bf16", lambda accelerator="cpu": native)
    want = "bf16" if native else "fp32"
    assert hardware.auto_sampling_dtype("cuda") == hardware.auto_sampling_dtype("cuda:1") == want
    assert hardware.auto_sampling_dtype("cpu") == "fp32"


# ------------------------------------------------------------------------------------- the callbacks in training
def plugin_bf16() -> Any:
    from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision

    return ResblockScalingPrecision(dtype="bf16")


@pytest.mark.parametrize("precision,want", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                            (plugin_bf16, torch.bfloat16)],
                         ids=["32-true", "bf16-mixed", "plugin-bf16"])
def test_the_fid_and_grid_callbacks_sample_in_the_training_precisions_dtype(
        tmp_path: Path, steps: list[tuple[DallePrior, torch.dtype, bool]], precision: str | Callable[[], Any],
        want: torch.dtype) -> None:
    from dalle_lightning_callbacks.fid import FIDCallback
    from dalle_lightning_callbacks.sample_grid import SampleGrid
    from dalle_lightning.generation.sampling import sample_image_tokens
    from tests.test_fid import features
    from tests.test_sample_grid import batches, module

    fid = FIDCallback(every_n_epochs=1, num_images=4, feature_extractor=features, feature_dim=12)
    grid = SampleGrid(num_images=4, columns=2, scale=1, dirpath=str(tmp_path))
    chosen = {"precision": precision} if isinstance(precision, str) else {"plugins": [precision()]}
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, callbacks=[fid, grid], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, **chosen)
    lit = module()
    data = DataLoader(batches(), batch_size=None)
    trainer.fit(lit, train_dataloaders=data, val_dataloaders=data)
    assert trainer.state.finished and grid.last_path is not None
    assert steps and {(dtype, autocast) for _, dtype, autocast in steps} == {(want, False)}
    assert all((module is lit.model) == (want == torch.float32) for module, _, _ in steps)  # fp32: no copy
    assert all(p.dtype == torch.float32 for p in lit.model.parameters())  # the trained model is untouched
    if want == torch.bfloat16:  # the images are those of the bf16 copy (a dalle-generate dtype=bf16 would draw them)
        batch = batches()[0]
        with torch.no_grad():
            tokens = sample_image_tokens(lit.model, batch["text"], dtype="bf16",
                                         generator=torch.Generator().manual_seed(lit.fid_seed))
        assert torch.equal(lit.fid_generate(batch), lit._decode(tokens))


# ------------------------------------------------------------------------------------------ the errors file
@pytest.fixture
def failing_capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fallback mode, nothing reported yet, and the graph path taken on the CPU with a capture that fails."""

    def capture(step: Callable[[], torch.Tensor], device: torch.device) -> Any:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(sampling, "use_graphs", lambda mode, device, model=None: mode is not False)
    monkeypatch.setattr(graph_decode, "capture", capture)
    monkeypatch.delenv(fast_paths.ERRORS_ENV, raising=False)
    fast_paths.reset_reports()
    with strict_fast_paths(False):
        yield
    fast_paths.reset_reports()


@pytest.mark.parametrize("user_file", [False, True])
def test_a_commands_fast_path_errors_go_to_its_run_directory(
        work: Path, tmp_path: Path, failing_capture: None, capfd: pytest.CaptureFixture,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, user_file: bool) -> None:
    """The one line as the user sees it (Hydra's console log) names the file, which holds the traceback."""
    from dalle_lightning.cli import generate as app

    runs, named = tmp_path / "runs", tmp_path / "mine.log"
    if user_file:
        monkeypatch.setenv(fast_paths.ERRORS_ENV, str(named))
    run_app(app.main, f"paths.work_dir={work}", "clip=null", "prompts=[a red square]", "num_candidates=2",
            f"out_dir={tmp_path / 'samples'}", f"hydra.run.dir={runs}")
    errors = named if user_file else runs / "fast_path_errors.log"
    printed = capfd.readouterr()
    (line,) = [line.partition("[WARNING] - ")[2] for line in (printed.out + printed.err).splitlines()
               if f"[{fast_paths.__name__}][WARNING]" in line]
    assert line.startswith("CUDA graph capture of the prior's decode step failed (RuntimeError: CUDA error")
    assert line.endswith(f"Turn it off with graphs=false; full error in {errors}"), line
    assert "Traceback (most recent call last)" in errors.read_text()
    assert (runs / "fast_path_errors.log").exists() is not user_file
    assert os.environ.get(fast_paths.ERRORS_ENV) == (str(named) if user_file else None)  # restored after the app
