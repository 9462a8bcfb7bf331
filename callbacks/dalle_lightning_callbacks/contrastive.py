"""Contrastive (CLIP) score of generated images: how well each image matches the caption it was made from.

The score is the **mean cosine similarity** in [-1, 1] between the image and caption embeddings of the
contrastive model in use (the one that reranks samples), the same number :mod:`dalle_lightning.generation.rerank`
ranks candidates by. torchmetrics' ``CLIPScore`` reports ``100 * max(cos, 0)`` of a Hugging Face CLIP; this
metric keeps the raw cosine so it can be compared with reranking scores, and works with any open_clip model.

A scorer is anything with ``score(images, captions) -> FloatTensor[B]`` (e.g. ``dalle_lightning.generation.rerank.Reranker``)
or a plain callable with that signature. Sums travel as metric states, so the mean is exact on several ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

Scorer = Callable[[torch.Tensor, list[str]], torch.Tensor]


def as_scorer(scorer: Any) -> Scorer:
    """The ``(images, captions) -> cosine[B]`` function of ``scorer`` (an object with ``score`` or a callable)."""
    if hasattr(scorer, "score") and callable(scorer.score):
        return scorer.score
    if callable(scorer) and not isinstance(scorer, nn.Module):
        return scorer
    raise TypeError(
        f"contrastive scorer of type {type(scorer).__name__}; expected an object with score(images, captions) "
        "(e.g. dalle_lightning.generation.rerank.Reranker) or a callable (images, captions) -> FloatTensor[B]"
    )


class ContrastiveScore(Metric):
    """Mean cosine similarity between images ``[B, 3, H, W]`` in [0, 1] and their captions."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, scorer: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._score = as_scorer(scorer)
        # A scorer that is a module is registered as a child, so ``metric.to(device)`` moves it too.
        self.scorer = scorer if isinstance(scorer, nn.Module) else None
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, images: torch.Tensor, captions: list[str]) -> None:
        if isinstance(captions, str) or len(captions) != images.shape[0]:
            got = "a string" if isinstance(captions, str) else f"{len(captions)} captions"
            raise ValueError(f"{images.shape[0]} images but {got}; expected a list of one caption per image")
        scores = self._score(images, list(captions))
        if scores.shape != (images.shape[0],):
            raise ValueError(f"scorer returned shape {tuple(scores.shape)}; expected one score per image ({images.shape[0]},)")
        self.total += scores.detach().double().sum().to(self.total.device)
        self.count += images.shape[0]

    def compute(self) -> torch.Tensor:
        if self.count == 0:
            raise RuntimeError("ContrastiveScore has no images; call update() with at least one image first")
        return (self.total / self.count).float()
