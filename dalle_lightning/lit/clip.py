"""Contrastive training of an open_clip model on image-text batches (the reranker of stage two).

Batches are ``{"image": FloatTensor[B, 3, H, W] in [0, 1], "text": list[str]}``, as the data module yields
them. Images are resized (if needed) and standardised with the model's own mean/std, and captions are
tokenised with the model's own open_clip tokenizer, so a checkpoint scores images the way it was trained.
The loss is open_clip's symmetric InfoNCE (``ClipLoss``); with several processes the features are gathered
with gradients and each rank computes the loss of its local rows, as open_clip does at scale.

The reranker scores *generated* images, which are dVAE decodings, never clean renders. A CLIP trained on clean
renders alone does not transfer: on the shapes world it found the right caption for renders far more often than
for their dVAE reconstructions, and its best-of-16 pick was worse than a random candidate (docs/results.md,
"The reranker must see generated images"). Given a dVAE
(``dvae=``), a share ``recon_share`` of every batch is therefore replaced by its reconstruction (argmax codes,
decoded): the images the prior's tokens can show.

Given ``negatives`` (a callable from a caption to a caption its image cannot match, such as the shapes world's
:class:`~dalle_lightning.world.negatives.NegativeCaptions`), each image also meets its own hard negative: the
loss adds ``negative_weight`` times the cross-entropy of each image over the batch's captions plus its own
negative (as NegCLIP, but without the other images' negatives, which may describe this image). In-batch
captions differ from the true one in many details, the candidates a reranker chooses among in one or two;
``val/neg_acc`` is the share of images scored above their negative.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from dalle_lightning.artifacts import load_frozen
from dalle_lightning.lit.clipping import FusedOptimizerClipping
from dalle_lightning.lit.schedules import optimizers_from_factories
from open_clip.loss import ClipLoss
from open_clip.modified_resnet import Bottleneck
from open_clip.transformer import ResidualAttentionBlock
from torch import nn
from typing_extensions import override

from dalle_lightning.models import clip as clip_models

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class ClipModule(FusedOptimizerClipping):
    """Trains ``model`` (built by :func:`dalle_lightning.models.clip.create`) with ``ClipLoss``.

    ``optimizer`` maps parameters to an optimizer and ``scheduler`` (optional) maps the optimizer to an LR
    scheduler stepped every step; both are Hydra ``_partial_: true`` targets in the configs.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        dvae: nn.Module | str | Path | None = None,
        recon_share: float = 0.5,
        negatives: Callable[[str], str] | None = None,
        negative_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= recon_share <= 1.0:
            raise ValueError(f"recon_share={recon_share}; expected a share of the batch in [0, 1]")
        if negative_weight < 0:
            raise ValueError(f"negative_weight={negative_weight}; expected a weight >= 0")
        self.model = model
        self.recon_share = recon_share
        self.negatives, self.negative_weight = negatives, negative_weight
        # A plain list keeps the frozen dVAE out of the state dict and the optimizer: only CLIP is trained and saved.
        self._dvae: list[nn.Module] = []
        if dvae is not None:
            # NHWC convolutions run faster on CPU; reconstructing half a batch then costs less than CLIP's own step.
            self._dvae.append(load_frozen(dvae).to(memory_format=torch.channels_last))
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
    def forward(self, images: torch.Tensor, captions: list[str],
                check_range: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised image and text features and the (exponentiated) logit scale. ``check_range=False`` skips
        the [0, 1] check's host read (the shape and dtype are always checked)."""
        clip_models.check_images(images, "batch['image']", check_range)
        if len(captions) != images.shape[0]:
            raise ValueError(f"batch has {images.shape[0]} images but {len(captions)} captions; expected one caption per image")
        pixels = clip_models.normalize_images(images, self.image_mean, self.image_std, clip_models.image_size(self.model))
        image_features = self.model.encode_image(pixels, normalize=True)
        text_features = self.model.encode_text(self.tokenize(captions), normalize=True)
        return image_features, text_features, self.model.logit_scale.exp()

    @torch.no_grad()
    def with_reconstructions(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` with the first ``round(recon_share * B)`` rows replaced by their dVAE reconstructions
        (unchanged without a dVAE). Batches are shuffled, so the first rows are as random as any."""
        k = round(self.recon_share * images.shape[0])
        if not self._dvae or k == 0:
            return images
        dvae = self._dvae[0].to(self.device)
        recon = dvae.reconstruct(images[:k].contiguous(memory_format=torch.channels_last)).float().clamp(0, 1)
        recon = recon.contiguous()  # back to NCHW, like the clean rows it joins
        return torch.cat([recon, images[k:]])

    def hard_negative_loss(
        self, image_features: torch.Tensor, text_features: torch.Tensor, captions: list[str], logit_scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy of each (local) image over the local captions plus its own negative caption, and the share
        of images scored above that negative. Local rows only, so it needs no gather across processes."""
        assert self.negatives is not None
        negative_features = self.model.encode_text(self.tokenize([self.negatives(c) for c in captions]), normalize=True)
        # Only its own negative joins each image's row: another caption's negative may well describe this image.
        own_negative = (image_features * negative_features).sum(1, keepdim=True)
        logits = logit_scale * torch.cat([image_features @ text_features.T, own_negative], dim=1)
        target = torch.arange(logits.shape[0], device=logits.device)
        loss = torch.nn.functional.cross_entropy(logits, target)
        with torch.no_grad():
            above = (logits.diagonal() > logits[:, -1]).float().mean()  # own caption vs own negative
        return loss, above

    def _shared_step(self, batch: dict[str, Any], stage: str, batch_idx: int) -> torch.Tensor:
        # The range check reads the images back to the host: in training once per epoch (a loader that yields
        # uint8 or [-1, 1] does so from its first batch), in validation at every batch.
        images, check = self.with_reconstructions(batch["image"]), stage != "train" or batch_idx == 0
        image_features, text_features, logit_scale = self(images, batch["text"], check_range=check)
        loss = self.loss_fn(image_features, text_features, logit_scale)
        if self.negatives is not None:
            neg_loss, neg_acc = self.hard_negative_loss(image_features, text_features, batch["text"], logit_scale)
            loss = loss + self.negative_weight * neg_loss
            self.log(f"{stage}/neg_acc", neg_acc, prog_bar=stage != "train", batch_size=len(batch["text"]), sync_dist=stage != "train")
        with torch.no_grad():
            # In-batch retrieval accuracy: does each image's most similar caption belong to it?
            sims = image_features @ text_features.T
            target = torch.arange(sims.shape[0], device=sims.device)
            acc = (sims.argmax(dim=1) == target).float().mean()
        batch_size = sims.shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=stage != "train", batch_size=batch_size, sync_dist=stage != "train")
        self.log(f"{stage}/acc", acc, prog_bar=stage != "train", batch_size=batch_size, sync_dist=stage != "train")
        if stage == "train":
            self.log("train/logit_scale", logit_scale.detach(), batch_size=batch_size)
        return loss

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train", batch_idx)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "val", batch_idx)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # As in CLIP: clamp the temperature so logits never exceed 100. Right after the update (not at the end of
        # the batch), so a checkpoint taken after this update holds the clamped value.
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, 4.6052)

    def random_generators(self) -> dict[str, Any]:
        """Generators of this module's own (protocol of ``dalle_lightning_callbacks.random_state``): the hard negatives' draws,
        which a resumed run must continue."""
        rng = getattr(self.negatives, "rng", None)
        return {"negatives": rng} if rng is not None else {}

    @override
    def configure_optimizers(self) -> Any:
        return optimizers_from_factories(self.parameters(), self.optimizer_factory, self.scheduler_factory)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The architecture travels with the weights so Reranker.from_checkpoint needs no config files.
        checkpoint["open_clip_spec"] = self.spec
