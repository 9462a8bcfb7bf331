"""What the sharded stage's torch function mode (``strategies/shard_reads.py``) costs a training step, as JSON.

The mode sees every torch call inside ``training_step`` and passes those with no sharded parameter through after
a type check per argument. One process, the prior's forward and backward with AdamW, steps interleaved with and
without the mode entered (no parameter is sharded here, so this is the pass-through cost alone; a real read is one
all-gather more): ``scanning``, every call's arguments checked (the calls outside the units), and ``paused``, as
inside a unit's own ``forward``. ``overhead_*`` is the median over rounds of (step with the mode / step without) - 1.

Usage: ``python benchmarks/shard_reads_cost.py [--shapes tiny demo] [--pairs 7] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from plugins_overhead import SHAPES

from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins.strategies.shard_reads import ShardReads


def _step(model: DallePrior, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
          mode: str) -> float:
    start = time.perf_counter()
    reads = ShardReads(None)
    with reads.reading() if mode != "none" else contextlib.nullcontext():
        reads.paused = int(mode == "paused")  # as inside a unit's own forward (most of a transformer's calls)
        loss = model(*batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "demo"])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        config, batch_size = SHAPES[shape]
        torch.manual_seed(0)
        model = DallePrior(**config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        text = torch.randint(0, config["text_vocab_size"], (batch_size, config["text_len"]))
        image = torch.randint(0, config["image_vocab_size"], (batch_size, config["image_grid"] ** 2))
        modes = ("none", "scanning", "paused")
        for mode in modes:  # warm-up
            _step(model, optimizer, (text, image), mode)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.pairs):  # interleaved: each round runs every mode
            for mode in modes:
                times[mode].append(sum(_step(model, optimizer, (text, image), mode) for _ in range(args.steps)) / args.steps)
        row = {"shape": shape, "step_s": statistics.median(times["none"]), "pairs": args.pairs, "steps": args.steps,
               "cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
        for mode in modes[1:]:
            row[f"overhead_{mode}"] = statistics.median(m / n for m, n in zip(times[mode], times["none"])) - 1
        rows.append(row)
    print(json.dumps({"benchmark": "shard_reads_cost", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
