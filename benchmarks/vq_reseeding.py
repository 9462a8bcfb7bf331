"""How many codes the vector-quantised dVAE re-seeds from the batch per update, as JSON lines.

``vector_quantize_pytorch`` replaces a code whose running (EMA) count per batch falls below
``threshold_ema_dead_code``. That count is per batch, so a threshold near the mean count per code (latents per
batch / codes: 8 x 64 / 512 = 1 at the demo's batch) replaces most of the codebook at every update, and the
codebook becomes a sample of recent batches. This trains ``conf/model/dvae_vq.yaml``'s sizes in-process on fresh
train-split renders (batch 8, AdamW 3e-3) and counts the replacements (the library's dead-code mask) per interval.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/vq_reseeding.py --thresholds 2.0 0.1 0.01 --steps 100``.
"""

from __future__ import annotations

import argparse
import json

import torch
from dvae_bottleneck import batches
from dvae_throughput import MODELS

from dalle_lightning.models.dvae_vq import VQVAE


def count_reseeds(model: VQVAE) -> list[int]:
    """Wrap the codebook's ``replace`` so every call adds its number of re-seeded codes to the returned list."""
    codebook = model.quantizer._codebook
    replace, counts = codebook.replace, [0]

    def counting(batch_samples: torch.Tensor, batch_mask: torch.Tensor, seq_mask: torch.Tensor | None = None) -> None:
        counts[0] += int(batch_mask.sum())
        replace(batch_samples, batch_mask, seq_mask)

    codebook.replace = counting
    return counts


def run(threshold: float, steps: int, every: int, batch: int) -> None:
    torch.manual_seed(0)
    model = MODELS["vq"](threshold_ema_dead_code=threshold)  # dvae_throughput's: dvae_vq.yaml's sizes, paper widths
    model._threshold_checked = True  # the model refuses a threshold at or above the mean count; show why it does
    counts = count_reseeds(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    for step, images in enumerate(batches(batch, 1000), start=1):
        out = model(images)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        if step % every == 0:
            print(json.dumps({"threshold": threshold, "update": step, "reseeded_per_update": counts[0] / every,
                              "codes_in_batch": int(out["indices"].unique().numel()),
                              "recon_loss": round(out["recon_loss"].item(), 4)}), flush=True)
            counts[0] = 0
        if step >= steps:
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[2.0, 0.1, 0.01])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=20, help="updates per printed line")
    parser.add_argument("--batch", type=int, default=8, help="images per batch (the demo's: 8)")
    args = parser.parse_args()
    for threshold in args.thresholds:
        run(threshold, args.steps, args.every, args.batch)


if __name__ == "__main__":
    main()
