"""Contrastive training of an open_clip model on image-text batches (the reranker of stage two).

Batches are ``{"image": FloatTensor[B, 3, H, W] in [0, 1], "text": list[str]}``, as the data module yields
them. Images are resized (if needed) and standardised with the model's own mean/std, and captions are
tokenised with the model's own open_clip tokenizer, so a checkpoint scores images the way it was trained.
The loss is open_clip's symmetric InfoNCE (``ClipLoss``); with several processes the features are gathered
with gradients and each rank computes the loss of its local rows, as open_clip does at scale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch

from dalle_lightning.lit.schedules import optimizers_from_factories
from open_clip.loss import ClipLoss
from open_clip.modified_resnet import Bottleneck
from open_clip.transformer import ResidualAttentionBlock
from torch import nn
from typing_extensions import override

from dalle_lightning.models import clip as clip_models

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class ClipModule(L.LightningModule):
    """Trains ``model`` (built by :func:`dalle_lightning.models.clip.create`) with ``ClipLoss``.

    ``optimizer`` maps parameters to an optimizer and ``scheduler`` (optional) maps the optimizer to an LR
    scheduler stepped every step; both are Hydra ``_partial_: true`` targets in the configs.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.spec = clip_models.spec_of(model)  # fails now, not at the first checkpoint, for foreign models
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.tokenizer = clip_models.tokenizer_for(model)
        mean, std = clip_models.image_mean_std(model)
        self.register_buffer("image_mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("image_std", torch.tensor(std, dtype=torch.float32), persistent=False)
        self.loss_fn = ClipLoss()

    @override
    def setup(self, stage: str) -> None:
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1:
            self.loss_fn = ClipLoss(local_loss=True, gather_with_grad=True, rank=self.global_rank, world_size=world)

    def resblocks(self) -> list[nn.Module]:
        """The residual blocks of both towers: transformer blocks and ModifiedResNet bottlenecks, in module order."""
        kinds = (ResidualAttentionBlock, Bottleneck)
        return [m for m in self.model.modules() if isinstance(m, kinds)]

    def tokenize(self, captions: list[str]) -> torch.Tensor:
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise ValueError(f"text is {type(captions).__name__}; expected a list of caption strings")
        return self.tokenizer(list(captions)).to(self.device)

    @override
    def forward(self, images: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised image and text features and the (exponentiated) logit scale."""
        clip_models.check_images(images, "batch['image']")
        if len(captions) != images.shape[0]:
            raise ValueError(f"batch has {images.shape[0]} images but {len(captions)} captions; expected one caption per image")
        pixels = clip_models.normalize_images(images, self.image_mean, self.image_std, clip_models.image_size(self.model))
        image_features = self.model.encode_image(pixels, normalize=True)
        text_features = self.model.encode_text(self.tokenize(captions), normalize=True)
        return image_features, text_features, self.model.logit_scale.exp()

    def _shared_step(self, batch: dict[str, Any], stage: str) -> torch.Tensor:
        image_features, text_features, logit_scale = self(batch["image"], batch["text"])
        loss = self.loss_fn(image_features, text_features, logit_scale)
        with torch.no_grad():
            # In-batch retrieval accuracy: does each image's most similar caption belong to it?
            sims = image_features @ text_features.T
            target = torch.arange(sims.shape[0], device=sims.device)
            acc = (sims.argmax(dim=1) == target).float().mean()
        batch_size = sims.shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=stage != "train")
        self.log(f"{stage}/acc", acc, prog_bar=True, batch_size=batch_size, sync_dist=stage != "train")
        if stage == "train":
            self.log("train/logit_scale", logit_scale.detach(), batch_size=batch_size)
        return loss

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "val")

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # As in CLIP: clamp the temperature so logits never exceed 100.
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, 4.6052)

    @override
    def configure_optimizers(self) -> Any:
        return optimizers_from_factories(self.parameters(), self.optimizer_factory, self.scheduler_factory)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The architecture travels with the weights so Reranker.from_checkpoint needs no config files.
        checkpoint["open_clip_spec"] = self.spec
