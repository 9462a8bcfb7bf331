"""Scores of the best-of-N images in every feature space, and the reference beside each.

For each N, the image kept per caption is the reranker's best of that caption's first N candidates (all N reuse
the same max(N) draws, so the curve over N measures reranking alone, as in the paper's Figure 9). In every feature
space (``evaluation.feature_spaces``: ``clip``, ``openclip_<arch>``) the kept images get

- ``fid_<space>``, ``kid_<space>``: FID and KID against ``real``, real images of the same captions (the val
  images of the val captions; on the shapes world, the world's renders of the evaluated captions);
- ``contrastive_<space>``: the mean cosine of each kept image with its caption.

Beside them, per space, what real images score, so that a figure can be read (FID in an unfamiliar or collapsed
space can be 1e-5 or 50 for the same quality):

- ``reference_fid_<space>``, ``reference_kid_<space>``: ``real`` against ``other``, another real set of the same
  size (train images; on the shapes world, renders of other captions): the value of a perfect generator at
  this sample size;
- ``reference_contrastive_<space>``: the mean cosine of the real images with their own captions;
- ``spread_<space>``: the total variance of the real images' features (at most 1 for unit-norm features); near 0
  the space has collapsed (an untrained or barely trained CLIP maps every image to nearly the same point) and
  every distance in it is near 0 too, which a warning says.

Every image is embedded once per space; subsets are then taken from the features.
"""

from __future__ import annotations

import logging
import torch

from dalle_lightning.evaluation import feature_distances
from dalle_lightning.generation.generate import Generation
from dalle_lightning.generation.rerank import Reranker

log = logging.getLogger("dalle_lightning.eval")

COLLAPSED_SPREAD = 1e-3  # below this total variance of unit-norm features, a space is reported as collapsed


def _contrastive(images: torch.Tensor, texts: torch.Tensor) -> float:
    return float((images * texts).sum(dim=-1).mean())


def best_of_n_scores(spaces: dict[str, Reranker], result: Generation, captions: list[str], candidates: list[int],
                     real: torch.Tensor | None, other: torch.Tensor | None = None, distances: bool = True,
                     seed: int = 0) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """``({N: {score: value}}, {reference score: value})`` of ``result``'s best-of-N in every space of ``spaces``
    (see the module docstring). ``real`` holds one real image per caption; ``other`` (another real set, ideally as
    large) gives the distance references. With ``distances=False``, or fewer than 2 captions, only the contrastive
    scores are computed; without ``real``, only those of the kept images."""
    p, n_max = result.candidates.shape[:2]
    if len(captions) != p or (real is not None and len(real) != p):
        raise ValueError(f"{p} captions of candidates, {len(captions)} captions and "
                         f"{'no' if real is None else len(real)} real images; expected one caption and one real "
                         "image per row of candidates")
    if not candidates or max(candidates) > n_max:
        raise ValueError(f"candidates={candidates}; expected N values between 1 and the {n_max} drawn")
    picks = {n: result.best_index(n) for n in candidates}
    rows = torch.arange(p)
    distances = distances and p >= 2 and real is not None
    per_n: dict[int, dict[str, float]] = {n: {} for n in candidates}
    reference: dict[str, float] = {}
    for name, model in spaces.items():
        drawn = model.embed_images(result.candidates.flatten(0, 1)).cpu().view(p, n_max, -1)
        texts = model.embed_texts(captions).cpu()
        real_features = model.embed_images(real).cpu() if real is not None else None
        for n in candidates:
            kept = drawn[rows, picks[n]]
            per_n[n][f"contrastive_{name}"] = _contrastive(kept, texts)
            if distances and real_features is not None:
                per_n[n][f"fid_{name}"] = feature_distances.fid(real_features, kept)
                per_n[n][f"kid_{name}"] = feature_distances.kid(real_features, kept, seed)
        if real_features is None:
            continue
        reference[f"reference_contrastive_{name}"] = _contrastive(real_features, texts)
        if distances and other is not None and len(other) >= 2:
            other_features = model.embed_images(other).cpu()
            reference[f"reference_fid_{name}"] = feature_distances.fid(real_features, other_features)
            reference[f"reference_kid_{name}"] = feature_distances.kid(real_features, other_features, seed)
        if p >= 2:
            reference[f"spread_{name}"] = feature_distances.spread(real_features)
            if reference[f"spread_{name}"] < COLLAPSED_SPREAD:
                log.warning("the %s image features of the real images barely differ (total variance %.2g, at most 1): "
                            "the model is untrained or collapsed, so every distance in it is near 0 (compare with "
                            "reference_fid_%s); train it longer or measure with open_clip=", name,
                            reference[f"spread_{name}"], name)
    return per_n, reference

