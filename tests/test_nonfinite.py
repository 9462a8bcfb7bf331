"""No silently wrong artifact: NaN batches are skipped and counted, a run that mostly skips stops with one line,
only finite weights are written, a short run saves its trained weights (not the EMA's initial copy), and an
unwritable output fails before training."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dalle_lightning.artifacts import read_file
from tests.conftest import run_app
from tests.test_pipeline import TINY_DVAE

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on shared cores

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv"]


class PoisonBatches(pl.Callback):
    """Turns the images of the chosen training batches into NaN (``every``: all of them)."""

    def __init__(self, batches: list[int] | None = None, every: bool = False) -> None:
        self.batches, self.every = set(batches or ()), every

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.every or trainer.global_step in self.batches:
            batch["image"].fill_(float("nan"))


def _train_dvae(work: Path, output: Path, *extra: str) -> None:
    from dalle_lightning.cli import train

    run_app(train.main, "stage=dvae", f"paths.work_dir={work}", f"output={output}", "stage.force=true",
            f"hydra.run.dir={output.parent / 'run'}", *TINY_DVAE, *QUIET, *extra)


def test_nan_batch_under_default_precision_is_skipped_and_the_saved_weights_are_finite(
        tiny_world: Path, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    out = tmp_path / "dvae.pt"
    _train_dvae(tiny_world, out, "trainer.max_steps=6", "trainer.log_every_n_steps=1",
                "+callbacks.poison._target_=tests.test_nonfinite.PoisonBatches", "+callbacks.poison.batches=[2]")
    blob = read_file(out)
    assert all(torch.isfinite(v).all() for v in blob["state_dict"].values() if v.is_floating_point())
    # The EMA starts at update 100: a 6-update run saves its trained weights, not the EMA's copy of the init.
    pl.seed_everything(0, verbose=False)
    init = instantiate(blob["config"]).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in blob["state_dict"].items())
    (metrics,) = (tmp_path / "run").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    skipped = [float(r["train/skipped_updates"]) for r in rows if r.get("train/skipped_updates")]
    assert skipped[0] == 0.0 and skipped[-1] == 1.0  # the poisoned update, and only it


def test_run_that_mostly_skips_stops_with_one_line_and_writes_nothing(
        tiny_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "dvae.pt"
    with pytest.raises(SystemExit) as exit_info:
        _train_dvae(tiny_world, out, "precision=fp32", "trainer.max_steps=3",
                    "+callbacks.poison._target_=tests.test_nonfinite.PoisonBatches", "+callbacks.poison.every=true")
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 of 3 updates had a NaN or Inf" in errors[0], errors
    assert not out.exists()


def test_non_finite_weights_are_never_written(tmp_path: Path) -> None:
    from dalle_lightning.artifacts import save_model

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="1 of 2 weight tensors hold NaN or Inf \\(first: weight\\)"):
        save_model(tmp_path / "m.pt", {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}, model)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("output", ["/proc/dalle.pt", "{file}/dvae.pt", "{dir}"])
def test_unwritable_output_fails_before_training(output: str, tiny_world: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    (tmp_path / "file").write_text("x")
    output = output.format(file=tmp_path / "file", dir=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, "stage=dvae", f"paths.work_dir={tiny_world}", f"output={output}", "stage.force=true",
                f"hydra.run.dir={tmp_path / 'run'}")
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: output='{output}'"), errors
    assert not (tmp_path / "run" / "checkpoints").exists()  # no training started
