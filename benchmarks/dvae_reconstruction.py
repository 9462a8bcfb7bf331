"""What a trained dVAE's tokens can show, as JSON: the caption accuracy of its reconstructions (argmax codes ->
decoder) of fresh shapes-world renders, per split and object count, and the codebook use on those images.

The recipe of docs/results.md: ``caption_accuracy(dvae.reconstruct(images_of(eval_scenes(seed, split, n))))``.
Each split reports accuracy and the per-check shares overall and for one- and two-object captions; the codes in
use (distinct argmax codes) and the perplexity (exp of the code histogram's entropy) are over both splits' images.

Usage: ``python benchmarks/dvae_reconstruction.py [outputs/demo/dvae.pt] [--seed 1] [--n 200]``.
"""

from __future__ import annotations

import argparse
import json

import torch

from dalle_lightning.artifacts import load_model
from dalle_lightning.evaluation.evaluate import eval_scenes, images_of
from dalle_lightning.world import caption_accuracy

SPLITS = ("val", "zeroshot")


def perplexity(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def report(path: str, seed: int, n: int, batch: int = 100) -> dict:
    dvae = load_model(path).eval()
    counts = torch.zeros(dvae.vocab_size, dtype=torch.long)
    out: dict = {"model": path, "seed": seed, "n_per_split": n, "vocab_size": dvae.vocab_size}
    for split in SPLITS:
        scenes = eval_scenes(seed, split, n)
        images = images_of(scenes)
        recon, codes = [], []
        for start in range(0, len(images), batch):
            part = images[start : start + batch]
            idx = dvae.get_codebook_indices(part)
            codes.append(idx)
            recon.append(dvae.decode_indices(idx))
        counts += torch.bincount(torch.cat(codes).flatten(), minlength=dvae.vocab_size)
        recon = torch.cat(recon)
        row = {"all": caption_accuracy(recon, [s.caption for s in scenes])}
        for k in (1, 2):
            pick = [i for i, s in enumerate(scenes) if len(s.objects) == k]
            row[f"{k}_object"] = caption_accuracy(recon[pick], [scenes[i].caption for i in pick])
        out[split] = row
    out["codes_in_use"] = int((counts > 0).sum())
    out["perplexity"] = round(perplexity(counts), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="outputs/demo/dvae.pt", help="a dVAE artifact (default: the demo's)")
    parser.add_argument("--seed", type=int, default=1, help="eval_scenes seed (the demo evaluates seed 0)")
    parser.add_argument("--n", type=int, default=200, help="renders per split")
    args = parser.parse_args()
    print(json.dumps(report(args.model, args.seed, args.n), indent=1))


if __name__ == "__main__":
    main()
