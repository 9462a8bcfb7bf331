"""Drawing image tokens from the prior: KV cache, temperature / top-k / top-p, super-conditioning, priming.

- **KV cache**: the prompt (caption and any image prefix) runs once; each new image token is then one query
  against the cached keys of its own mask row (:meth:`DallePrior.decode`), so nothing is recomputed.
- **Super-conditioning** (classifier-free guidance, as in dalle-mini): the prior is trained with some captions
  replaced by all-padding (``PriorModule(caption_dropout=...)``); here the conditional and unconditional streams run
  as one batch of ``2B`` and ``logits = uncond + cond_scale * (cond - uncond)``. ``cond_scale = 1`` is plain
  conditional sampling and skips the unconditional half.
- **Image priming**: ``image_prefix`` holds the first tokens in raster order (e.g. the top 15 of 32 rows, the
  paper's image-to-image translation); they are kept as given and the rest is generated.
- **CUDA graphs** (``graphs``): on a GPU the decode step is captured once and replayed for every token
  (:mod:`dalle_lightning.generation.graph_decode`), the same tokens as the eager step.
- **Compute dtype** (``dtype``, or the caller's autocast): the weights are cast once per call into a copy in that
  dtype and sampling runs without autocast, as gpt-fast samples (:mod:`dalle_lightning.generation.cast`), so a
  step reads each weight once in 16 bits instead of casting it again at every token.
- **Reproducible**: one uniform number per image per step from ``generator``, turned into a token by inverting the
  filtered distribution's CDF, so cached and uncached sampling draw exactly the same tokens for the same seed.
"""

from __future__ import annotations

import contextlib

import torch

from dalle_lightning.generation.cast import sampling_model
from dalle_lightning.generation.graph_decode import DecodeStep, decode_step, use_graphs
from dalle_lightning.models.prior import DallePrior, KVCache


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to ``-inf`` all but the ``top_k`` largest logits and outside the smallest set of most likely tokens
    whose probability reaches ``top_p`` (the most likely token always survives)."""
    vocab = logits.shape[-1]
    if top_k is not None:
        if not 1 <= top_k:
            raise ValueError(f"top_k={top_k}; expected a positive number of tokens")
        kth = logits.topk(min(top_k, vocab), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p}; expected a probability in (0, 1]")
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token ``[B]`` whose CDF interval under ``softmax(logits)`` contains ``uniform [B]`` (inverse-CDF sampling)."""
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    target = uniform.unsqueeze(-1) * cdf[..., -1:]
    return (cdf <= target).sum(dim=-1).clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def sample_image_tokens(
    model: DallePrior,
    text: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    cond_scale: float = 1.0,
    image_prefix: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    graphs: bool | str = "auto",
    dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Sample ``[B, N]`` image tokens for captions ``text [B, T]`` (0 = padding), see the module docstring.
    ``graphs``: replay the decode step as a CUDA graph (``auto``: on a GPU, for an unsharded model). ``dtype``: the
    compute dtype (``bf16``, ``fp16``, ``fp32``; default autocast's where it is on, else the weights' own); weights
    in another dtype are cast once, into a copy, for this call."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}; expected a positive number")
    b, n_image = text.shape[0], model.image_len
    tokens = torch.zeros(b, n_image, dtype=torch.long, device=text.device)
    start = 0
    if image_prefix is not None:
        if image_prefix.dim() != 2 or image_prefix.shape[0] != b or image_prefix.shape[1] >= n_image:
            raise ValueError(
                f"image_prefix of shape {tuple(image_prefix.shape)}; expected [{b}, < {n_image}] raster-order tokens"
            )
        start = image_prefix.shape[1]
        tokens[:, :start] = image_prefix
    guided = cond_scale != 1.0
    text_in = torch.cat([text, torch.zeros_like(text)]) if guided else text

    def both(x: torch.Tensor) -> torch.Tensor:  # the same tokens feed the conditional and unconditional halves
        return torch.cat([x, x]) if guided else x

    def pick(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if guided:
            cond, uncond = logits.chunk(2)
            logits = uncond + cond_scale * (cond - uncond)
        logits = filter_logits(logits / temperature, top_k, top_p)
        device = generator.device if generator is not None else logits.device
        uniform = torch.rand(b, generator=generator, device=device).to(logits.device)
        return draw(logits, uniform)

    was_training = model.training
    model.eval()
    sampler, no_autocast = sampling_model(model, text.device, dtype)
    try:
        with torch.autocast(text.device.type, enabled=False) if no_autocast else contextlib.nullcontext():
            if use_cache:
                cache = KVCache()
                logits = sampler.prefill(text_in, both(tokens[:, :start]), cache)
                step: DecodeStep | None = None
                for n in range(start, n_image):
                    tokens[:, n] = pick(logits)
                    if n < n_image - 1:
                        if step is None:  # the cache is whole now: a graph may hold its addresses
                            graphed = use_graphs(graphs, text.device, sampler)
                            step = decode_step(sampler, cache, both(tokens[:, n]), graphed)
                        logits = step(both(tokens[:, n]), n)
            else:
                for n in range(start, n_image):
                    tokens[:, n] = pick(sampler.logits(text_in, both(tokens[:, :n]))[1][:, -1])
    finally:
        model.train(was_training)
    return tokens
