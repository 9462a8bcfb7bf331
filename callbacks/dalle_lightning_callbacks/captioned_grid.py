"""Images in a grid with each one's caption written underneath, as a PIL image: what a person reads to judge
text-to-image samples (``SampleGrid`` during training, ``dalle-generate``'s ``grid.png``)."""

from __future__ import annotations

import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_pil(image: torch.Tensor, scale: int = 1) -> Image.Image:
    """FloatTensor[3,H,W] in [0,1] -> RGB image, upscaled by ``scale`` with nearest neighbours (keeps pixels sharp)."""
    arr = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    img = Image.fromarray(arr)
    return img.resize((img.width * scale, img.height * scale), Image.NEAREST) if scale != 1 else img


def wrap_to_width(text: str, font: ImageFont.ImageFont, width: int, wrap: int) -> list[str]:
    """``text`` in lines of at most ``wrap`` characters that each fit in ``width`` pixels (words are split only when
    a single word is wider), so a caption never runs into the next image's."""
    for chars in range(wrap, 0, -1):
        lines = textwrap.wrap(text, chars) or [""]
        if all(font.getlength(line) <= width for line in lines):
            return lines
    return lines


def render_captioned_grid(images: torch.Tensor, captions: list[str], columns: int = 4, scale: int = 3,
                          wrap: int = 24) -> Image.Image:
    """``images`` ([N,3,H,W] in [0,1]) ``columns`` to a row, each upscaled by ``scale`` above its caption wrapped at
    ``wrap`` characters or the image's width, on white with 6-pixel margins."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions; expected one caption per image")
    if len(images) == 0:
        raise ValueError("no images for the grid; expected at least one")
    font = ImageFont.load_default()
    tiles = [to_pil(img, scale) for img in images]
    w, h = tiles[0].size
    lines = [wrap_to_width(c, font, w, wrap) for c in captions]
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
    return canvas
