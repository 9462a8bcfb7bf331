"""Plot ``benchmarks/two_nodes.py --time-to-loss`` output: wall time to ``ddp``'s loss against compression.

One line per link rate over the strategy's settings (x: the PowerSGD rank on a log scale, labelled with its
compression, the share of the compressed matrices' fp32 bytes saved, from the demo prior's shapes), and ``ddp``
and torch's hook at the same rate as flat lines. Drawn with the project's Pillow charts (``dalle_lightning.
evaluation.plot``); matplotlib is not a dependency.

Usage: ``python benchmarks/plot_time_to_loss.py ttl.json docs/time_to_loss.png``
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from dalle_lightning.evaluation.plot import Panel, line_chart
from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins.compression.powersgd import saved_share
from dalle_lightning_plugins.compression.inter_node import embedding_param_names

DEMO_PRIOR = (351, 20, 512, 8, 6, 4, 32)  # text vocabulary, caption positions, image vocabulary, grid, layers, heads, head width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    with torch.device("meta"):
        model = DallePrior(*DEMO_PRIOR, conv_kernel=5)
    emb = embedding_param_names(model)
    shapes = [p.shape for n, p in model.named_parameters() if n not in emb]
    report = json.loads(args.report.read_text())["time_to_loss"]
    series: dict[str, list[tuple[float, float]]] = {}
    ranks: set[int] = set()
    for rate, entry in report.items():
        points = []
        for setting, figures in entry.items():
            rank = re.search(r"powersgd_rank=(\d+)", setting)
            if rank and isinstance(figures, dict) and figures.get("seconds_to_target"):
                points.append((float(rank.group(1)), figures["seconds_to_target"]))
                ranks.add(int(rank.group(1)))
        series[f"strategy, {rate}"] = sorted(points)
    span = (float(min(ranks)), float(max(ranks)))
    for rate, entry in report.items():
        for name in ("ddp", "hook"):
            t = entry.get(name, {}).get("seconds_to_target")
            if t:
                series[f"{name}, {rate}"] = [(span[0], t), (span[1], t)]
    xlabel = "rank (compression " + ", ".join(f"{r}: {saved_share(shapes, r, 2.0):.2f}" for r in sorted(ranks)) + ")"
    line_chart([Panel("time to ddp's val loss at update 400", "seconds (validation excluded)", series, xlabel=xlabel)],
               args.out)


if __name__ == "__main__":
    main()
