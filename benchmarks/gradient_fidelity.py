"""Gradient fidelity of 16-bit residual branches: fp32 vs one global loss scale vs per-resblock scales.

A deep residual model (fp32 stem/head and gains, Linear-GELU-Linear branches) whose branch gains shrink by
2**-decay per block towards the input, so its branches' gradients span more binades than fp16 holds under one
scale. The model and batch stay fixed (SGD with lr 0); each method runs its own scale dynamics for a number of
update attempts, and the branch gradients of its last *applied* update are compared with the fp32 gradients:

- ``fp32``: the reference itself (cosine 1, its own share of exact zeros);
- ``global_gradscaler``: branches under fp16 autocast, ``torch.amp.GradScaler`` at its defaults;
- ``per_resblock_compressed``: the plugin with the paper's rules time-compressed (x2 growth per update, no
  cooldown), i.e. the scale spread the paper's rules reach after ~10^4 updates;
- ``per_resblock_paper``: the plugin with the paper's exact rules after ``--paper-updates`` attempts.

Prints one JSON object: per method the minimum and median per-block cosine similarity to fp32, the share of
exact zeros among the branch gradients, the skipped updates and the final log2 scale(s).

    python benchmarks/gradient_fidelity.py [--depth 32 --width 16 --decay 1.25 --updates 40 --paper-updates 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision  # noqa: E402
from tests.helpers.deep_residual import (  # noqa: E402
    DeepResidual,
    autocast_branches,
    branch_grads,
    cosine,
    regression_data,
    squared_error,
)


def summarize(grads: list[Tensor], reference: list[Tensor], **extra: Any) -> dict[str, Any]:
    cos = [cosine(g, r) for g, r in zip(grads, reference)]
    zeros = torch.cat(grads).eq(0).double().mean().item()
    return {"min_cosine": min(cos), "median_cosine": statistics.median(cos), "zero_share": zeros, **extra}


def run_gradscaler(model: DeepResidual, loss_fn: Callable[[], Tensor], updates: int) -> tuple[list[Tensor], dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    last, skipped = None, 0
    with autocast_branches(model):
        for _ in range(updates):
            opt.zero_grad()
            scaler.scale(loss_fn()).backward()
            scaler.unscale_(opt)
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                last = branch_grads(model)
            else:
                skipped += 1
            scaler.step(opt)
            scaler.update()
    assert last is not None, "GradScaler never applied an update; raise --updates"
    return last, {"skipped_updates": skipped, "log2_scale": float(torch.log2(torch.tensor(scaler.get_scale())))}


def run_plugin(
    model: DeepResidual, loss_fn: Callable[[], Tensor], updates: int, **rules: Any
) -> tuple[list[Tensor], dict]:
    plugin = ResblockScalingPrecision("fp16", **rules)
    plugin.convert_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    last = None

    def closure() -> Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    for _ in range(updates):
        skipped = plugin.scales.skipped
        plugin.optimizer_step(opt, model, closure)
        if plugin.scales.skipped == skipped:
            last = branch_grads(model)
    plugin.teardown()
    assert last is not None, "the plugin never applied an update; raise --updates"
    log2 = plugin.scales.log2
    extra = {"skipped_updates": plugin.scales.skipped, "log2_scale_min": log2.min().item()}
    return last, {**extra, "log2_scale_max": log2.max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decay", type=float, default=1.25, help="binades of gain lost per block towards the input")
    parser.add_argument("--updates", type=int, default=40, help="update attempts for GradScaler and compressed rules")
    parser.add_argument("--paper-updates", type=int, default=200, help="update attempts under the paper's exact rules")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = DeepResidual(args.depth, args.width, args.decay)
    x, y = regression_data(args.width, args.batch, args.seed)

    def loss_fn() -> Tensor:
        return squared_error(model, x, y)

    model.zero_grad()
    loss_fn().backward()
    reference = branch_grads(model)
    results: dict[str, Any] = {"fp32": summarize(reference, reference)}
    runs = {
        "global_gradscaler": lambda: run_gradscaler(model, loss_fn, args.updates),
        "per_resblock_compressed": lambda: run_plugin(model, loss_fn, args.updates, growth_factor=2.0, cooldown=0),
        "per_resblock_paper": lambda: run_plugin(model, loss_fn, args.paper_updates),
    }
    for name, run in runs.items():
        start = time.perf_counter()
        grads, extra = run()
        results[name] = summarize(grads, reference, **extra, seconds=round(time.perf_counter() - start, 2))
    print(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
