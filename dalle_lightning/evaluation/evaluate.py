"""Shapes-world evaluation of a trained pipeline: caption accuracy, FID, KID and contrastive score against best-of-N
(any other captioned data: ``evaluation.val_captions``).

Seen captions are fresh draws from the training distribution (no held-out colour-shape pair); zero-shot
captions each contain a held-out pair (red triangle, green circle, blue square) that no training image shows.
Best-of-N for every N reuses the same max(N) candidates per caption (the first N of them), so the curve over
N measures reranking alone, as in the paper's Figure 9.

FID and KID compare the best-of-N images with the world's own renders *of the same captions*, in every feature
space of ``evaluation.feature_spaces`` (the project's CLIP, ``clip``: the shapes CLIP here, since Inception knows
nothing of this world and needs a download; and an ``open_clip`` model when configured). Each score carries its
space in its name (``fid_clip``, ``kid_clip``, ``contrastive_clip``, ``fid_openclip_vit_b_32``, ...), so it is
never read as the Inception FID of papers. With a few hundred images FID is biased upwards, so beside each the
report gives its reference (``reference_fid_clip``, ...): the distance between the renders and renders of other
captions of the same split, the value a perfect generator would score (``evaluation.best_of_n``). The contrastive
score is the mean cosine similarity of each best-of-N image with its caption; its reference, that of the renders.

``any_of_n`` is the share of captions for which at least one of the first N candidates matches: the accuracy a
perfect reranker would reach. The gap between it and ``accuracy`` is the reranker's; the gap between it and 1 is
the generator's (prior and dVAE together). ``accuracy`` follows the chosen reranker (``rerank=clip|prior|both``);
``accuracy_clip``, ``accuracy_prior`` and ``accuracy_both`` give every reranker's pick of the same candidates.

Each split also carries its ``waterfall`` (``dalle_lightning.evaluation.waterfall``): renders, the dVAE's reconstructions and
its codes in use, any-of-N, each reranker's pick and one sample, for all captions and by object count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dalle_lightning.evaluation.best_of_n import best_of_n_scores
from dalle_lightning.evaluation.feature_spaces import CLIP_SPACE
from dalle_lightning.generation.generate import Generation, Generator
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.generation.selection import RERANKERS, check_rerank
from dalle_lightning.evaluation.waterfall import codebook_usage, object_groups, reconstruct, waterfall_rows
from dalle_lightning.world import Scene, caption_accuracy, render, sample_scene, sample_scenes
from dalle_lightning.world.detect import match, summarize_matches
from dalle_lightning.world.scene import split_rng


def eval_scenes(seed: int, split: str, n: int) -> list[Scene]:
    """The scenes behind ``sample_captions(seed, split, n)`` (stream 1): each evaluation caption with the
    scene it was drawn from, so it has a reference render."""
    if n < 0:
        raise ValueError(f"n={n} captions requested; expected n >= 0")
    rng = split_rng(seed, split, stream=1)
    return [sample_scene(rng, split) for _ in range(n)]


def images_of(scenes: list[Scene]) -> torch.Tensor:
    """Renders as ``FloatTensor[B, 3, H, W]`` in [0, 1]."""
    return torch.from_numpy(np.stack([render(s) for s in scenes])).permute(0, 3, 1, 2).float() / 255


def reference_accuracy(seed: int, split: str, n: int) -> float:
    """The detector on the world's own renders: the ceiling a perfect generator reaches (should be ~1.0)."""
    scenes = sample_scenes(seed, split, n)
    return caption_accuracy([render(s) for s in scenes], [s.caption for s in scenes])["accuracy"]


def rerankers_of(result: Generation) -> list[str]:
    """The rerankers whose scores ``result`` holds."""
    have = {"clip": result.scores is not None, "prior": result.prior_scores is not None}
    have["both"] = have["clip"] and have["prior"]
    return [r for r in RERANKERS if have[r]]


def split_waterfall(gen: Generator, captions: list[str], renders: torch.Tensor, ok: np.ndarray,
                    result: Generation) -> dict[str, Any]:
    """The split's waterfall at the largest N (``dalle_lightning.evaluation.waterfall``)."""
    recons, codes = reconstruct(gen.dvae, renders)
    renders_ok = np.array([match(image, c).ok for image, c in zip(renders, captions)])
    recon_ok = np.array([match(image, c).ok for image, c in zip(recons, captions)])
    picks = {r: result.best_index(ok.shape[1], r).numpy() for r in rerankers_of(result)}
    rows = waterfall_rows(renders_ok, recon_ok, ok, picks, object_groups(captions))
    return {"n": ok.shape[1], **rows, "codes": codebook_usage(codes, gen.dvae.vocab_size)}


def default_spaces(gen: Generator, spaces: dict[str, Reranker] | None) -> dict[str, Reranker]:
    """``spaces`` as given, else the project's CLIP alone (none without one)."""
    if spaces is not None:
        return spaces
    return {CLIP_SPACE: gen.reranker} if gen.reranker is not None else {}


def evaluate_split(gen: Generator, captions: list[str], candidates: list[int], reference: torch.Tensor | None = None,
                   baseline: torch.Tensor | None = None, rerank: str = "clip", fid: bool = True,
                   spaces: dict[str, Reranker] | None = None, **sampling: Any) -> dict[str, Any]:
    """Per N: accuracy (overall, per check and per reranker) and, in every feature space (``spaces``, default the
    project's CLIP), the contrastive score and, with ``fid``, FID and KID against ``reference`` (the captions' own
    renders), with their references (``baseline``: renders of other captions); given ``reference``, the split's
    waterfall as well."""
    result: Generation = gen.generate(captions, num_candidates=max(candidates), rerank=rerank, prior_scores=True,
                                      **sampling)
    spaces = default_spaces(gen, spaces)
    scores, references = best_of_n_scores(spaces, result, captions, candidates, reference, baseline, distances=fid,
                                           seed=sampling.get("seed", 0))
    # Every candidate is judged once; best-of-N accuracy and any-of-N are both read from these results.
    judged = [[match(image, caption) for image in images] for images, caption in zip(result.candidates, captions)]
    ok = np.array([[r.ok for r in row] for row in judged])  # [P, N]
    rows = np.arange(len(captions))
    report: dict[str, Any] = {}
    for n in candidates:
        best = result.best_index(n)
        entry: dict[str, Any] = summarize_matches([row[i] for row, i in zip(judged, best.tolist())])
        entry["any_of_n"] = float(ok[:, :n].any(axis=1).mean())
        for r in rerankers_of(result):
            entry[f"accuracy_{r}"] = float(ok[rows, result.best_index(n, r).numpy()].mean())
        report[str(n)] = {**entry, **scores[n]}
    report.update(references)
    if reference is not None:
        report["waterfall"] = split_waterfall(gen, captions, reference, ok, result)
    return report


def evaluate(gen: Generator, n_seen: int, n_zeroshot: int, candidates: list[int], seed: int = 0, fid: bool = True,
             rerank: str = "clip", spaces: dict[str, Reranker] | None = None, **sampling: Any) -> dict[str, Any]:
    """The report: per split, per N, overall, per-attribute and per-reranker accuracy, and in every feature space
    (``spaces``, default the project's CLIP) the kept images' contrastive score, FID and KID with their references;
    per split, the waterfall."""
    if not candidates or min(candidates) < 1:
        raise ValueError(f"candidates={candidates}; expected a non-empty list of N >= 1")
    if check_rerank(rerank) != "prior" and gen.reranker is None and max(candidates) > 1:
        raise ValueError(f"candidates={candidates} with rerank={rerank} needs the contrastive model (clip=...) for "
                         "N > 1; expected a clip file or rerank=prior")
    spaces = default_spaces(gen, spaces)
    out: dict[str, Any] = {"captions": "shapes", "candidates": list(candidates), "seed": seed, "rerank": rerank,
                           "spaces": list(spaces)}
    for split, n in (("seen", n_seen), ("zeroshot", n_zeroshot)):
        if n <= 0:
            continue
        world_split = "val" if split == "seen" else "zeroshot"
        scenes = eval_scenes(seed, world_split, n)
        reference = images_of(scenes)
        baseline = images_of(sample_scenes(seed, world_split, n)) if fid else None  # other renders, same split
        out[split] = evaluate_split(gen, [s.caption for s in scenes], candidates, reference, baseline, rerank=rerank,
                                    fid=fid, spaces=spaces, seed=seed, **sampling)
        out[split]["reference_renders"] = reference_accuracy(seed, world_split, min(n, 200))
    torch.manual_seed(seed)
    return out
