"""What one PowerSGD exchange costs on the demo prior's gradients, and of what it is made, as JSON.

Two gloo processes on 127.0.0.1, one thread each (2 simulated nodes of one device, as ``strategy.devices_per_node=1``
with ``trainer.devices=2``), random gradients of the demo prior's shapes (``prior_throughput.py``'s ``demo``, with the demo
tokenizer's 350 words), embeddings sent uncompressed as the strategy does. Per PowerSGD rank:

- ``reduce_ms``: ``PowerSGD.reduce`` as the strategy calls it (skip decision agreed beforehand, dense gradients in
  P's all-reduce), median over the exchanges, each started after a barrier so that neither process waits for the
  other's previous work;
- ``in_all_reduce_ms``, ``all_reduces``: the wall time per exchange inside its all-reduces (waiting for the other
  process included) and their number;
- ``arithmetic_ms``: the same compression in one process without collectives (the means are the local values);
- ``finite_check_ms``: the skip decision's local check over every gradient;
- ``all_reduce_ms``: one all-reduce of the P buffer's size and of one element, which bound what the three
  collectives of a step cost on this link;
- bytes this rank sends against the uncompressed gradient.

Usage: ``python benchmarks/powersgd_exchange.py [--ranks 4 16 32] [--exchanges 40]``. The exchange inside a real run
is ``strategy/reduce_ms_per_step`` in a run's metrics.json (``benchmarks/plugins_cli.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from dalle_lightning.models.prior import DallePrior  # noqa: E402
from prior_throughput import SHAPES  # noqa: E402
from dalle_lightning_plugins.compression.powersgd import PowerSGD, plan_rank  # noqa: E402
from dalle_lightning_plugins.compression.step_flags import finite_per_tensor  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

PRIOR = {**SHAPES["demo"][0], "text_vocab_size": 350}  # the demo tokenizer's 350 words


def prior_gradients(seed: int) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """Gradients of the demo prior's shapes, and the names the strategy leaves uncompressed (embeddings)."""
    torch.manual_seed(seed)
    model = DallePrior(**PRIOR)
    named = [(n, 1e-3 * torch.randn_like(p)) for n, p in model.named_parameters()]
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    return named, embeddings


def median_ms(fn: Callable[[], object], runs: int, sync: bool = False) -> float:
    fn()
    times = []
    for _ in range(runs):
        if sync:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def worker(rank: int, world_size: int, ranks: list[int], exchanges: int) -> dict:
    grads, embeddings = prior_gradients(seed=rank)
    alone_groups = [dist.new_group([i]) for i in range(world_size)]  # a replicate group of one: no collectives
    out: dict = {}
    for r in ranks:
        psgd = PowerSGD(None, rank=r, dense_with_p=True)

        def exchange() -> None:
            psgd.reduce([(n, g.clone()) for n, g in grads], uncompressed=embeddings, finite=True)

        clone_ms = median_ms(lambda: [g.clone() for _, g in grads], exchanges)
        waited = [0.0, 0]
        real = dist.all_reduce

        def timed_all_reduce(*a: object, **k: object) -> object:
            start = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                waited[0] += time.perf_counter() - start
                waited[1] += 1

        dist.all_reduce = timed_all_reduce
        try:
            entry = {"reduce_ms": round(median_ms(exchange, exchanges, sync=True) - clone_ms, 3)}
        finally:
            dist.all_reduce = real
        entry["in_all_reduce_ms"] = round(1e3 * waited[0] / (exchanges + 1), 3)
        entry["all_reduces"] = waited[1] // (exchanges + 1)
        low = [(n, g, plan_rank(g.shape, r, psgd.min_compression)) for n, g in grads if n not in embeddings]
        low = [item for item in low if item[2]]
        alone = PowerSGD(alone_groups[rank], rank=r)
        entry["arithmetic_ms"] = round(median_ms(
            lambda: alone._reduce_low_rank([alone.form(n, g.clone(), k, staged=False) for n, g, k in low]), exchanges) - clone_ms, 3)
        entry["finite_check_ms"] = median_ms(lambda: bool(finite_per_tensor([g for _, g in grads]).all()), exchanges)
        p_numel = sum(g.shape[0] * k for _, g, k in low) + sum(g.numel() for n, g in grads if n in embeddings or g.ndim < 2)
        entry["all_reduce_ms"] = {
            "p_buffer": median_ms(lambda: dist.all_reduce(torch.zeros(p_numel)), exchanges, sync=True),
            "one_element": median_ms(lambda: dist.all_reduce(torch.zeros(1)), exchanges, sync=True),
        }
        entry["bytes_per_rank"] = psgd.stats.bytes_sent_last_step
        entry["uncompressed_bytes_per_rank"] = psgd.stats.uncompressed_bytes_last_step
        entry["compressed_matrices"] = len(low)
        out[str(r)] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--exchanges", type=int, default=40)
    args = parser.parse_args()
    results = run_distributed(worker, 2, args.ranks, args.exchanges, timeout=600)
    print(json.dumps({"processes": 2, "threads_per_process": 1, "by_rank": results[0]}, indent=2))


if __name__ == "__main__":
    main()
