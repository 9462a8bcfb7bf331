"""Text-to-image generation: prior samples image tokens, the dVAE decodes them, a reranker keeps the best.

The reranker is the contrastive model (``rerank="clip"``), the prior's own score of each candidate
(``rerank="prior"``, :mod:`dalle_lightning.generation.prior_score`) or both (:mod:`dalle_lightning.generation.selection`).

Python API::

    from dalle_lightning.generation.generate import Generator
    gen = Generator.from_files(prior="outputs/demo/prior.pt", dvae="outputs/demo/dvae.pt",
                               tokenizer="outputs/demo/tokenizer.json", clip="outputs/demo/clip.pt")
    result = gen.generate(["a red square above a blue circle"], num_candidates=8, seed=0, rerank="both")
    result.images  # FloatTensor[P, 3, H, W] in [0, 1], the best candidate per prompt

Candidates are drawn in batches with one seeded generator, so the same seed gives the same images.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from dalle_lightning.hardware import resolve_device
from dalle_lightning.artifacts import load_model
from dalle_lightning.lineage import check_pipeline
from dalle_lightning.generation.cast import check_dtype, sampling_copy, weights_dtype
from dalle_lightning.generation.prior_score import prior_score
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.generation.sampling import sample_image_tokens
from dalle_lightning.generation.selection import check_rerank, selection_scores
from dalle_lightning.data.tokenizer import CaptionTokenizer

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """Every candidate (``[P, N, 3, H, W]``), its contrastive score (``[P, N]``, None without a CLIP),
    the best candidate per prompt (``[P, 3, H, W]``), every candidate's image tokens (``[P, N, grid * grid]``,
    raster order: what the prior drew, before the dVAE decoded it), its prior score (``[P, N]``, None unless
    computed) and the reranker that picks the best (``clip|prior|both``)."""

    prompts: list[str]
    candidates: torch.Tensor
    scores: torch.Tensor | None
    images: torch.Tensor
    tokens: torch.Tensor | None = None
    prior_scores: torch.Tensor | None = None
    rerank: str = "clip"

    def best_index(self, n: int, rerank: str | None = None) -> torch.Tensor:
        """Per prompt, the index of the best of the first ``n`` candidates by ``rerank`` (default: the
        generation's own); ``n = 1``, or ``clip`` without a CLIP, keeps candidate 0."""
        rerank = check_rerank(rerank or self.rerank)
        if n == 1 or (rerank == "clip" and self.scores is None):
            return torch.zeros(len(self.prompts), dtype=torch.long)
        clip, prior = (None if s is None else s[:, :n] for s in (self.scores, self.prior_scores))
        return selection_scores(rerank, clip, prior).argmax(dim=1)

    def best_of(self, n: int, rerank: str | None = None) -> torch.Tensor:
        """The best of the first ``n`` candidates per prompt (``n = 1``: no reranking)."""
        return self.candidates[torch.arange(len(self.prompts)), self.best_index(n, rerank)]


def check_prompts(prompts: list[str]) -> list[str]:
    if not prompts:
        raise ValueError("no prompts given; expected at least one caption")
    cleaned = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt {i} is empty ({p!r}); expected a caption")
        cleaned.append(p.strip())
    return cleaned


class Generator:
    """Prior, dVAE, tokenizer and reranker on one device. ``dtype`` (``bf16``, ``fp16``, ``fp32``; default: the
    prior's weights as loaded) is the prior's compute dtype for sampling: its weights are cast once, into a copy
    this generator keeps (:mod:`dalle_lightning.generation.cast`), and every call samples from it without autocast;
    the prior's scores (``rerank=prior``) are computed with the prior as loaded."""

    def __init__(self, prior: nn.Module, dvae: nn.Module, tokenizer: CaptionTokenizer, reranker: Reranker | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None) -> None:
        self.device = torch.device(resolve_device(device) if isinstance(device, str) else device)  # "auto" too
        self.prior = prior.to(self.device).eval()
        self.dvae = dvae.to(self.device).eval()
        self.tokenizer = tokenizer
        self.reranker = reranker.to(self.device) if reranker is not None else None
        if self.prior.image_grid != self.dvae.grid_size:
            raise ValueError(f"prior image_grid={self.prior.image_grid} but dVAE grid_size={self.dvae.grid_size}")
        if self.prior.image_vocab_size != self.dvae.vocab_size:
            raise ValueError(f"prior image_vocab_size={self.prior.image_vocab_size} but dVAE vocab_size="
                             f"{self.dvae.vocab_size}; expected the dVAE the prior was trained with")
        if self.prior.text_vocab_size != tokenizer.vocab_size:
            raise ValueError(f"prior text_vocab_size={self.prior.text_vocab_size} but tokenizer vocab_size="
                             f"{tokenizer.vocab_size}; expected the tokenizer the prior was trained with")
        want = check_dtype(dtype)
        self.sampler = self.prior if want in (None, weights_dtype(self.prior)) else sampling_copy(self.prior, want)
        self.dtype = want or weights_dtype(self.prior)

    @classmethod
    def from_files(cls, prior: str | Path, dvae: str | Path, tokenizer: str | Path, clip: str | Path | None = None,
                   device: str = "cpu", dtype: torch.dtype | str | None = None) -> "Generator":
        """Load saved artifacts, after checking that they belong together (``lineage.check_pipeline``)."""
        check_pipeline(prior, dvae, tokenizer, clip)
        prior_model = load_model(prior)
        tok = CaptionTokenizer.load(tokenizer, text_len=prior_model.text_len)
        reranker = Reranker.from_saved(clip) if clip is not None else None
        return cls(prior_model, load_model(dvae), tok, reranker, device, dtype)

    @torch.no_grad()
    def generate(self, prompts: list[str], num_candidates: int = 1, batch_size: int = 64, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, cond_scale: float = 1.0, seed: int = 0,
                 image_prefix: torch.Tensor | None = None, progress: bool = False, rerank: str = "clip",
                 prior_scores: bool = False, graphs: bool | str = "auto") -> Generation:
        """Draw ``num_candidates`` images per prompt and keep the best by ``rerank`` (``clip`` without a CLIP
        loaded keeps the first). ``image_prefix`` (``[P, L]`` tokens, one row per prompt) starts every candidate of
        its prompt: image priming. ``prior_scores=True`` computes the prior's scores whatever ``rerank`` is."""
        prompts = check_prompts(list(prompts))
        if num_candidates < 1:
            raise ValueError(f"num_candidates={num_candidates}; expected >= 1")
        if check_rerank(rerank) == "both" and self.reranker is None:
            raise ValueError("rerank='both' needs the contrastive model; expected a clip file, or rerank=prior")
        p, n = len(prompts), num_candidates
        cut_before = getattr(self.tokenizer, "truncated", 0)  # a CaptionTokenizer counts the captions it cuts
        text = self.tokenizer.encode_batch(prompts).to(self.device)
        cut = getattr(self.tokenizer, "truncated", 0) - cut_before
        if cut:  # said once per call: the prior sees the first text_len tokens only
            log.warning("%d of %d prompts were longer than the prior's text_len=%d tokens and were cut (longest: %d)",
                        cut, p, self.tokenizer.text_len, self.tokenizer.longest)
        text = text.repeat_interleave(n, dim=0)  # [P*N, T]: candidates of one prompt are adjacent
        prefix = image_prefix.to(self.device).repeat_interleave(n, dim=0) if image_prefix is not None else None
        gen = torch.Generator(device=self.device).manual_seed(seed)
        images, drawn = [], []
        bar = tqdm(total=p * n, desc="sampling", disable=not progress, unit="img")
        for start in range(0, p * n, batch_size):
            chunk = slice(start, start + batch_size)
            tokens = sample_image_tokens(
                self.sampler, text[chunk], temperature=temperature, top_k=top_k, top_p=top_p, cond_scale=cond_scale,
                image_prefix=None if prefix is None else prefix[chunk], generator=gen, graphs=graphs,
            )
            grid = tokens.view(-1, self.prior.image_grid, self.prior.image_grid)
            images.append(self.dvae.decode_indices(grid).float().clamp(0, 1).cpu())
            drawn.append(tokens.cpu())
            bar.update(tokens.shape[0])
        bar.close()
        candidates = torch.cat(images).view(p, n, *images[0].shape[1:])
        scores = None
        if self.reranker is not None:
            scores = self.reranker.score(candidates.flatten(0, 1), [c for c in prompts for _ in range(n)]).view(p, n).cpu()
        tokens = torch.cat(drawn)
        by_prior = None
        if prior_scores or rerank != "clip":
            by_prior = prior_score(self.prior, text, tokens.to(self.device), batch_size).view(p, n).cpu()
        result = Generation(prompts, candidates, scores, candidates[:, 0], tokens.view(p, n, -1), by_prior, rerank)
        result.images = result.best_of(n)
        return result
