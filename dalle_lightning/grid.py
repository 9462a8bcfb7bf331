"""PNG output: single images and a captioned grid (caption text under each image)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_pil(image: torch.Tensor, scale: int = 1) -> Image.Image:
    """FloatTensor[3,H,W] in [0,1] -> RGB image, upscaled by ``scale`` with nearest neighbours (keeps pixels sharp)."""
    arr = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    img = Image.fromarray(arr)
    return img.resize((img.width * scale, img.height * scale), Image.NEAREST) if scale != 1 else img


def save_image(image: torch.Tensor, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path)


def captioned_grid(images: torch.Tensor, captions: list[str], path: str | Path, columns: int = 4, scale: int = 3,
                   wrap: int = 24) -> Path:
    """Write a grid of ``images`` ([N,3,H,W]) with each caption wrapped underneath."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions; expected one caption per image")
    font = ImageFont.load_default()
    tiles = [to_pil(img, scale) for img in images]
    w, h = tiles[0].size
    lines = [textwrap.wrap(c, wrap) or [""] for c in captions]
    line_h = 12
    text_h = line_h * max(len(ls) for ls in lines) + 6
    cols = min(columns, len(tiles))
    rows = (len(tiles) + cols - 1) // cols
    pad = 6
    canvas = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + text_h + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (tile, ls) in enumerate(zip(tiles, lines)):
        x = pad + (i % cols) * (w + pad)
        y = pad + (i // cols) * (h + text_h + pad)
        canvas.paste(tile, (x, y))
        for j, line in enumerate(ls):
            draw.text((x, y + h + 3 + j * line_h), line, fill=(0, 0, 0), font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path
