"""LightningModule for the stage-two prior: caption dropout for super-conditioning, optimiser and schedule wiring.

Batches are ``{"text": LongTensor[B, T] (0 = padding), "image": LongTensor[B, N]}`` (dVAE codes, raster order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from dalle_lightning.models.prior import DallePrior


def drop_captions(text: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Replace each caption by all-padding with probability ``p``: the prior also learns the unconditional
    distribution, which super-conditioning subtracts at sampling time (``cond_scale``)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"caption_dropout={p}; expected a probability in [0, 1]")
    if p == 0.0:
        return text
    device = generator.device if generator is not None else text.device
    drop = (torch.rand(text.shape[0], generator=generator, device=device) < p).to(text.device)
    return text.masked_fill(drop.unsqueeze(1), 0)


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay for matrices only: decaying gains, biases and the start vector pulls them toward 0 for no
    regularisation benefit (embeddings are matrices and are decayed, as in the paper's AdamW)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class PriorModule(pl.LightningModule):
    """Trains a :class:`DallePrior` on token batches; logs ``{train,val}/{loss,text_loss,image_loss}``."""

    def __init__(
        self,
        model: DallePrior,
        optimizer: Callable[[Iterable], torch.optim.Optimizer],
        scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
        caption_dropout: float = 0.1,
    ):
        super().__init__()
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout={caption_dropout}; expected a probability in [0, 1]")
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.caption_dropout = caption_dropout
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])

    def resblocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"model.{name}", module) for name, module in self.model.resblocks()]

    @override
    def forward(self, text: torch.Tensor, image: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.model(text, image)

    def _step(self, batch: dict[str, torch.Tensor], stage: str, caption_dropout: float) -> torch.Tensor:
        out = self.model(drop_captions(batch["text"], caption_dropout), batch["image"])
        batch_size = batch["text"].shape[0]
        for name, value in out.items():
            self.log(
                f"{stage}/{name}", value, prog_bar=name == "loss", batch_size=batch_size, sync_dist=stage != "train"
            )
        return out["loss"]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", self.caption_dropout)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val", 0.0)

    @override
    def configure_optimizers(self):
        optimizer = self.optimizer_factory(param_groups(self.model))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
