"""The quality-against-time plot reads finished demo runs and places each at its time and accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from dalle_lightning.evaluation.plot import PANEL_H, PANEL_W
from dalle_lightning.evaluation.plot_quality_vs_time import main, panels, run_point


def fake_run(folder: Path, total_s: float, best16: float, one: float, recon: float) -> Path:
    folder.mkdir(parents=True)
    (folder / "demo.json").write_text(json.dumps({"total_s": total_s}))
    split = {"1": {"accuracy": one}, "16": {"accuracy": best16}, "waterfall": {"all": {"reconstructions": recon}}}
    (folder / "eval.json").write_text(json.dumps({"seen": split, "zeroshot": split}))
    return folder


def test_each_run_is_a_point_at_its_minutes_and_accuracy(tmp_path: Path) -> None:
    short = fake_run(tmp_path / "demo", 840, 0.48, 0.39, 0.64)
    long = fake_run(tmp_path / "long", 2700, 0.9, 0.6, 0.94)
    best, one, recon = panels([run_point(short), run_point(long)])
    assert best.series["seen captions"] == [(14.0, 0.48), (45.0, 0.9)]
    assert one.series["zero-shot"] == [(14.0, 0.39), (45.0, 0.6)]
    assert recon.series["seen captions"][1] == (45.0, 0.94)
    out = main([str(short), str(long), "--out", str(tmp_path / "q.png")])
    assert Image.open(out).size == (3 * PANEL_W, PANEL_H)  # three panels side by side


def test_a_run_without_its_reports_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    with pytest.raises(SystemExit, match=r"has no demo.json or eval.json; expected the out_dir of a finished demo"):
        run_point(tmp_path / "half")
