"""Save (and log to every logger that takes images) a captioned grid of images generated during validation.

A text-to-image model's loss says little about what it draws; a grid of samples with their captions, at every
validation, shows when colours, shapes and positions start to follow the text.

Protocol: the LightningModule has

- ``sample_images(batch) -> FloatTensor[B, 3, H, W]`` in [0, 1]: images generated for the captions of a
  validation batch (seeded by the module, so grids of successive validations are comparable);
- ``sample_captions(batch) -> list[str]``: those captions as text, written under each image.

The callback generates for the first ``num_images`` validation samples (on every rank: a sharded model needs
all ranks in its forward), and rank zero writes ``samples_step{N}.png`` into the log directory and logs the grid
(see :mod:`dalle_lightning_callbacks.log_image`): TensorBoard gets an image event, Weights & Biases an image with a
caption, and a CSV-only run has the PNG beside its metrics.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torchvision.transforms.functional import pil_to_tensor
from typing_extensions import override

from dalle_lightning_callbacks.batches import take
from dalle_lightning_callbacks.captioned_grid import render_captioned_grid
from dalle_lightning_callbacks.image_files import save_image
from dalle_lightning_callbacks.log_image import log_image
from dalle_lightning_callbacks.sharding import full_parameters


class SampleGrid(pl.Callback):
    """``num_images`` samples, ``columns`` to a row, each above its caption; every ``every_n_epochs`` epochs."""

    def __init__(self, every_n_epochs: int = 1, num_images: int = 16, columns: int = 4, scale: int = 3,
                 dirpath: str | None = None, tag: str = "val/samples") -> None:
        for name, value in dict(every_n_epochs=every_n_epochs, num_images=num_images, columns=columns,
                                scale=scale).items():
            if value < 1:
                raise ValueError(f"{name}={value} is not positive; expected an integer >= 1")
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.columns = columns
        self.scale = scale
        self.dirpath = dirpath
        self.tag = tag
        self._images: list[torch.Tensor] = []
        self._captions: list[str] = []
        self.last_path: str | None = None

    def _active(self, trainer: pl.Trainer) -> bool:
        return not trainer.sanity_checking and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for method in ("sample_images", "sample_captions"):
            if not callable(getattr(pl_module, method, None)):
                raise TypeError(f"{type(pl_module).__name__} has no {method}(batch); SampleGrid needs it")

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._images, self._captions = [], []

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        remaining = self.num_images - len(self._captions)
        if dataloader_idx != 0 or remaining <= 0 or not self._active(trainer):
            return
        batch = take(batch, remaining)
        with torch.no_grad(), full_parameters(trainer):  # every rank samples: a sharded model gathers on all
            images = pl_module.sample_images(batch).detach().float().cpu().clamp(0, 1)
        captions = list(pl_module.sample_captions(batch))
        if images.shape[0] != len(captions):
            raise ValueError(f"sample_images() returned {images.shape[0]} images for {len(captions)} captions; "
                             "expected one per caption")
        self._images.append(images)
        self._captions.extend(captions)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._captions:
            return
        images, captions = torch.cat(self._images), self._captions
        self._images, self._captions = [], []
        dirpath = self.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir is collective: all ranks
        if not trainer.is_global_zero:
            return
        canvas = render_captioned_grid(images, captions, columns=self.columns, scale=self.scale)
        self.last_path = os.path.join(dirpath, f"samples_step{trainer.global_step}.png")
        save_image(canvas, self.last_path)
        log_image(trainer, self.tag, pil_to_tensor(canvas).float() / 255, caption=" | ".join(captions))
