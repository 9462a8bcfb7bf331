"""What the precision plugin costs against Lightning's own mixed precision, per training step of the prior, as JSON.

Each pair runs the same model, batch and fused AdamW through the real plugin objects' ``forward_context`` and
``optimizer_step`` (the calls Lightning's loop makes), one process, steps interleaved so that a disturbance of
the shared cores hits both sides alike:

- ``bf16``: ``ResblockScalingPrecision("bf16")`` against ``MixedPrecision("bf16-mixed")``;
- ``fp16``: ``ResblockScalingPrecision("fp16")`` against ``MixedPrecision("16-mixed", device="cpu")`` with its
  GradScaler (fp16 products are very slow on CPUs, so only the ``tiny`` shape by default).

``overhead`` is the median over pairs of (plugin step / reference step) - 1. The plugin's own work is then split
by the profiler into the branch boundaries (``ToBranch``/``FromBranch`` forward and backward), the per-block
unscale and check, and the fp32 work outside the branches that the paper prescribes (embeddings, the identity
path's layer norms, the output layer and the loss), which the reference runs in 16-bit.

Usage: ``python benchmarks/plugins_overhead.py [--shapes demo matched16] [--precisions bf16 fp16] [--pairs 7]``.
The strategy's cost against ``ddp`` is measured from the command line (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from prior_throughput import SHAPES
from torch.profiler import profile

from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins import ResblockScalingPrecision

SHAPES = {**SHAPES, "tiny": (dict(text_vocab_size=64, text_len=8, image_vocab_size=64, image_grid=4, n_layer=2,
                                  n_head=2, d_head=16), 8)}
DEFAULT_SHAPES = {"bf16": ["demo", "matched16"], "fp16": ["tiny"]}
BOUNDARY_OPS = ("ToBranch", "FromBranch")


def reference_step(precision: str, shape: str) -> Callable[[], None]:
    """Lightning's ``MixedPrecision`` step on the CPU (:func:`lightning_step`)."""
    model, optimizer, text, image = build(shape)
    return lightning_step(precision, "cpu", optimizer, lambda: model(text, image)["loss"])


def lightning_step(precision: str, device: str, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """Lightning's ``MixedPrecision`` step as its loop runs it: the forward under ``forward_context()`` (autocast
    over the whole model), the loss scaled by its GradScaler in fp16, unscale, step and ``update()``."""
    plugin = (MixedPrecision("bf16-mixed", device=device) if precision == "bf16"
              else MixedPrecision("16-mixed", device=device, scaler=torch.amp.GradScaler(device)))
    scaler = plugin.scaler

    def step() -> None:
        with plugin.forward_context():
            loss = loss_fn()
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
            return
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()

    return step


def plugin_step(precision: str, shape: str) -> Callable[[], None]:
    """The project's plugin: ``convert_module`` installs the branch boundaries; its ``optimizer_step`` runs the
    closure, unscales each block, agrees on the flags and steps (the path Lightning's loop calls)."""
    plugin = ResblockScalingPrecision(precision)
    model, optimizer, text, image = build(shape)
    model = plugin.convert_module(model)

    def closure() -> torch.Tensor:
        with plugin.forward_context():
            loss = model(text, image)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    return lambda: plugin.optimizer_step(optimizer, model, closure)


def build(shape: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    config, batch = SHAPES[shape]
    torch.manual_seed(0)
    model = DallePrior(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    text = torch.randint(1, config["text_vocab_size"], (batch, config["text_len"]))
    image = torch.randint(0, config["image_vocab_size"], (batch, config["image_grid"] ** 2))
    return model, optimizer, text, image


def split(step: Callable[[], None], steps: int = 3) -> dict[str, float]:
    """Share of a step's self CPU time in the branch boundaries and in the unscale-and-check kernels."""
    step()
    with profile() as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    boundary = sum(e.cpu_time_total for e in events if e.key.startswith(BOUNDARY_OPS) and "Backward" in e.key)
    unscale = sum(e.self_cpu_time_total for e in events if "non_finite_check_and_unscale" in e.key)
    return {"boundary_backward_share": round(boundary / total, 4), "unscale_share": round(unscale / total, 4)}


def measure(shape: str, precision: str, pairs: int) -> dict:
    step_ours, step_ref = plugin_step(precision, shape), reference_step(precision, shape)
    for step in (step_ours, step_ref, step_ours, step_ref):  # warm-up
        step()
    ratios, t_ours, t_ref = [], [], []
    for _ in range(pairs):
        a = time.perf_counter()
        step_ref()
        b = time.perf_counter()
        step_ours()
        c = time.perf_counter()
        t_ref.append(b - a)
        t_ours.append(c - b)
        ratios.append((c - b) / (b - a))
    return {"shape": shape, "precision": precision,
            "reference_step_ms": round(statistics.median(t_ref) * 1e3, 1),
            "plugin_step_ms": round(statistics.median(t_ours) * 1e3, 1),
            "overhead": round(statistics.median(ratios) - 1, 4), **split(step_ours)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp16"], default=["bf16", "fp16"])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None,
                        help="default: demo and matched16 in bf16, tiny in fp16")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(shape, precision, args.pairs)
               for precision in args.precisions for shape in (args.shapes or DEFAULT_SHAPES[precision])]
    print(json.dumps({"benchmark": "precision_plugin_overhead", "threads": torch.get_num_threads(),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
