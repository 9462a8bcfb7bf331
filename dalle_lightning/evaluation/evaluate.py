"""Shapes-world evaluation of a trained pipeline: caption accuracy, FID and contrastive score against best-of-N.

Seen captions are fresh draws from the training distribution (no held-out colour-shape pair); zero-shot
captions each contain a held-out pair (red triangle, green circle, blue square) that no training image shows.
Best-of-N for every N reuses the same max(N) candidates per caption (the first N of them), so the curve over
N measures reranking alone, as in the paper's Figure 9.

FID compares the best-of-N images with the world's own renders *of the same captions*, in the feature space
of the reranker's image tower (the shapes CLIP; Inception knows nothing of this world and needs a download).
The report names it after that space, ``fid_shapes_clip``, so it is never read as the Inception FID of papers.
With a few hundred images FID is biased upwards, so the report also gives ``reference_fid_shapes_clip``: the FID
between two independent sets of renders of the same size, the value a perfect generator would score.
The contrastive score is the mean cosine similarity of each best-of-N image with its caption.

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

from dalle_lightning_callbacks.fid import build_fid
from dalle_lightning.generation.generate import Generation, Generator
from dalle_lightning.generation.selection import RERANKERS, check_rerank
from dalle_lightning.evaluation.waterfall import codebook_usage, object_groups, reconstruct, waterfall_rows
from dalle_lightning.world import Scene, caption_accuracy, render, sample_scene, sample_scenes
from dalle_lightning.world.detect import match, summarize_matches
from dalle_lightning.world.scene import split_rng

FID_KEY = "fid_shapes_clip"  # report key of the FID in the shapes CLIP's image features


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


def fid_curve(features: Any, reference: torch.Tensor, result: Generation, candidates: list[int],
              baseline: torch.Tensor | None = None) -> tuple[dict[int, float], float | None]:
    """FID of best-of-N images vs ``reference`` for each N, and of ``baseline`` renders vs ``reference``."""
    fid = build_fid(features, reset_real_features=False)  # the reference features are computed once
    fid.update(reference, real=True)

    def against_reference(images: torch.Tensor) -> float:
        fid.update(images, real=False)
        value = float(fid.compute())
        fid.reset()  # drops the generated features only
        return value

    curve = {n: against_reference(result.best_of(n)) for n in candidates}
    return curve, against_reference(baseline) if baseline is not None else None


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


def evaluate_split(gen: Generator, captions: list[str], candidates: list[int], reference: torch.Tensor | None = None,
                   baseline: torch.Tensor | None = None, rerank: str = "clip", fid: bool = True,
                   **sampling: Any) -> dict[str, Any]:
    """Per N: accuracy (overall, per check and per reranker), contrastive score and, with ``fid``, FID against
    ``reference`` (the captions' own renders); given ``reference``, the split's waterfall as well."""
    result: Generation = gen.generate(captions, num_candidates=max(candidates), rerank=rerank, prior_scores=True,
                                      **sampling)
    fids: dict[int, float] = {}
    reference_fid: float | None = None
    if fid and reference is not None and gen.reranker is not None and len(captions) >= 2:
        fids, reference_fid = fid_curve(gen.reranker, reference, result, candidates, baseline)
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
        if result.scores is not None:  # the contrastive score of the image kept
            entry["contrastive_score"] = float(result.scores[rows, best].mean())
        if n in fids:
            entry[FID_KEY] = fids[n]
        report[str(n)] = entry
    if reference_fid is not None:
        report[f"reference_{FID_KEY}"] = reference_fid
    if reference is not None:
        report["waterfall"] = split_waterfall(gen, captions, reference, ok, result)
    return report


def evaluate(gen: Generator, n_seen: int, n_zeroshot: int, candidates: list[int], seed: int = 0, fid: bool = True,
             rerank: str = "clip", **sampling: Any) -> dict[str, Any]:
    """The report: per split, per N, overall, per-attribute and per-reranker accuracy, the kept images' mean
    contrastive score and FID; per split, the waterfall."""
    if not candidates or min(candidates) < 1:
        raise ValueError(f"candidates={candidates}; expected a non-empty list of N >= 1")
    if check_rerank(rerank) != "prior" and gen.reranker is None and max(candidates) > 1:
        raise ValueError(f"candidates={candidates} with rerank={rerank} needs the contrastive model (clip=...) for "
                         "N > 1; expected a clip file or rerank=prior")
    out: dict[str, Any] = {"candidates": list(candidates), "seed": seed, "rerank": rerank}
    for split, n in (("seen", n_seen), ("zeroshot", n_zeroshot)):
        if n <= 0:
            continue
        world_split = "val" if split == "seen" else "zeroshot"
        scenes = eval_scenes(seed, world_split, n)
        reference = images_of(scenes)
        baseline = images_of(sample_scenes(seed, world_split, n)) if fid else None  # other renders, same split
        out[split] = evaluate_split(gen, [s.caption for s in scenes], candidates, reference, baseline, rerank=rerank,
                                    fid=fid, seed=seed, **sampling)
        out[split]["reference_renders"] = reference_accuracy(seed, world_split, min(n, 200))
    torch.manual_seed(seed)
    return out
