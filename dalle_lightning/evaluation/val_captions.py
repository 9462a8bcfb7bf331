"""Evaluation on any captioned data: images generated for the val split's captions against the val split's images.

The shapes evaluation (``evaluation.evaluate``) draws fresh shapes-world captions and judges each image with the
shapes detector; neither exists for a user's own images. Here the captions are the first ``n`` of the val shards
(in shard order, so every run evaluates the same ones) and each caption's real image is the one it came with. Per N
(the best of the same max(N) draws, as there), in every feature space (``evaluation.feature_spaces``):
``fid_<space>``, ``kid_<space>`` against the val images and ``contrastive_<space>``; beside them the references
(``evaluation.best_of_n``), the distances between the val images and as many train images, which is what a
generator that drew real images would score at this sample size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dalle_lightning.data.splits import Split
from dalle_lightning.evaluation.best_of_n import best_of_n_scores
from dalle_lightning.evaluation.captioned_data import read_captioned
from dalle_lightning.generation.generate import Generator
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.generation.selection import check_rerank

log = logging.getLogger("dalle_lightning.eval")


def evaluate_val_captions(gen: Generator, images: torch.Tensor, captions: list[str], other: torch.Tensor | None,
                          candidates: list[int], spaces: dict[str, Reranker], seed: int = 0, fid: bool = True,
                          rerank: str = "clip", **sampling: Any) -> dict[str, Any]:
    """The ``val`` entry of the report: ``{N: scores}`` and the references, for ``captions`` and their real
    ``images`` (``[P, 3, S, S]`` in [0, 1]); ``other`` is the second real set of the distance references."""
    if not candidates or min(candidates) < 1:
        raise ValueError(f"candidates={candidates}; expected a non-empty list of N >= 1")
    if check_rerank(rerank) != "prior" and gen.reranker is None and max(candidates) > 1:
        raise ValueError(f"candidates={candidates} with rerank={rerank} needs the contrastive model (clip=...) for "
                         "N > 1; expected a clip file or rerank=prior")
    if len(images) != len(captions) or len(captions) < 2:
        raise ValueError(f"{len(images)} val images and {len(captions)} captions; expected one image per caption and "
                         "at least 2 of them")
    result = gen.generate(captions, num_candidates=max(candidates), rerank=rerank, seed=seed, **sampling)
    scores, references = best_of_n_scores(spaces, result, captions, candidates, images, other, distances=fid, seed=seed)
    out: dict[str, Any] = {str(n): scores[n] for n in candidates}
    out.update(references)
    out["images"] = len(captions)
    if other is not None:
        out["reference_images"] = len(other)
    return out


def evaluate_on_val(gen: Generator, val: Split, train: Split, n: int, candidates: list[int],
                    spaces: dict[str, Reranker], image_size: int, background: Any = (255, 255, 255), seed: int = 0,
                    fid: bool = True, rerank: str = "clip", **sampling: Any) -> dict[str, Any]:
    """The report on any captioned data: the first ``n`` samples of ``val`` (captions and images) evaluated as
    :func:`evaluate_val_captions` does, with as many images of ``train`` for the references, all read at
    ``image_size`` (the dVAE's)."""
    images, captions, val_skipped = read_captioned(val, n, image_size, background)
    if len(captions) < 2:
        raise ValueError(f"{val.describe()} holds {len(captions)} readable image-caption sample(s) (skipped: "
                         f"{val_skipped or 'none'}); expected at least 2 to evaluate on: name the val split of your data")
    other, _, train_skipped = read_captioned(train, len(captions), image_size, background) if fid else (None, [], {})
    if other is not None and len(other) < len(captions):
        log.warning("%s holds %d readable samples, fewer than the %d val images: the references compare %d with %d "
                    "and sit higher than a reference at equal size would", train.describe(), len(other),
                    len(captions), len(captions), len(other))
    out: dict[str, Any] = {"captions": "val", "candidates": list(candidates), "seed": seed, "rerank": rerank,
                           "spaces": list(spaces)}
    out["val"] = evaluate_val_captions(gen, images, captions, other, candidates, spaces, seed=seed, fid=fid,
                                       rerank=rerank, **sampling)
    out["data"] = {"val": val.describe(), "train": train.describe(), "image_size": image_size,
                   "skipped": {"val": val_skipped, "train": train_skipped}}
    return out
