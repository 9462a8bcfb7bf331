"""Seconds to ``ddp``'s loss at each link rate, from one loss curve per setting and the rates measured per link.

A setting's validation loss after k updates does not depend on the link: the link changes when the bytes
arrive, not what they add up to (the collectives sum in a fixed order; ``ddp``'s 400-update val loss at 2 x 2 was
0.7044 over 200 Mbit/s and over the unshaped link, docs/results.md). So the updates a setting needs to reach
the target come from one ``two_nodes.py --time-to-loss`` run per setting (on the fastest link), and the seconds
per update at each rate from ``two_nodes.py`` rates runs (medians of interleaved runs, a steadier figure than one
long run's): seconds to target = updates to target / updates per second at that rate.

The output has ``two_nodes.py --time-to-loss``'s layout (``time_to_loss``: rate -> setting -> figures), so
``plot_time_to_loss.py`` draws it.

Usage: ``python benchmarks/time_to_loss_at_rates.py ttl.json rates.json [more rates.json ...] > derived.json``;
a setting's name in the rates report is the same string as in ``--settings`` (``two_nodes.py --methods`` takes
settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def derive(ttl: dict[str, Any], rates: list[dict[str, Any]]) -> dict[str, Any]:
    curves = next(iter(ttl["time_to_loss"].values()))  # one loss curve per setting (any rate: the same curve)
    target, target_step = curves["target_loss"], ttl["target_step"]
    measured: dict[str, dict[str, Any]] = {}
    for report in rates:
        for rate, entry in report["rates"].items():
            measured.setdefault(rate, {"measured_mbit": entry["measured_mbit"]}).update(
                {k: v for k, v in entry.items() if k != "measured_mbit"})
    out: dict[str, Any] = {}
    for rate, entry in measured.items():
        row: dict[str, Any] = {"measured_mbit": entry["measured_mbit"], "target_loss": target}
        for setting, curve in curves.items():
            if not isinstance(curve, dict) or setting not in entry or not entry[setting]["updates_per_s"]:
                continue
            per_s = entry[setting]["updates_per_s"]["median"]
            updates = curve["updates_to_target"]
            row[setting] = {"updates_to_target": updates, f"val_loss_at_{target_step}": curve[f"val_loss_at_{target_step}"],
                            "vs_ddp_loss": curve["vs_ddp_loss"], "updates_per_s": per_s,
                            "seconds_to_target": round(updates / per_s, 1) if updates else None}
        ddp_s = row.get("ddp", {}).get("seconds_to_target")
        for setting, figures in row.items():
            if isinstance(figures, dict):
                s = figures["seconds_to_target"]
                figures["time_vs_ddp"] = round(s / ddp_s, 4) if s and ddp_s else None
        out[rate] = row
    return {"per_node": ttl.get("per_node"), "target_step": target_step, "ttl_steps": ttl.get("ttl_steps"),
            "loss_curves_from": next(iter(ttl["time_to_loss"])), "time_to_loss": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ttl", type=Path, help="two_nodes.py --time-to-loss output")
    parser.add_argument("rates", type=Path, nargs="+", help="two_nodes.py rates output(s) with the same settings")
    args = parser.parse_args()
    ttl = json.loads(args.ttl.read_text())
    print(json.dumps(derive(ttl, [json.loads(p.read_text()) for p in args.rates]), indent=1))


if __name__ == "__main__":
    main()
