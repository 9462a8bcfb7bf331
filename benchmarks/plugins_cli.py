"""What the Strategy and the Precision plugin cost in a real ``dalle-train`` run of the demo's prior, as JSON.

Each comparison is a pair of command-line runs on the demo's artifacts (``make demo``'s out_dir), 120 updates
with validation, FID and sample grids off, timed by ``dalle_lightning_callbacks.step_timer.StepTimer`` (``time/updates_per_s`` in
the run's metrics.json). Pairs are interleaved (a, b, a, b, ...) so a disturbance of the shared cores hits both
sides alike; ``ratio`` is the median of the per-pair ratios a / b.

- ``precision``: one process, ``precision=resblock16 precision.dtype=bf16`` against Lightning's ``bf16-mixed``
  (the stage's default), batch 32;
- ``strategy``: 2 processes, ``strategy=sharded_powersgd strategy.devices_per_node=1`` (2 simulated nodes,
  PowerSGD between them) against Lightning's ``ddp``, batch 32 per process;
- ``demo``: the demo's prior stage (2 processes, both plugins, batch 16 per process) against one process in
  ``bf16-mixed`` at the same global batch 32.

Usage: ``python benchmarks/plugins_cli.py [outputs/demo] [--pairs 3] [--steps 120] [--only precision strategy demo]
[--plugin-overrides strategy.powersgd_rank=32]`` (the last: more overrides for the plugin side of every pair).
The per-step split of the plugin's own work is ``benchmarks/plugins_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = ["stage=prior", "trainer.limit_val_batches=0", "callbacks.fid=null", "callbacks.sample_grid=null",
        "+callbacks.step_timer._target_=dalle_lightning_callbacks.step_timer.StepTimer"]
TWO = ["trainer.devices=2"]
PLUGINS = ["strategy=sharded_powersgd", "strategy.devices_per_node=1"]
RESBLOCK = ["precision=resblock16", "precision.dtype=bf16"]
COMPARISONS: dict[str, tuple[list[str], list[str]]] = {
    "precision": (RESBLOCK, []),
    "strategy": (PLUGINS + TWO, ["strategy=auto", "strategy.name=ddp"] + TWO),
    "demo": (PLUGINS + RESBLOCK + TWO + ["data.batch_size=16"], []),
}


def run(work: Path, overrides: list[str], steps: int, scratch: Path) -> dict[str, float]:
    """One ``dalle-train`` run; its metrics.json's figures (updates/s, PowerSGD bytes when logged)."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    paths = [f"paths.{key}={work / name}" for key, name in
             (("world", "world"), ("tokens", "tokens"), ("tokenizer", "tokenizer.json"), ("dvae", "dvae.pt"),
              ("clip", "clip.pt"))]
    cmd = [sys.executable, "-m", "dalle_lightning.cli.train", *BASE, f"trainer.max_steps={steps}", *paths,
           f"output={run_dir / 'prior.pt'}", f"hydra.run.dir={run_dir}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    return {k: float(v) for k, v in metrics.items() if k.startswith(("time/", "powersgd/", "strategy/", "train/loss"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work_dir", type=Path, nargs="?", default=Path("outputs/demo"),
                        help="the demo's out_dir (world, tokens, tokenizer, dvae, clip); default outputs/demo")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--only", nargs="+", choices=list(COMPARISONS), default=list(COMPARISONS))
    parser.add_argument("--plugin-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more Hydra overrides for the plugin side of every pair, e.g. strategy.powersgd_rank=32")
    args = parser.parse_args()
    work = args.work_dir.resolve()
    missing = [n for n in ("world", "tokens", "tokenizer.json", "dvae.pt", "clip.pt") if not (work / n).exists()]
    if missing:
        raise SystemExit(f"error: {work} has no {', '.join(missing)}; run `make demo` (or pass its out_dir) first")
    report: dict[str, object] = {"work_dir": str(work), "steps": args.steps, "pairs": args.pairs}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.only:
            a, b = COMPARISONS[name]
            a = a + args.plugin_overrides
            runs: list[tuple[dict[str, float], dict[str, float]]] = []
            for _ in range(args.pairs):
                runs.append((run(work, a, args.steps, Path(scratch)), run(work, b, args.steps, Path(scratch))))
            rate = "time/updates_per_s"
            report[name] = {
                "plugin": " ".join(a) or "bf16-mixed, one process", "reference": " ".join(b) or "bf16-mixed, one process",
                "updates_per_s": [[round(x[rate], 3), round(y[rate], 3)] for x, y in runs],
                "ratio": round(statistics.median(x[rate] / y[rate] for x, y in runs), 3),
                "last": {"plugin": runs[-1][0], "reference": runs[-1][1]},
            }
            print(json.dumps({name: report[name]["ratio"]}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
