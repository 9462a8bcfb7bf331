"""LightningModule for stage 1: trains a :class:`DiscreteVAE` on image batches ``{"image": [B, 3, H, W]}``.

The Gumbel temperature and KL weight are plain float attributes so that schedule callbacks
(``dalle_lightning_callbacks.schedules``) can set them before every batch; the module just reads them. A model without the
relaxation (``relaxed = False``: :class:`~dalle_lightning.models.dvae_fsq.FSQVAE`) has neither, so both attributes
are None and the schedules leave them alone.

The losses (``train/`` and ``val/``) are per pixel value, in nats: ``loss`` is the objective, ``recon_loss`` plus
the regulariser (``kl``, weighted by the KL weight); ``recon_loss`` is the negative log-density of the
logit-Laplace likelihood, a density over a continuous value, so it and ``loss`` go below zero as the dVAE learns.
Reconstruction quality in plain terms: ``val/mse`` and ``val/psnr`` (of the argmax codes' decoding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dalle_lightning.lit.clipping import FusedOptimizerClipping
from dalle_lightning.lit.schedules import optimizers_from_factories
from torch import nn
from torchmetrics import MeanSquaredError, Metric
from torchmetrics.image import PeakSignalNoiseRatio
from typing_extensions import override

from dalle_lightning.models.dvae import DiscreteVAE

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class CodebookPerplexity(Metric):
    """exp(entropy) of the code-usage histogram: the effective number of codes in use (K when uniform, 1
    when collapsed). Counts are summed over steps and ranks before the entropy, so it is exact under DDP."""

    full_state_update = False

    def __init__(self, num_codes: int) -> None:
        super().__init__()
        self.num_codes = num_codes
        self.add_state("counts", default=torch.zeros(num_codes, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, indices: torch.Tensor) -> None:
        self.counts += torch.bincount(indices.flatten(), minlength=self.num_codes).to(self.counts)

    @override
    def compute(self) -> torch.Tensor:
        p = self.counts / self.counts.sum().clamp_min(1)
        entropy = -(p * torch.log(p.clamp_min(1e-300))).sum()
        return torch.exp(entropy).float()


class DVAEModule(FusedOptimizerClipping):
    """Trains the dVAE with the relaxed ELB; validates reconstructions from argmax codes (what the prior sees)."""

    def __init__(
        self,
        model: DiscreteVAE,  # or its FSQ subclass
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        temperature: float = 1.0,
        kl_weight: float = 0.0,
        channels_last: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        # NHWC convolutions are markedly faster than NCHW on CPU at the shapes-world size, in fp32 and more so in
        # bf16 (docs/results.md); weights and inputs agree.
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = model.to(memory_format=self.memory_format)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        relaxed = getattr(model, "relaxed", True)
        self.temperature: float | None = float(temperature) if relaxed else None
        self.kl_weight: float | None = float(kl_weight) if relaxed else None
        # 1: decode argmax codes with a straight-through gradient
        #    (set by dalle_lightning_callbacks.schedules.HardCodesHandover)
        self.hard_codes: float | None = 0.0 if relaxed else None
        self.val_mse = MeanSquaredError()
        self.val_psnr = PeakSignalNoiseRatio(data_range=1.0)
        self.val_perplexity = CodebookPerplexity(model.vocab_size)

    @override
    def setup(self, stage: str) -> None:
        # A codebook updated from the batch (the EMA vector quantiser) must be one codebook across processes; the
        # process group exists only now, after the model was built (dalle_lightning.models.dvae_vq).
        share = getattr(self.model, "share_codebook", None)
        if callable(share):
            share()

    def resblocks(self) -> list[tuple[str, nn.Module]]:
        return self.model.resblocks()

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        """Protocol of ``dalle_lightning_callbacks.image_grid.ReconstructionGrid``: images in [0, 1] -> reconstructions in [0, 1]."""
        return self.model.reconstruct(images)

    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.get_codebook_indices(images)

    @override
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        images = images.contiguous(memory_format=self.memory_format)
        if self.temperature is None:  # no relaxation, no KL (FSQ)
            return self.model(images)
        return self.model(images, temperature=self.temperature, kl_weight=self.kl_weight,
                          hard=bool(self.hard_codes) and self.training)

    @staticmethod
    def _images(batch: dict[str, Any]) -> torch.Tensor:
        if not isinstance(batch, dict) or "image" not in batch:
            raise ValueError(f"batch of type {type(batch).__name__}; expected a dict with an 'image' tensor")
        return batch["image"]

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        images = self._images(batch)
        out = self(images)
        n = images.shape[0]
        self.log("train/loss", out["loss"], batch_size=n)  # on the bar: dalle_lightning_callbacks.progress_bar
        self.log("train/recon_loss", out["recon_loss"], batch_size=n)
        if "kl" in out:
            self.log("train/kl", out["kl"], batch_size=n)
        return out["loss"]

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        images = self._images(batch)
        out = self(images)
        codes = out["indices"]
        recon = self.model.decode_indices(codes).contiguous()  # torchmetrics flattens with view()
        target = images.float().contiguous()
        self.val_mse.update(recon, target)
        self.val_psnr.update(recon, target)
        self.val_perplexity.update(codes)
        n = images.shape[0]
        # val/loss is the training objective on validation images (as every stage's val/loss), per pixel value in
        # nats: recon_loss plus the model's regulariser (the Gumbel dVAE: kl_weight * kl, the relaxed negative ELB
        # at the current temperature and KL weight; VQ: the commitment; FSQ: the latent penalty). recon_loss is a
        # negative log *density* (logit-Laplace over pixels squeezed into (eps, 1 - eps), a continuous variable),
        # and a density exceeds 1 where the decoder is sure: a well-trained dVAE's loss is negative.
        self.log("val/loss", out["loss"], prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/recon_loss", out["recon_loss"], batch_size=n, sync_dist=True)
        if "kl" in out:
            self.log("val/kl", out["kl"], batch_size=n, sync_dist=True)
        self.log("val/mse", self.val_mse, batch_size=n)
        self.log("val/psnr", self.val_psnr, batch_size=n)
        self.log("val/perplexity", self.val_perplexity, batch_size=n)

    @override
    def configure_optimizers(self) -> Any:
        return optimizers_from_factories(self.parameters(), self.optimizer_factory, self.scheduler_factory)
