"""Host reads and aten ops per training update of each ``dalle-train`` stage, counted in-process, as JSON.

A host read (``aten::_local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``) makes the host
wait for the device; on a GPU each one drains the queue, so a stage whose updates are a few milliseconds of GPU work
runs at the host's pace. Each stage is fitted twice, for ``--short`` and ``--long`` updates (validation off), under
a ``TorchDispatchMode`` that counts every aten call and the Python call site of every host read; the difference of
the two fits divided by the difference of their updates is the steady-state cost per update (start-up and the
end cancel). ``--log-every`` sets ``trainer.log_every_n_steps``: the default, larger than the long fit, leaves the
logging interval out, which is where Lightning and the callbacks read their logged values back.

Usage: ``python benchmarks/host_reads.py [outputs/demo] [--stages dvae clip prior] [--short 10] [--long 40]
[--log-every 1000] [--sites]`` (needs a demo's artifacts: world, tokenizer, dVAE, token shards, CLIP).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
STAGE_OVERRIDES = {"dvae": ["stage=dvae"], "clip": ["stage=clip"],
                   "prior": ["stage=prior", "callbacks.fid=null", "callbacks.sample_grid=null"]}


class OpCounter(TorchDispatchMode):
    """Counts aten calls, and host reads by their nearest project or Lightning call site."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            self.reads[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1])] += 1
        return func(*args, **(kwargs or {}))


def fit_counts(overrides: Sequence[str]) -> OpCounter:
    """One in-process ``dalle-train`` run under the counter."""
    from dalle_lightning.cli import train

    argv, sys.argv = sys.argv, ["dalle-train", *overrides]
    counter = OpCounter()
    try:
        with counter:
            train.main()
    finally:
        sys.argv = argv
    return counter


def per_update(work_overrides: Sequence[str], stage_overrides: Sequence[str], short: int, long: int,
               log_every: int) -> dict[str, Any]:
    """Host reads and aten ops per update in steady state, from fits of ``short`` and ``long`` updates."""
    counts = {}
    with tempfile.TemporaryDirectory() as scratch:
        for steps in (short, long):
            counts[steps] = fit_counts([*stage_overrides, *work_overrides, f"trainer.max_steps={steps}",
                                        "trainer.limit_val_batches=0", f"trainer.log_every_n_steps={log_every}",
                                        "data.num_workers=0", "stage.force=true", f"output={scratch}/{steps}.pt",
                                        f"hydra.run.dir={scratch}/run{steps}"])
    span = long - short
    reads = {site: (counts[long].reads[site] - counts[short].reads[site]) / span for site in counts[long].reads}
    ops = {op: (counts[long].ops[op] - counts[short].ops[op]) / span for op in counts[long].ops}
    return {"host_reads_per_update": round(sum(reads.values()), 2), "aten_ops_per_update": round(sum(ops.values())),
            "read_sites": {k: round(v, 2) for k, v in sorted(reads.items(), key=lambda kv: -kv[1]) if v > 0.005}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work_dir", type=Path, nargs="?", default=ROOT / "outputs" / "demo")
    parser.add_argument("--stages", nargs="+", choices=list(STAGE_OVERRIDES), default=list(STAGE_OVERRIDES))
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=1000)
    parser.add_argument("--sites", action="store_true", help="also list the call sites of the host reads")
    args = parser.parse_args()
    report: dict[str, Any] = {"benchmark": "host_reads", "work_dir": str(args.work_dir), "short": args.short,
                              "long": args.long, "log_every_n_steps": args.log_every}
    for stage in args.stages:
        result = per_update([f"paths.work_dir={args.work_dir}"], STAGE_OVERRIDES[stage], args.short, args.long,
                            args.log_every)
        if not args.sites:
            result.pop("read_sites")
        report[stage] = result
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
