"""What a training run prints (``callbacks/dalle_lightning_callbacks/progress_bar.py``): a bar over the run's updates
(``max_steps``), ``Epoch N`` without Lightning's ``/-2`` and without ``v_num``; where standard output is not a
terminal, one plain line per logging interval instead, its values read at that interval only; and a real
``dalle-train`` without Lightning's tips or the model summary's bf16 warning (``dalle_lightning/cli/common.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from dalle_lightning_callbacks.progress_bar import IntervalRichProgressBar, IntervalTQDMProgressBar
from tests.resume_utils import STAGES

ROOT = Path(__file__).resolve().parents[1]


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])  # for the loggers only, as the project's modules do
        return out


def _fit(tmp_path: Path, bar: pl.Callback, steps: int = 10, **kwargs: object) -> pl.Trainer:
    """Streamed-like epochs of 4 batches, ``steps`` updates, a CSV logger (which has a version: ``v_num``)."""
    trainer = pl.Trainer(max_steps=steps, max_epochs=-1, limit_train_batches=4, limit_val_batches=0, callbacks=[bar],
                         logger=CSVLogger(tmp_path), enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu", devices=1, **kwargs)
    trainer.fit(LoggingModel())
    return trainer


@pytest.mark.parametrize("kind", [IntervalRichProgressBar, IntervalTQDMProgressBar])
def test_the_bar_counts_the_runs_updates_without_v_num(kind: type, tmp_path: Path) -> None:
    bar = kind(lines=False)
    trainer = _fit(tmp_path, bar)
    assert trainer.global_step == 10
    if isinstance(bar, IntervalRichProgressBar):
        task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
        total, done, description = task.total, task.completed, task.description
    else:
        total, done, description = bar.train_progress_bar.total, bar.train_progress_bar.n, bar.train_progress_bar.desc
    assert (total, done) == (10, 10)  # updates of the run, not batches of an epoch
    assert description.strip().rstrip(":") == "Epoch 2"  # the third epoch of 4 batches; max_epochs=-1: no "/-2"
    metrics = bar.get_metrics(trainer, trainer.lightning_module)
    assert "v_num" not in metrics and "train/loss" in metrics


def test_without_a_terminal_one_line_per_logging_interval(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """stdout is pytest's capture, not a terminal: the bar is off and each interval of 3 updates prints a line,
    at the update that ends it (two micro-batches each), with the values read there and nowhere else."""
    bar = IntervalRichProgressBar()
    reads: list[int] = []
    read = bar._read_shown

    def counted(trainer: pl.Trainer) -> None:
        reads.append(trainer.global_step)
        read(trainer)

    bar._read_shown = counted  # type: ignore[method-assign]
    _fit(tmp_path, bar, log_every_n_steps=3, accumulate_grad_batches=2)
    assert bar.is_disabled
    first, *lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert re.fullmatch(r"step 1/10 \| first update done, \d+s after training started", first), first
    assert [line.split(" | ")[0] for line in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    pattern = r"step \d+/10 \| train/loss [-\d.e]+ \| [\d.e+]+ updates/s( \| eta \d+[smh]\S*)?"
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    assert "eta" in lines[0] and "eta" not in lines[-1]
    assert reads == [3, 6, 9, 10]  # the logging interval and the run's end: no read per update


def test_dalle_train_prints_lines_and_no_tips(resume_work: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dalle_lightning.cli.train", *STAGES["dvae"],
                           f"paths.work_dir={resume_work}", f"paths.runs={tmp_path / 'runs'}", "trainer.max_steps=4",
                           "trainer.log_every_n_steps=2", "data.batch_size=8", "trainer.limit_val_batches=1",
                           "precision=bf16_mixed", f"output={tmp_path / 'dvae.pt'}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "Tip:" not in text and "litlogger" not in text and "litmodels" not in text, text[-3000:]
    assert "is not supported by the model summary" not in text, text[-3000:]
    assert "v_num" not in text and "\r" not in text, text[-3000:]
    steps = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/4", "step 2/4", "step 4/4"], proc.stdout[-3000:]
    assert re.search(r"^validation at step 4 \| val/loss [-\d.e]+ \| val/recon_loss ", proc.stdout, re.M), proc.stdout
