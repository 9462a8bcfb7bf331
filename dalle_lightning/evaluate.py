"""Shapes-world evaluation of a trained pipeline: caption accuracy of generated images, seen and zero-shot.

Seen captions are fresh draws from the training distribution (no held-out colour-shape pair); zero-shot
captions each contain a held-out pair (red triangle, green circle, blue square) that no training image shows.
Best-of-N for every N reuses the same max(N) candidates per caption (the first N of them), so the curve over
N measures reranking alone, as in the paper's Figure 9.
"""

from __future__ import annotations

from typing import Any

import torch

from dalle_lightning.generate import Generation, Generator
from dalle_lightning.world import caption_accuracy, render, sample_captions, sample_scenes


def reference_accuracy(seed: int, split: str, n: int) -> float:
    """The detector on the world's own renders: the ceiling a perfect generator reaches (should be ~1.0)."""
    scenes = sample_scenes(seed, split, n)
    return caption_accuracy([render(s) for s in scenes], [s.caption for s in scenes])["accuracy"]


def evaluate_split(gen: Generator, captions: list[str], candidates: list[int], **sampling: Any) -> dict[str, Any]:
    result: Generation = gen.generate(captions, num_candidates=max(candidates), **sampling)
    report: dict[str, Any] = {}
    for n in candidates:
        entry: dict[str, Any] = caption_accuracy(result.best_of(n), captions)
        if result.scores is not None:
            entry["contrastive_score"] = float(result.scores[:, :n].max(dim=1).values.mean())
        report[str(n)] = entry
    return report


def evaluate(gen: Generator, n_seen: int, n_zeroshot: int, candidates: list[int], seed: int = 0,
             **sampling: Any) -> dict[str, Any]:
    """The report: per split, per N, overall and per-attribute accuracy (and mean best contrastive score)."""
    if not candidates or min(candidates) < 1:
        raise ValueError(f"candidates={candidates}; expected a non-empty list of N >= 1")
    if gen.reranker is None and max(candidates) > 1:
        raise ValueError(f"candidates={candidates} needs a reranker (clip=...) for N > 1")
    out: dict[str, Any] = {"candidates": list(candidates), "seed": seed}
    for split, n in (("seen", n_seen), ("zeroshot", n_zeroshot)):
        if n <= 0:
            continue
        world_split = "val" if split == "seen" else "zeroshot"
        captions = sample_captions(seed, world_split, n)
        out[split] = evaluate_split(gen, captions, candidates, seed=seed, **sampling)
        out[split]["reference_renders"] = reference_accuracy(seed, world_split, min(n, 200))
    torch.manual_seed(seed)
    return out
