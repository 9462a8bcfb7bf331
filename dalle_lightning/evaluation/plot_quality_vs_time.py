"""Caption accuracy against the pipeline's time, one point per demo run: what more training time buys.

Each argument is a demo's out_dir (``make demo``'s ``outputs/demo``, ``experiment=shapes_long``'s
``outputs/long``): its ``demo.json`` gives the time (every step, training and evaluation, in minutes) and its
``eval.json`` the accuracy of the best of 16 (the default reranker's pick), of one sample, and of the dVAE's
reconstructions (the waterfall's row), per split. The x axis is log2, as the runs' times roughly double.

Usage: ``python -m dalle_lightning.evaluation.plot_quality_vs_time outputs/demo outputs/long --out docs/quality_vs_time.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dalle_lightning.evaluation.plot import SPLIT_LABELS, Panel, line_chart

XLABEL = "pipeline time (minutes, log scale)"


def run_point(out_dir: Path) -> tuple[float, dict[str, Any]]:
    """(minutes, eval report) of one demo run; a one-line error if it is not a finished demo."""
    missing = [name for name in ("demo.json", "eval.json") if not (out_dir / name).is_file()]
    if missing:
        raise SystemExit(f"error: {out_dir} has no {' or '.join(missing)}; expected the out_dir of a finished demo run")
    minutes = json.loads((out_dir / "demo.json").read_text())["total_s"] / 60
    return minutes, json.loads((out_dir / "eval.json").read_text())


def panels(points: list[tuple[float, dict[str, Any]]]) -> list[Panel]:
    """Best of 16, one sample and the dVAE's reconstructions against time, one line per split."""
    wanted = [("16", "accuracy", "Best of 16"), ("1", "accuracy", "One sample")]
    out = []
    for n, key, title in wanted:
        series = {label: [(t, float(r[split][n][key])) for t, r in points if n in r.get(split, {})]
                  for split, label in SPLIT_LABELS.items()}
        out.append(Panel(title, "caption accuracy", {k: v for k, v in series.items() if v}, xlabel=XLABEL,
                         ylim=(0.0, 1.0)))
    recon = {label: [(t, float(r[split]["waterfall"]["all"]["reconstructions"])) for t, r in points
                     if "reconstructions" in r.get(split, {}).get("waterfall", {}).get("all", {})]
             for split, label in SPLIT_LABELS.items()}
    if any(recon.values()):
        out.append(Panel("dVAE reconstructions", "caption accuracy", {k: v for k, v in recon.items() if v},
                         xlabel=XLABEL, ylim=(0.0, 1.0)))
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="demo out_dirs (demo.json and eval.json in each)")
    parser.add_argument("--out", type=Path, default=Path("docs/quality_vs_time.png"))
    args = parser.parse_args(argv)
    line_chart(panels([run_point(d) for d in args.runs]), args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
