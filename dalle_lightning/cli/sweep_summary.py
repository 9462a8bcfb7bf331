"""Summary of a ``dalle-train -m`` sweep: each run's overrides and the swept metric, best first.

Every run of a sweep writes ``<sweep_dir>/<job number>/metrics.json`` (``{"overrides": [...], "metrics": {...}}``,
see ``dalle_lightning.cli.train``). The summary reads them all, so it also works on a sweep that was
interrupted or run by another sweeper (Optuna), and lists runs without metrics (crashed) last.

The metric is, in order: the one asked for, the sweep's ``objective`` (from ``multirun.yaml``), ``val/loss``,
then ``train/loss``. Lower is better unless ``mode="max"`` or the Optuna sweeper was told to maximise.

Usage::

    python -m dalle_lightning.cli.sweep_summary outputs/shapes/runs/multirun/2026-01-01_12-00-00 [--metric val/loss]

and automatically at the end of a sweep through the Hydra callback :class:`SweepSummary` (``conf/sweep/*.yaml``
attach it; add ``+hydra.callbacks.summary._target_=dalle_lightning.cli.sweep_summary.SweepSummary`` to any
other multirun). ``summary.json`` and ``summary.txt`` are written into the sweep directory.

A sweep directory may come from anyone, so its files are read as plain values (``dalle_lightning.plain_yaml``): an
override is shown as the text Hydra saved, ``a=${oc.env:SECRET_TOKEN}`` literally, and nothing in ``overrides.yaml``
or ``multirun.yaml`` is ever resolved; and no file outside it is read: a job, or a file of one, that is a link out
of the sweep is refused in one line naming it (:mod:`dalle_lightning.inside`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dalle_lightning import inside
from dalle_lightning.plain_yaml import read_yaml
from dalle_lightning_plugins.io.atomic_files import write_json, write_text

log = logging.getLogger("dalle_lightning.sweep")

FALLBACK_METRICS = ("val/loss", "train/loss")
KEY = "sweep_dir"  # what a refusal names first


def read_runs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every run directory of the sweep: its name, overrides and metrics (``None`` when it wrote none)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {str(sweep_dir)!r} does not exist; expected a dalle-train -m output dir")
    runs = []
    jobs = (p for p in sweep_dir.iterdir() if inside.check(p, sweep_dir, KEY).is_dir())
    for run_dir in sorted(jobs, key=lambda p: (len(p.name), p.name)):
        metrics_file, overrides_file = run_dir / "metrics.json", run_dir / ".hydra" / "overrides.yaml"
        for path in (metrics_file, overrides_file):
            inside.check(path, sweep_dir, KEY)
        if metrics_file.is_file():
            blob = read_json(metrics_file)
            runs.append({"run": run_dir.name, "overrides": override_texts(blob.get("overrides"), metrics_file),
                         "metrics": plain_metrics(blob.get("metrics"), metrics_file)})
        elif overrides_file.is_file():  # the run started but wrote no metrics: it failed
            runs.append({"run": run_dir.name, "overrides": override_texts(read_yaml(overrides_file), overrides_file),
                         "metrics": None})
    if not runs:
        raise FileNotFoundError(f"no runs in {str(sweep_dir)!r}; expected subdirectories with metrics.json")
    return runs


def sweep_settings(sweep_dir: Path) -> tuple[str | None, str | None]:
    """The ``objective`` and Optuna ``direction`` recorded in ``multirun.yaml`` (None when absent)."""
    path = sweep_dir / "multirun.yaml"
    if not inside.check(path, sweep_dir, KEY).is_file():
        return None, None
    cfg = read_yaml(path)  # plain values: a stored ${...} stays text (it then names no logged metric)
    cfg = cfg if isinstance(cfg, dict) else {}
    objective = cfg.get("objective")
    sweeper = (cfg.get("hydra") or {}).get("sweeper") if isinstance(cfg.get("hydra"), dict) else None
    direction = sweeper.get("direction") if isinstance(sweeper, dict) else None
    return (objective if isinstance(objective, str) else None), (direction if isinstance(direction, str) else None)


def read_json(path: Path) -> dict[str, Any]:
    """A run's ``metrics.json`` as plain values; one line naming the file when it is not a JSON object."""
    try:
        blob = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is not readable JSON ({type(exc).__name__}); expected the metrics.json "
                         "dalle-train writes") from None
    if not isinstance(blob, dict):
        raise ValueError(f"{str(path)!r} holds a {type(blob).__name__}; expected the JSON object dalle-train writes")
    return blob


def override_texts(value: Any, path: Path) -> list[str]:
    """A run's overrides as the texts Hydra saved (``key=value``), kept literally: ``${...}`` in one is shown as
    typed and never resolved (it may read the environment). Anything but a list of scalars is one line."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(o, (str, int, float, bool)) for o in value):
        raise ValueError(f"{str(path)!r}: overrides is not a list of key=value texts; expected what Hydra saved")
    return [str(o) for o in value]


def plain_metrics(value: Any, path: Path) -> dict[str, float]:
    """A run's metrics: names to numbers (a metric of another type is one line naming it)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r}: metrics is a {type(value).__name__}; expected names and numbers")
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"{str(path)!r}: metrics[{str(name)!r}] is not a number; expected names and numbers")
    return {str(k): float(v) for k, v in value.items()}


def choose_metric(runs: list[dict[str, Any]], metric: str | None, objective: str | None) -> str:
    logged = set().union(*(r["metrics"] or {} for r in runs))
    if metric is not None:
        if metric not in logged:
            raise KeyError(f"metric {metric!r} was not logged by any run; logged metrics: {sorted(logged)}")
        return metric
    for candidate in (objective, *FALLBACK_METRICS):
        if candidate is not None and candidate in logged:
            return candidate
    raise KeyError(f"no metric to summarise (objective={objective!r}); pass one of {sorted(logged)}")


def _pairs(run: dict[str, Any]) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in run["overrides"])


def swept_keys(runs: list[dict[str, Any]]) -> list[str]:
    """Override keys whose value differs between runs (or that some runs lack): the swept parameters."""
    per_run = [_pairs(r) for r in runs]
    keys = set().union(*per_run)
    return sorted(k for k in keys if len({p.get(k) for p in per_run}) > 1)


def summarize(sweep_dir: str | Path, metric: str | None = None, mode: str | None = None) -> dict[str, Any]:
    """The sweep's runs sorted by ``metric`` (best first; failed runs and NaN last), with the swept parameters."""
    sweep_dir = Path(sweep_dir)
    if mode not in (None, "min", "max"):
        raise ValueError(f"mode={mode!r}; expected 'min' or 'max'")
    runs = read_runs(sweep_dir)
    objective, direction = sweep_settings(sweep_dir)
    metric = choose_metric(runs, metric, objective)
    mode = mode or ("max" if direction == "maximize" else "min")
    keys = swept_keys(runs)
    rows = []
    for r in runs:
        value = (r["metrics"] or {}).get(metric)
        params = _pairs(r)
        rows.append({"run": r["run"], "params": {k: params.get(k) for k in keys}, "overrides": r["overrides"],
                     "value": value, "status": "ok" if r["metrics"] is not None else "failed"})
    sign = -1.0 if mode == "max" else 1.0

    def order(row: dict[str, Any]) -> tuple[int, float]:
        v = row["value"]
        return (1, 0.0) if v is None or math.isnan(v) else (0, sign * v)

    rows.sort(key=order)
    best = rows[0] if rows[0]["value"] is not None and not math.isnan(rows[0]["value"]) else None
    return {"sweep_dir": str(sweep_dir), "metric": metric, "mode": mode, "swept": keys, "runs": rows, "best": best}


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table: rank, run, each swept parameter, the metric."""
    header = ["rank", "run", *summary["swept"], summary["metric"]]
    body = []
    for i, row in enumerate(summary["runs"], 1):
        value = "failed" if row["value"] is None else f"{row['value']:.6g}"
        body.append([str(i), row["run"], *(str(row["params"][k]) for k in summary["swept"]), value])
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *body]]
    return "\n".join(lines)


def write_summary(sweep_dir: str | Path, metric: str | None = None, mode: str | None = None) -> dict[str, Any]:
    """Summarise and write ``summary.json`` and ``summary.txt`` into the sweep directory."""
    summary = summarize(sweep_dir, metric, mode)
    write_json(Path(sweep_dir) / "summary.json", summary, sort_keys=False)
    write_text(Path(sweep_dir) / "summary.txt", format_table(summary) + "\n")
    return summary


class SweepSummary(Callback):
    """Hydra callback: write the summary when a multirun ends. A summary problem is logged, never raised,
    so it cannot turn a finished sweep into a failure."""

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        self.metric = metric
        self.mode = mode

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = Path(config.hydra.sweep.dir)
            summary = write_summary(sweep_dir, self.metric, self.mode)
            log.info("sweep summary (%s, %s is better) in %s:\n%s", summary["metric"],
                     "lower" if summary["mode"] == "min" else "higher", sweep_dir / "summary.txt", format_table(summary))
        except Exception as exc:  # noqa: BLE001 - reporting must not fail the sweep
            log.warning("no sweep summary: %s", exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a dalle-train -m output directory (holds one subdirectory per run)")
    parser.add_argument("--metric", help="metric to sort by (default: the sweep's objective, val/loss, train/loss)")
    parser.add_argument("--mode", choices=["min", "max"], help="min: lower is better (default), max: higher")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        summary = write_summary(args.sweep_dir, args.metric, args.mode)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {str(exc).strip(chr(39))}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
