"""What the sharded stage's torch function mode (``strategies/shard_reads.py``) costs a training step, as JSON.

The mode sees every torch call inside ``training_step`` and passes those with no sharded parameter through after
a type check per argument. One process, the prior's forward and backward with AdamW, steps interleaved with and
without the mode entered (no parameter is sharded here, so this is the pass-through cost alone; a real read is one
all-gather more): ``scanning``, every call's arguments checked (the calls outside the units), and ``paused``, as
inside a unit's own ``forward``. ``overhead_*`` is the median over rounds of (step with the mode / step without) - 1.

``hooks``: what the hook guard (:class:`~dalle_lightning_plugins.strategies.shard_reads.HookReads`) adds to one call
of a hook the user overrides, on the same model with its parameters DTensors (FSDP2 over a mesh of one gloo
process): ``reads_weight`` reads one weight whole (``float(w.detach().full_tensor().norm())``: the guard's first DTensor
argument makes it index every parameter and gradient by storage, once per call), ``plain`` does 20 torch calls on
plain tensors (the mode's pass-through alone). Medians over interleaved rounds, in microseconds, beside ``step_s``.

Usage: ``python benchmarks/shard_reads_cost.py [--shapes tiny demo] [--pairs 7] [--steps 5] [--hook-calls 200]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from plugins_overhead import SHAPES
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins.strategies.shard_reads import HookReads, ShardReads


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


def _hook_cost(model: DallePrior, pairs: int, calls: int) -> dict[str, float]:
    """Microseconds per hook call with the guard and without it (see the module's docstring)."""
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model, mesh=mesh)
    weight = next(model.parameters())
    plain = torch.randn(64, 64)
    hooks = {"reads_weight": lambda: float(weight.detach().full_tensor().norm()),
             "plain": lambda: [torch.tanh(plain).sum() for _ in range(20)]}
    out: dict[str, float] = {"parameters": len(list(model.parameters()))}
    for name, hook in hooks.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(pairs + 1):  # the first round warms up
            for guarded in (False, True):
                start = time.perf_counter()
                for _ in range(calls):
                    with HookReads("bench", "on_train_batch_end", model) if guarded else contextlib.nullcontext():
                        hook()
                times[guarded].append((time.perf_counter() - start) / calls * 1e6)
        out[f"{name}_us"] = statistics.median(times[False][1:])
        out[f"{name}_guard_us"] = statistics.median(g - u for g, u in zip(times[True][1:], times[False][1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "demo"])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hook-calls", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: two runs at once
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
        row["hooks"] = _hook_cost(model, args.pairs, args.hook_calls)
        rows.append(row)
    dist.destroy_process_group()
    print(json.dumps({"benchmark": "shard_reads_cost", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
