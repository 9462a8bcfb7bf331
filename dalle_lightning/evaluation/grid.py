"""PNG output: single images and a captioned grid (caption text under each image)."""

from __future__ import annotations

from pathlib import Path

import torch

from dalle_lightning_callbacks.captioned_grid import render_captioned_grid, to_pil
from dalle_lightning_callbacks.image_files import save_image as write_image


def save_image(image: torch.Tensor, path: str | Path) -> None:
    write_image(to_pil(image), path)


def captioned_grid(images: torch.Tensor, captions: list[str], path: str | Path, columns: int = 4, scale: int = 3,
                   wrap: int = 24) -> Path:
    """Write a grid of ``images`` ([N,3,H,W]) with each caption wrapped underneath."""
    canvas = render_captioned_grid(images, captions, columns, scale, wrap)
    return write_image(canvas, path)
