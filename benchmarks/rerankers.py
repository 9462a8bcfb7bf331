"""Rerankers compared on one set of candidates, printed as JSON: which pick of N keeps most of any-of-N.

For fresh captions per split (``eval_scenes``: seen = the val split, zero-shot), N candidates are drawn once from a
trained pipeline and every candidate is judged once by ``caption_accuracy``'s matcher. Then each reranker picks
from the same candidates: ``clip`` (contrastive score), ``prior`` (log p(image | caption) - log p(image | null
caption)), ``both`` (the two standardised per caption and added: what ``rerank=both`` does), and two variants kept
out of the options: ``rank_average`` (mean of the two ranks) and ``likelihood`` (log p(image | caption) alone, no
null caption). Each is reported for all captions and by object count, with ``any_of_n`` (a perfect reranker),
``one_sample`` (mean over all candidates) and each pick's share of any-of-N.

Usage: ``python benchmarks/rerankers.py [--work outputs/demo] [--n 200] [--candidates 16] [--seed 2026]``;
without trained artifacts in ``--work`` it prints why and exits (``make bench`` runs every script).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dalle_lightning.evaluation.evaluate import eval_scenes
from dalle_lightning.generation.generate import Generator
from dalle_lightning.generation.prior_score import image_log_likelihood
from dalle_lightning.generation.selection import RERANKERS
from dalle_lightning.evaluation.waterfall import object_groups
from dalle_lightning.world.detect import match


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Per row, each entry's rank (0 = lowest)."""
    return scores.argsort(dim=1).argsort(dim=1).float()


def compare_split(gen: Generator, captions: list[str], n: int, seed: int, batch_size: int,
                  cond_scale: float) -> dict:
    result = gen.generate(captions, num_candidates=n, seed=seed, batch_size=batch_size, cond_scale=cond_scale,
                          prior_scores=True)
    ok = np.array([[match(image, c).ok for image in images] for images, c in zip(result.candidates, captions)])
    text = gen.tokenizer.encode_batch(captions).repeat_interleave(n, dim=0)
    flat = result.tokens.flatten(0, 1)
    likelihood = torch.cat([image_log_likelihood(gen.prior, text[i : i + batch_size], flat[i : i + batch_size])
                            for i in range(0, flat.shape[0], batch_size)]).view(len(captions), n)
    picks = {r: result.best_index(n, r).numpy() for r in RERANKERS}
    picks["rank_average"] = (ranks(result.scores) + ranks(result.prior_scores)).argmax(dim=1).numpy()
    picks["likelihood"] = likelihood.argmax(dim=1).numpy()
    rows = np.arange(len(captions))
    out = {}
    for group, mask in object_groups(captions).items():
        any_of_n = float(ok[mask].any(axis=1).mean())
        entry = {"captions": int(mask.sum()), "any_of_n": round(any_of_n, 4), "one_sample": round(float(ok[mask].mean()), 4)}
        for name, index in picks.items():
            acc = float(ok[rows, index][mask].mean())
            entry[f"pick_{name}"] = round(acc, 4)
            entry[f"kept_{name}"] = round(acc / any_of_n, 3) if any_of_n else None
        out[group] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="outputs/demo", help="folder with prior.pt, dvae.pt, clip.pt, tokenizer.json")
    parser.add_argument("--n", type=int, default=200, help="captions per split")
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--seed", type=int, default=2026, help="caption and sampling seed")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--cond-scale", type=float, default=2.5, help="as dalle-eval's default")
    args = parser.parse_args()
    work = Path(args.work)
    files = {k: work / f for k, f in (("prior", "prior.pt"), ("dvae", "dvae.pt"), ("clip", "clip.pt"),
                                       ("tokenizer", "tokenizer.json"))}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        print(json.dumps({"benchmark": "rerankers", "skipped": f"no trained artifacts: {missing}"}))
        return
    gen = Generator.from_files(**{k: str(v) for k, v in files.items()})
    start = time.perf_counter()
    report = {"benchmark": "rerankers", "work": str(work), "n": args.n, "candidates": args.candidates,
              "seed": args.seed, "cond_scale": args.cond_scale, "date": "2026-11-25", "machine": "2 CPU cores"}
    for split, world_split in (("seen", "val"), ("zeroshot", "zeroshot")):
        captions = [s.caption for s in eval_scenes(args.seed, world_split, args.n)]
        report[split] = compare_split(gen, captions, args.candidates, args.seed, args.batch_size, args.cond_scale)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
