"""A dVAE with finite scalar quantization (FSQ, Mentzer et al. 2023, arXiv 2309.15505) in place of the Gumbel
relaxation (``model=dvae_fsq``; not the demo's: at 3,500 updates it matched fewer captions, docs/experiments.md).

Why: the paper's relaxed dVAE ends a short run with a soft posterior (about 4.4 nats per token on the shapes world),
so its decoder learns from codes drawn among ~80 near-equivalent ones, the argmax code of a small shape says little
more than its colour, and most of the codebook is never the argmax (37 of 512 codes in use). FSQ has no posterior
to sharpen and no codebook to collapse: the encoder emits ``len(levels)`` numbers per cell, each bounded by tanh and
rounded to one of ``levels[i]`` fixed values (straight-through gradients), and the code is the mixed-radix number of
those digits, so the vocabulary is ``prod(levels)`` (8 x 8 x 8 = 512) and the decoder trains on exactly the hard
codes the prior will later produce. The quantizer is ``vector_quantize_pytorch.FSQ``; it has no parameters.

Same encoder and decoder as :class:`DiscreteVAE` (OpenAI's module names), with the encoder's last 1x1 conv giving
``len(levels)`` channels and the decoder's first 1x1 conv reading them; the same logit-Laplace likelihood; no KL
term (the code is deterministic given the image). The interface the later stages read is unchanged:
``get_codebook_indices``, ``decode_indices`` / ``decode_stats`` from indices, ``reconstruct``, ``vocab_size``,
``grid_size``. ``latent_penalty`` keeps the pre-bound latents in tanh's working range (without it two of three
channels saturated and stayed there on the shapes world).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from vector_quantize_pytorch import FSQ

from dalle_lightning.models.dvae import LOGIT_LAPLACE_EPS, DiscreteVAE
from dalle_lightning.models.regions import CompileMode


class FSQVAE(DiscreteVAE):
    """Encoder -> FSQ (``levels`` per latent channel) -> decoder. Images are float [B, C, S, S] in [0, 1]."""

    relaxed = False  # no Gumbel temperature and no KL weight: their schedules have nothing to set

    def __init__(
        self,
        image_size: int = 64,
        levels: Sequence[int] = (8, 8, 8),
        n_hid: int = 256,
        n_blk_per_group: int = 2,
        group_count: int = 4,
        codebook_dim: int = 128,
        channels: int = 3,
        eps: float = LOGIT_LAPLACE_EPS,
        latent_penalty: float = 0.0,
        block_min_hidden: int = 0,
        compile: CompileMode = False,  # noqa: A002 - the config key users set
    ) -> None:
        if latent_penalty < 0:
            raise ValueError(f"latent_penalty={latent_penalty} is negative; expected a weight >= 0")
        levels = [int(level) for level in levels]
        if not levels or any(level < 3 for level in levels):
            raise ValueError(f"levels={levels}; expected one or more quantization levels per channel, each >= 3")
        # The parent's encoder head and decoder input width is its "vocab_size": here, the latent channels.
        super().__init__(image_size, len(levels), n_hid, n_blk_per_group, group_count, codebook_dim, channels, eps,
                         block_min_hidden=block_min_hidden, compile=compile)
        self.levels = levels
        self.vocab_size = math.prod(levels)
        self.latent_penalty = float(latent_penalty)
        # The library reads its level table back (.item()) while building, so it is built on the CPU even when the
        # network is built on the meta device; its buffers are a few hundred numbers, not parameters.
        with torch.device("cpu"):
            self.quantizer = FSQ(levels)

    def quantize(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [B, d, h, w] -> (codes in [-1, 1] with straight-through gradients [B, d, h, w], indices [B, h, w]).

        In fp32 outside autocast (the library's own guard disables CUDA autocast only)."""
        with torch.autocast(device_type=latents.device.type, enabled=False):
            codes, indices = self.quantizer(latents.float())
        return codes, indices.long()

    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """The prior's image tokens: the FSQ index of each cell's rounded latent, LongTensor[B, h, w]."""
        with torch.no_grad():
            return self.quantize(self.encode(images))[1]

    def decode_hard(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices -> their codes (the implicit codebook) -> decoder."""
        codes = self.quantizer.indices_to_codes(idx).to(memory_format=torch.channels_last)
        return self.decoder(codes)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Negative log-likelihood per pixel value of the image under the decoder of its hard codes (no KL term,
        no temperature: the code is a deterministic function of the image), plus ``latent_penalty`` times the mean
        squared latent before the bound. Returns loss, recon_loss, latent_l2, ``indices`` [B, h, w] and the
        reconstruction ``recon``.
        """
        latents = self.encode(images)
        codes, indices = self.quantize(latents)
        stats = self.decoder(codes).float()
        recon_loss = self.logit_laplace_nll(stats, images)
        # Mean squared latent before the tanh bound: without it a channel can drift far out on tanh's flat tail
        # (Adam's steps keep their size as the gradient vanishes) and stay there, one level forever.
        latent_l2 = latents.pow(2).mean()
        return dict(loss=recon_loss + self.latent_penalty * latent_l2, recon_loss=recon_loss, latent_l2=latent_l2.detach(),
                    indices=indices, recon=self.stats_to_images(stats).detach())
