"""PNG output: single images and a captioned grid (caption text under each image)."""

from __future__ import annotations

from pathlib import Path

import torch

from callbacks.captioned_grid import render_captioned_grid, to_pil


def save_image(image: torch.Tensor, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path)


def captioned_grid(images: torch.Tensor, captions: list[str], path: str | Path, columns: int = 4, scale: int = 3,
                   wrap: int = 24) -> Path:
    """Write a grid of ``images`` ([N,3,H,W]) with each caption wrapped underneath."""
    canvas = render_captioned_grid(images, captions, columns, scale, wrap)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path
