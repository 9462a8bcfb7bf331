"""Which candidate to keep: the contrastive score, the prior's own score, or both (``rerank=clip|prior|both``).

The two scores live on unrelated scales (a cosine in [-1, 1]; a log-likelihood ratio in nats that grows with the
number of image tokens), so ``both`` standardises each over the candidates being compared (per prompt: minus the
mean, over the standard deviation) and adds them: each score then counts by how far it sets a candidate apart
from its siblings, not by its units. A rank average was measured beside it (docs/results.md).
"""

from __future__ import annotations

import torch

RERANKERS = ("clip", "prior", "both")


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """Per row of ``[P, n]``: zero mean, unit standard deviation (a row of equal scores becomes zeros)."""
    centred = scores - scores.mean(dim=1, keepdim=True)
    std = scores.std(dim=1, unbiased=False, keepdim=True)
    return torch.where(std > 0, centred / std.clamp_min(1e-12), torch.zeros_like(centred))


def check_rerank(rerank: str) -> str:
    if rerank not in RERANKERS:
        raise ValueError(f"rerank={rerank!r}; expected one of {'|'.join(RERANKERS)}")
    return rerank


def selection_scores(rerank: str, clip: torch.Tensor | None, prior: torch.Tensor | None) -> torch.Tensor:
    """The ``[P, n]`` scores ``rerank`` keeps the largest of, from the contrastive and prior scores ``[P, n]``."""
    check_rerank(rerank)
    needed = {"clip": (clip,), "prior": (prior,), "both": (clip, prior)}[rerank]
    if any(s is None for s in needed):
        missing = " and ".join(n for n, s in (("contrastive", clip), ("prior", prior)) if s is None)
        raise ValueError(f"rerank={rerank!r} without {missing} scores; expected a clip file for clip|both")
    if rerank == "clip":
        return clip
    if rerank == "prior":
        return prior
    return standardise(clip.float()) + standardise(prior.float())
