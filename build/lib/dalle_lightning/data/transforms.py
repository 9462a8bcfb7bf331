"""Image decoding and the paper's augmentation, scaled to the configured image size."""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from PIL import Image


def decode_image(data: bytes) -> Image.Image:
    """Decode PNG/JPEG/WebP bytes to RGB; raises on corrupt data (the caller skips and counts it)."""
    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return img.convert("RGB")


def center_square_resize(img: Image.Image, size: int) -> Image.Image:
    """Deterministic evaluation transform: centre square crop, then resize to ``size``."""
    w, h = img.size
    s = min(w, h)
    left, top = (w - s) // 2, (h - s) // 2
    img = img.crop((left, top, left + s, top + s))
    return img if s == size else img.resize((size, size), Image.BICUBIC)


def paper_augment(img: Image.Image, size: int, rng: random.Random, flip: bool = True) -> Image.Image:
    """DALL-E's dVAE augmentation: random square crop, resize to t*size with t in [9/8, 12/8],
    random crop to ``size``, random horizontal flip.

    Flips and crops change what a caption says about an image (left/right, objects cut at the border), so
    data sets whose captions describe positions (the shapes world) turn this off.
    """
    w, h = img.size
    s = min(w, h)
    left, top = rng.randint(0, w - s), rng.randint(0, h - s)
    img = img.crop((left, top, left + s, top + s))
    t = rng.uniform(9 / 8, 12 / 8)
    big = max(size, round(t * size))
    img = img.resize((big, big), Image.BICUBIC)
    x, y = rng.randint(0, big - size), rng.randint(0, big - size)
    img = img.crop((x, y, x + size, y + size))
    if flip and rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


def to_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 HxWx3 -> FloatTensor[3,H,W] in [0,1]."""
    arr = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)
