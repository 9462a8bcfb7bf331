"""The prior's own judgement of a candidate: how much more likely its caption makes its image tokens.

``score = log p(tokens | caption) - log p(tokens | null caption)``, each a sum over the image tokens of the
prior's log-softmax, read from one teacher-forced forward pass. The null caption is the all-padding text that
super-conditioning trains the prior on (``PriorModule(caption_dropout=...)``) and samples against
(``sampling.sample_image_tokens(cond_scale=...)``), so no new model is needed. The difference is a pointwise mutual
information: it rewards tokens the caption explains and discounts tokens that are likely anyway (an empty
background, a common shape), which the plain likelihood would favour.

This is not the caption-likelihood-among-negatives score (docs/experiments.md): that compares captions for one
image; this compares images for one caption, which is what a reranker has to do.
"""

from __future__ import annotations

import torch

from dalle_lightning.models.prior import DallePrior


@torch.no_grad()
def image_log_likelihood(prior: DallePrior, text: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(tokens | text)`` under teacher forcing: ``FloatTensor[B]`` for ``text [B, T]``, ``tokens [B, N]``."""
    if tokens.dim() != 2 or tokens.shape[1] != prior.image_len:
        raise ValueError(f"image tokens of shape {tuple(tokens.shape)}; expected [batch, {prior.image_len}]")
    _, logits = prior.logits(text, tokens[:, :-1])  # image logit j predicts token j
    return logits.float().log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).sum(dim=-1)


@torch.no_grad()
def prior_score(prior: DallePrior, text: torch.Tensor, tokens: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """``log p(tokens | text) - log p(tokens | null caption)`` per row, ``FloatTensor[B]`` (see the module
    docstring). The conditional and null halves of each batch run as one forward pass of ``2 * batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; expected a positive number of sequences per forward pass")
    if text.shape[0] != tokens.shape[0]:
        raise ValueError(f"{text.shape[0]} captions but {tokens.shape[0]} token rows; expected one caption per row")
    was_training = prior.training
    prior.eval()
    out = []
    try:
        for start in range(0, text.shape[0], batch_size):
            t, x = text[start : start + batch_size], tokens[start : start + batch_size]
            both = image_log_likelihood(prior, torch.cat([t, torch.zeros_like(t)]), torch.cat([x, x]))
            cond, null = both.chunk(2)
            out.append(cond - null)
    finally:
        prior.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)
