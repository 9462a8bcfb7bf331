"""Plot val loss against wall seconds per link, every setting's curve in one panel: local steps beside per-step.

Each setting's loss curve (``two_nodes.py --time-to-loss``: val loss every 10 updates) does not depend on the link,
and its seconds per update at each link come from ``time_to_loss_at_rates.py``'s derived report, so the point of
update k at a link is (k / updates per second there, val loss). One panel per (shape, link), side by side; the
title names ``ddp``'s target (its val loss after the target update), and a curve that crosses under it first is the
faster to that loss. x is on a log2 scale (the project's Pillow charts, ``dalle_lightning.evaluation.plot``).

Usage: ``python benchmarks/plot_loss_vs_time.py OUT.png --panel 2x1 derived_2x1.json ttl_a.json [ttl_b.json ...]
[--panel 2x2 derived_2x2.json ttl_c.json ...] [--rates 200 50] [--settings ddp strategy_auto local ...]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dalle_lightning.evaluation.plot import Panel, line_chart

FROM_STEP = 50  # the first updates' loss (4.4 at update 10) would flatten the part that decides
YLIM = (0.68, 1.0)  # around ddp's targets (0.7466 at 2 x 1, 0.7044 at 2 x 2): where the curves cross them
XTICKS = [15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0]
SHORT = {"ddp": "ddp", "strategy_auto": "PowerSGD r32", "strategy": "PowerSGD r32", "local": "local int8 d1"}
QUIET = {"sync_every=10", "outer_lr=0.7", "outer_momentum=0.5", "sync_delay=0"}  # local steps' defaults, or none


def label(setting: str) -> str:
    """A legend-sized name: ``local:outer_comm_dtype=int8,sync_delay=1`` -> ``local int8 d1``."""
    if setting in SHORT:
        return SHORT[setting]
    method, _, extra = setting.partition(":")
    words = ["PowerSGD" if method.startswith("strategy") else method]
    for item in filter(None, extra.split(",")):
        if item in QUIET:
            continue
        key, _, value = item.partition("=")
        words.append({"outer_comm_dtype": value.replace("bfloat16", "bf16").replace("float32", "fp32"),
                      "sync_delay": f"d{value}", "sync_every": f"H{value}", "fragments": f"F{value}",
                      "powersgd_rank": f"r{value}", "outer_lr": f"lr{value}", "outer_momentum": f"m{value}",
                      "keep_overlapped": "drop" if value == "false" else "keep",
                      "local_mix": f"mix{value}"}.get(key, item))
    return " ".join(words)


def curves(ttl_paths: list[Path]) -> dict[str, list[dict[str, float]]]:
    """Setting -> its timeline (step, loss), over every ``--time-to-loss`` report given (first one wins)."""
    out: dict[str, list[dict[str, float]]] = {}
    for path in ttl_paths:
        per_setting = next(iter(json.loads(path.read_text())["time_to_loss"].values()))
        for setting, figures in per_setting.items():
            if isinstance(figures, dict) and figures.get("timeline"):
                out.setdefault(setting, figures["timeline"])
    return out


def panels(shape: str, derived: dict[str, Any], timelines: dict[str, list[dict[str, float]]], rates: list[str],
           settings: list[str] | None) -> list[Panel]:
    out = []
    for rate in rates:
        key = next((k for k in derived["time_to_loss"] if k == rate or k.removesuffix("mbit") in (rate, f"{rate}.0")), None)
        row = derived["time_to_loss"].get(key) if key else None
        if row is None:
            raise SystemExit(f"error: link {rate!r} is not in the {shape} report; it has {sorted(derived['time_to_loss'])}")
        series = {}
        for setting, figures in row.items():
            if not isinstance(figures, dict) or setting not in timelines or (settings and setting not in settings):
                continue
            per_s = figures["updates_per_s"]
            series[label(setting)] = [(p["step"] / per_s, p["loss"]) for p in timelines[setting] if p["step"] >= FROM_STEP]
        link = "unshaped" if key == "unshaped" else f"{rate} Mbit/s"
        out.append(Panel(f"{shape}, {link}: ddp's target {row['target_loss']}", "val loss", series,
                         xlabel="seconds (validation excluded)", ylim=YLIM, xticks=XTICKS,
                         hline=row["target_loss"], markers=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--panel", nargs="+", action="append", required=True, metavar="SHAPE DERIVED TTL",
                        help="a shape's name, its time_to_loss_at_rates.py report, its --time-to-loss reports")
    parser.add_argument("--rates", nargs="+", default=["200", "50"])
    parser.add_argument("--settings", nargs="+", default=None, help="only these settings (default: all)")
    args = parser.parse_args()
    drawn = []
    for shape, derived, *ttls in args.panel:
        if not ttls:
            raise SystemExit(f"error: --panel {shape} {derived}: expected at least one --time-to-loss report after it")
        drawn += panels(shape, json.loads(Path(derived).read_text()), curves([Path(t) for t in ttls]), args.rates,
                        args.settings)
    labels = list(dict.fromkeys(name for panel in drawn for name in panel.series))
    for panel in drawn:  # a setting keeps its colour in every panel
        panel.colour_of = {name: labels.index(name) for name in labels}
    line_chart(drawn, args.out)


if __name__ == "__main__":
    main()
