"""Save (and log to every logger that takes images) a grid of validation images over their reconstructions.

Protocol: the LightningModule has ``reconstruct(images) -> images``, both float [B, C, H, W] in [0, 1]. The
callback keeps the first ``num_images`` validation images (from the ``"image"`` key of dict batches, the
first element of tuple batches, or the batch itself when it is a tensor) and, at the end of every
``every_n_epochs``-th validation epoch, writes ``recon_epoch{N}.png``: rows of originals, each followed by
the row of their reconstructions.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from PIL import Image
from torchvision.utils import make_grid
from typing_extensions import override

from dalle_lightning_callbacks.image_files import save_image
from dalle_lightning_callbacks.log_image import log_image
from dalle_lightning_callbacks.sharding import full_parameters


def _images_of(batch: Any, key: str) -> torch.Tensor:
    if isinstance(batch, dict):
        if key not in batch:
            raise KeyError(f"validation batch has keys {sorted(batch)}; ReconstructionGrid expected image key {key!r}")
        return batch[key]
    if isinstance(batch, (list, tuple)):
        return batch[0]
    if isinstance(batch, torch.Tensor):
        return batch
    raise TypeError(f"validation batch of type {type(batch).__name__}; expected a dict, tuple or tensor of images")


class ReconstructionGrid(pl.Callback):
    """Originals over reconstructions, ``nrow`` images per row, saved as PNG and logged as an image."""

    def __init__(
        self,
        every_n_epochs: int = 1,
        num_images: int = 16,
        dirpath: str | None = None,
        nrow: int = 8,
        image_key: str = "image",
        tag: str = "val/reconstructions",
    ) -> None:
        for name, value in dict(every_n_epochs=every_n_epochs, num_images=num_images, nrow=nrow).items():
            if value < 1:
                raise ValueError(f"{name}={value} is not positive; expected an integer >= 1")
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.dirpath = dirpath
        self.nrow = nrow
        self.image_key = image_key
        self.tag = tag
        self._images: list[torch.Tensor] = []
        self.last_path: str | None = None

    def _active(self, trainer: pl.Trainer) -> bool:
        return not trainer.sanity_checking and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _held(self) -> int:
        return sum(x.shape[0] for x in self._images)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._images = []

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if dataloader_idx != 0 or not self._active(trainer) or self._held() >= self.num_images:
            return
        images = _images_of(batch, self.image_key)
        self._images.append(images[: self.num_images - self._held()].detach().cpu())

    def grid(self, originals: torch.Tensor, reconstructions: torch.Tensor) -> torch.Tensor:
        """[3, H', W'] grid: each chunk of ``nrow`` originals is followed by its reconstructions."""
        ncol = min(self.nrow, originals.shape[0])
        rows = []
        for start in range(0, originals.shape[0], ncol):
            for images in (originals[start : start + ncol], reconstructions[start : start + ncol]):
                blank = images.new_zeros((ncol - images.shape[0], *images.shape[1:]))  # pad a short last row
                rows.append(torch.cat([images, blank]))
        return make_grid(torch.cat(rows), nrow=ncol, padding=2, pad_value=0.5)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active(trainer) or not self._images:
            return
        originals = torch.cat(self._images).float().clamp(0, 1)
        self._images = []
        # Every rank reconstructs (a sharded model gathers its parameters on all ranks); only rank zero writes.
        with torch.no_grad(), full_parameters(trainer):
            recon = pl_module.reconstruct(originals.to(pl_module.device))
        recon = recon.detach().float().cpu().clamp(0, 1)
        if recon.shape != originals.shape:
            raise ValueError(
                f"reconstruct() returned shape {tuple(recon.shape)}; expected the input shape {tuple(originals.shape)}"
            )
        dirpath = self.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir is collective: all ranks
        if not trainer.is_global_zero:
            return
        grid = self.grid(originals, recon)
        self.last_path = os.path.join(dirpath, f"recon_epoch{trainer.current_epoch}.png")
        # torchvision's save_image rounding, written through the atomic writer
        pixels = grid.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to("cpu", torch.uint8).numpy()
        save_image(Image.fromarray(pixels), self.last_path)
        log_image(trainer, self.tag, grid, caption="originals (odd rows) over reconstructions (even rows)")
