"""Seconds to ``ddp``'s loss at each link rate, from one loss curve per setting and the rates measured per link.

A setting's validation loss after k updates does not depend on the link: the link changes when the bytes
arrive, not what they add up to (the collectives sum in a fixed order; ``ddp``'s 400-update val loss at 2 x 2 was
0.7044 over 200 Mbit/s and over the unshaped link, docs/results.md). So the updates a setting needs to reach
the target come from one ``two_nodes.py --time-to-loss`` run per setting (on the fastest link), and the seconds
per update at each rate from ``two_nodes.py`` rates runs (medians of interleaved runs, a steadier figure than one
long run's): seconds to target = updates to target / updates per second at that rate.

The output has ``two_nodes.py --time-to-loss``'s layout (``time_to_loss``: rate -> setting -> figures), so
``plot_time_to_loss.py`` draws it.

Usage: ``python benchmarks/time_to_loss_at_rates.py --ttl ttl.json [...] --rates rates.json [...] > derived.json``;
a setting's name in the rates report is the same string as in ``--settings`` (``two_nodes.py --methods`` takes
settings).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import yaml

from dalle_lightning_plugins.compression.powersgd import DEFAULT_RANK


# Keys that change what an update computes but neither its bytes nor its time: a rates run of the setting without
# them stands for it.
TIME_NEUTRAL = ("outer_lr", "outer_momentum", "outer_nesterov", "local_mix", "keep_overlapped")
STRATEGY_YAML = {"local": "local_steps.yaml", "strategy": "sharded_powersgd.yaml"}
CONF = Path(__file__).resolve().parent.parent / "conf" / "strategy"


@functools.lru_cache
def yaml_defaults(method: str) -> dict[str, str]:
    """The strategy yaml's values as override strings (read once per method; none for ``ddp`` and the like)."""
    if method not in STRATEGY_YAML:
        return {}
    defaults = {k: str(v).lower() for k, v in yaml.safe_load((CONF / STRATEGY_YAML[method]).read_text()).items()}
    defaults["powersgd_rank"] = str(DEFAULT_RANK)  # null in the yaml: the plugins' default rank, as two_nodes.py --rank
    return defaults


def normal_form(setting: str) -> tuple[str, frozenset[tuple[str, str]]]:
    """``method:key=value,...`` as (method, the keys that differ from the strategy's yaml default, less
    :data:`TIME_NEUTRAL`): ``local`` and ``local:sync_every=10,outer_lr=0.7`` are one rates entry; the overlap
    default ``strategy_auto`` stands for ``strategy`` (the exchange path gives the same update either way)."""
    method, _, extra = setting.partition(":")
    method = "strategy" if method in ("strategy", "strategy_auto") else method
    defaults = yaml_defaults(method)
    keys = set()
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        if key not in TIME_NEUTRAL and defaults.get(key) != value.lower():
            keys.add((key, value.lower()))
    return method, frozenset(keys)


def rate_key(setting: str, entry: dict[str, Any]) -> str | None:
    """The rates report's name for a setting's step time: the entry with the same :func:`normal_form`."""
    if setting in entry:
        return setting
    want = normal_form(setting)
    return next((name for name, v in entry.items() if isinstance(v, dict) and normal_form(name) == want), None)


def merge_curves(ttls: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings of several ``--time-to-loss`` reports of one shape, checked to share ``ddp``'s target."""
    merged: dict[str, Any] = {}
    for ttl in ttls:
        curves = next(iter(ttl["time_to_loss"].values()))  # one loss curve per setting (any rate: the same curve)
        if merged and curves["target_loss"] != merged["target_loss"]:
            raise SystemExit(f"error: targets differ ({curves['target_loss']} against {merged['target_loss']}): "
                             "not runs of one shape and schedule")
        merged.update(curves)
    return merged


def derive(ttls: list[dict[str, Any]], rates: list[dict[str, Any]]) -> dict[str, Any]:
    ttl = ttls[0]
    curves = merge_curves(ttls)
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
            measured_as = rate_key(setting, entry)
            if not isinstance(curve, dict) or measured_as is None or not entry[measured_as]["updates_per_s"]:
                continue
            per_s = entry[measured_as]["updates_per_s"]["median"]
            updates = curve["updates_to_target"]
            row[setting] = {"rate_measured_as": measured_as, "updates_to_target": updates, f"val_loss_at_{target_step}": curve[f"val_loss_at_{target_step}"],
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
    parser.add_argument("--ttl", type=Path, nargs="+", required=True, help="two_nodes.py --time-to-loss output(s)")
    parser.add_argument("--rates", type=Path, nargs="+", required=True,
                        help="two_nodes.py rates output(s) with the same settings")
    args = parser.parse_args()
    ttls = [json.loads(p.read_text()) for p in args.ttl]
    print(json.dumps(derive(ttls, [json.loads(p.read_text()) for p in args.rates]), indent=1))


if __name__ == "__main__":
    main()
