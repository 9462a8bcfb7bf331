"""What the exchange between nodes adds to a real training step of the demo prior, path by path, as JSON.

``powersgd_exchange.py`` times PowerSGD on random gradients with nothing else running; this one times what a
training step pays: two gloo processes on 127.0.0.1 (2 nodes x 1 device, one thread each), the demo prior in
``bf16`` autocast at batch 32, each step a forward, a backward and the exchange, for three paths interleaved step
by step (a, b, c, a, b, c, ...) so that a slower spell of the machine hits all three alike:

- ``backward``: forward and backward only (no exchange): the floor;
- ``end``: the end-of-backward path (``InterNodeReduction`` with ``overlap=False``: the flag all-reduce, then
  ``PowerSGD.reduce``);
- ``overlapped``: :class:`OverlappedExchange`: buckets sent from the gradient hooks, ``finish()`` at the end.

Per path: the median step (ms), the median of what follows the backward (``tail_ms``: the exposed exchange) and
the all-reduces issued per step, counted on ``torch.distributed`` (not by the exchange). Each path keeps its own
compressor (error buffers), as the strategy does within one run.

Usage: ``python benchmarks/exchange_step.py [--rank 32] [--steps 30] [--bucket-cap-mb 1.0]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from dalle_lightning.models.prior import DallePrior  # noqa: E402
from prior_throughput import SHAPES  # noqa: E402
from dalle_lightning_plugins.compression.inter_node import InterNodeReduction  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

PATHS = ("backward", "end", "overlapped")


def worker(rank: int, world_size: int, psgd_rank: int, steps: int, bucket_cap_mb: float) -> dict:
    torch.set_num_threads(1)
    config, batch = SHAPES["demo"]
    config = {**config, "text_vocab_size": 350}  # the demo tokenizer's 350 words
    torch.manual_seed(0)
    model = DallePrior(**config)
    blocks = [name for name, _ in model.resblocks()]
    torch.manual_seed(1 + rank)
    text = torch.randint(0, config["text_vocab_size"], (batch, config["text_len"]))
    image = torch.randint(0, config["image_vocab_size"], (batch, config["image_grid"] ** 2))
    mesh = dist.device_mesh.init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    reductions = {}
    for path in ("end", "overlapped"):
        reduction = InterNodeReduction({"rank": psgd_rank}, compression=None, overlap=path == "overlapped",
                                       bucket_cap_mb=bucket_cap_mb, uncompressed_patterns=[])
        reduction.setup(mesh, rank, world_size, 1, "gloo", None)
        reduction.attach(model, blocks, [])
        reductions[path] = reduction
    calls = [0]
    real = dist.all_reduce

    def counted(*a: object, **k: object) -> object:
        calls[0] += 1
        return real(*a, **k)

    dist.all_reduce = counted
    times: dict[str, list[tuple[float, float, int]]] = {p: [] for p in PATHS}
    try:
        for step in range(steps + 2):  # the first two allocate buffers: untimed
            for path in PATHS:
                model.zero_grad(set_to_none=True)
                exchange = reductions["overlapped"].exchange
                assert exchange is not None
                exchange.begin(active=path == "overlapped")
                dist.barrier()
                calls[0] = 0
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(text, image)["loss"]
                loss.backward()
                tail = time.perf_counter()
                if path != "backward":
                    reductions[path].reduce(model, torch.device("cpu"))
                end = time.perf_counter()
                if step >= 2:
                    times[path].append((end - start, end - tail, calls[0]))
    finally:
        dist.all_reduce = real
    out = {}
    for path, rows in times.items():
        out[path] = {"step_ms": round(1e3 * statistics.median(r[0] for r in rows), 2),
                     "tail_ms": round(1e3 * statistics.median(r[1] for r in rows), 2),
                     "all_reduces_per_step": statistics.median(r[2] for r in rows)}
    for path in ("end", "overlapped"):
        out[path]["added_ms"] = round(out[path]["step_ms"] - out["backward"]["step_ms"], 2)
        stats = reductions[path].powersgd.stats
        out[path]["bytes_per_rank"] = stats.bytes_sent_last_step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    args = parser.parse_args()
    results = run_distributed(worker, 2, args.rank, args.steps, args.bucket_cap_mb, timeout=900)
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    print(json.dumps({"processes": 2, "threads_per_process": 1, "rank": args.rank, "native_bf16": bf16,
                      "bucket_cap_mb": args.bucket_cap_mb, "by_path": results[0]}, indent=2))


if __name__ == "__main__":
    main()
