"""A dVAE with an EMA vector quantiser (VQ-VAE-2, SoundStream, Jukebox) in place of the Gumbel relaxation.

``vector_quantize_pytorch.VectorQuantize``: the codebook is updated by exponential moving averages of the encoder
outputs assigned to each code (no gradient), initialised by k-means on the first batch, and a code whose running
count falls below ``threshold_ema_dead_code`` is re-seeded from the current batch's encoder outputs, so codes do not
stay dead. The count is per batch, so the threshold must sit far below the mean count per code (latents per batch /
``vocab_size``; 1 at the demo's batch of 8 images x 64 cells and 512 codes): at or above it nearly every code is
re-seeded every step (at 2.0, 370-440 of 512 codes per step), the codebook is a sample of recent batches, and
colours were lost in some runs (docs/results.md). The first training batch checks it. The encoder gets the
decoder's gradient through the rotation trick and a commitment loss.
Same encoder, decoder, likelihood and interface as :class:`~dalle_lightning.models.dvae_fsq.FSQVAE`.

Several processes: the library sums the codebook statistics (counts, sums, k-means, re-seeding draws) over
processes only if it is built with a process group in place, and ``dalle-train`` builds the model before the Trainer
starts one. So :meth:`VQVAE.share_codebook`, which the LightningModule calls in ``setup`` (after the group exists,
before any update), rebuilds the quantizer to sum them: every rank then holds the codebook one process would have
built from the whole global batch, and the dead-code threshold is checked against the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from vector_quantize_pytorch import VectorQuantize

from dalle_lightning.models.dvae import LOGIT_LAPLACE_EPS, DiscreteVAE
from dalle_lightning.models.regions import CompileMode


class VQVAE(DiscreteVAE):
    """Encoder -> nearest of ``vocab_size`` EMA codes of width ``latent_dim`` -> decoder."""

    relaxed = False  # no Gumbel temperature and no KL weight

    def __init__(
        self,
        image_size: int = 64,
        vocab_size: int = 512,
        latent_dim: int = 32,
        n_hid: int = 256,
        n_blk_per_group: int = 2,
        group_count: int = 4,
        codebook_dim: int = 128,
        channels: int = 3,
        eps: float = LOGIT_LAPLACE_EPS,
        decay: float = 0.8,
        commitment_weight: float = 1.0,
        threshold_ema_dead_code: float = 0.01,
        kmeans_init: bool = True,
        use_cosine_sim: bool = False,
        block_min_hidden: int = 0,
        compile: CompileMode = False,  # noqa: A002 - the config key users set
    ) -> None:
        if latent_dim < 1:
            raise ValueError(f"latent_dim={latent_dim}; expected a positive code width")
        super().__init__(image_size, latent_dim, n_hid, n_blk_per_group, group_count, codebook_dim, channels, eps,
                         block_min_hidden=block_min_hidden, compile=compile)
        self.vocab_size = int(vocab_size)
        self.threshold_ema_dead_code = float(threshold_ema_dead_code)
        self._threshold_checked = False
        self._processes = 1  # processes whose batches update the codebook (share_codebook)
        self._quantizer_args = dict(
            dim=latent_dim, codebook_size=vocab_size, decay=decay, commitment_weight=commitment_weight,
            threshold_ema_dead_code=threshold_ema_dead_code, kmeans_init=kmeans_init, use_cosine_sim=use_cosine_sim,
        )
        with torch.device("cpu"):  # k-means state and tables are built eagerly; never on the meta device
            self.quantizer = VectorQuantize(**self._quantizer_args, sync_codebook=False)

    def share_codebook(self) -> None:
        """Make every process update one codebook from the global batch (see the module docstring): a no-op in one
        process. Call it once the default process group exists and before the first update; the codebook's state
        so far (e.g. loaded weights) is kept."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        state = self.quantizer.state_dict()
        with torch.device("cpu"):
            self.quantizer = VectorQuantize(**self._quantizer_args, sync_codebook=True)
        self.quantizer.load_state_dict(state)
        self._processes = dist.get_world_size()

    def _check_threshold(self, latents_per_batch: int) -> None:
        """Refuse a dead-code threshold at or above the mean count per code, before the first update uses it."""
        mean = latents_per_batch / self.vocab_size
        if self.threshold_ema_dead_code >= mean:
            raise ValueError(
                f"threshold_ema_dead_code={self.threshold_ema_dead_code:g} is at or above the mean count per code per "
                f"batch ({latents_per_batch} latents / {self.vocab_size} codes = {mean:g}): nearly every code would be "
                f"re-seeded every step; expected far below it (e.g. {mean / 100:g}), or 0 for no restarts")
        self._threshold_checked = True

    def quantize(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latents [B, d, h, w] -> (codes [B, d, h, w], indices [B, h, w], commitment loss), in fp32."""
        b, d, h, w = latents.shape
        if self.training and not self._threshold_checked:
            self._check_threshold(b * h * w * self._processes)  # the statistics are summed over processes
        with torch.autocast(device_type=latents.device.type, enabled=False):
            flat = latents.float().permute(0, 2, 3, 1).reshape(b, h * w, d)
            finite = torch.isfinite(flat).all(dim=-1) if self.training else None
            if finite is None or bool(finite.all()):
                codes, indices, commit = self.quantizer(flat)
            else:
                codes, indices, commit = self._quantize_finite_rows(flat, finite)
        return codes.reshape(b, h, w, d).permute(0, 3, 1, 2), indices.reshape(b, h, w).long(), commit.sum()

    def _quantize_finite_rows(self, flat: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A training batch with NaN or Inf latents: the codebook learns from its finite rows only. Its statistics
        are updated in the forward pass, so the non-finite guard's skipped update would not keep a NaN out of them,
        and one bad batch would poison every later step. The loss stays non-finite, so the guard still skips the
        update, and every process still takes part in the codebook's collectives: with no finite row at all, one
        row holds a code's own vector, which leaves the codes in place."""
        safe = flat.masked_fill(~finite.unsqueeze(-1), 0.0)
        if not bool(finite.any()):
            safe[0, 0] = self.quantizer.codebook[0].detach().to(safe.dtype)
            finite = finite.clone()
            finite[0, 0] = True
        codes, indices, commit = self.quantizer(safe, mask=finite)
        return codes, indices, commit + flat.sum() * 0  # NaN * 0 is NaN: the step's loss says what happened

    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.quantize(self.encode(images))[1]

    def decode_hard(self, idx: torch.Tensor) -> torch.Tensor:
        codes = self.quantizer.get_codes_from_indices(idx)  # [B, h, w, d]
        return self.decoder(codes.permute(0, 3, 1, 2).float())

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, indices, commit = self.quantize(self.encode(images))
        stats = self.decoder(codes).float()
        recon_loss = self.logit_laplace_nll(stats, images)
        return dict(loss=recon_loss + commit, recon_loss=recon_loss, commit=commit.detach(), indices=indices,
                    recon=self.stats_to_images(stats).detach())
