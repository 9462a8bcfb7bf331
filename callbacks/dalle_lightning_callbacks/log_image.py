"""Send one image to every logger of a Trainer that takes images.

Loggers differ in how they take an image: Weights & Biases (and any logger written to the same interface) has
``log_image(key, images, step, caption=...)``; TensorBoard's writer has ``experiment.add_image(tag, image, step)``.
A logger with neither (CSV) gets nothing here: the callbacks also save each image as a PNG in the run directory.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch


def log_image(trainer: pl.Trainer, tag: str, image: torch.Tensor, caption: str | None = None) -> list[str]:
    """Log ``image`` (float ``[3, H, W]`` in [0, 1]) under ``tag`` at the current step; returns the names of the
    loggers that took it. Call on rank zero only (loggers write from there)."""
    taken = []
    for logger in trainer.loggers:
        if callable(getattr(logger, "log_image", None)):
            extra = {"caption": [caption]} if caption is not None else {}
            logger.log_image(key=tag, images=[image], step=trainer.global_step, **extra)
        elif callable(getattr(getattr(logger, "experiment", None), "add_image", None)):
            logger.experiment.add_image(tag, image, global_step=trainer.global_step)
        else:
            continue
        taken.append(type(logger).__name__)
    return taken
