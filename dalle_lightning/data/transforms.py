"""Image decoding as a person sees the image, and the paper's augmentation, scaled to the configured image size."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import IO

import numpy as np
import torch
from PIL import Image, ImageOps

WHITE = (255, 255, 255)
# What decode_image may have to do to an image to show it as a viewer would; each stage counts them (a share of
# images that needed one is worth knowing: transparent logos trained on a white background, phone photos turned).
CONVERSIONS = (
    "transparency",       # alpha (RGBA, LA, WebP) or a transparent palette index composited onto the background
    "exif orientation",   # turned or mirrored as the EXIF orientation tag says (phone photos)
    "16-bit",             # 16-bit greyscale (I;16) scaled to 8 bits, not clipped
    "cmyk",               # CMYK (print JPEGs) to RGB
    "greyscale",          # one-channel images repeated into RGB
    "palette",            # palette (GIF, 8-bit PNG) expanded to RGB
    "animation",          # an animated GIF or WebP: its first frame
)
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
# The most pixels an image may have to be decoded: Pillow's own default bound (a 9,459-px square, 268 MB as RGB).
# A few kilobytes of PNG or GIF can declare gigapixels (a decompression bomb), and Pillow by itself only warns up to
# twice its bound (and not at all when a program has set Image.MAX_IMAGE_PIXELS to None); the header's size is
# checked here against this fixed bound before any pixel is decoded. Training images are cut to a few hundred
# pixels a side, and photos from all but medium-format cameras (up to about 60 MP) stay below it.
MAX_IMAGE_PIXELS = 89_478_485


class ImageTooLarge(ValueError):
    """An image whose header declares more than :data:`MAX_IMAGE_PIXELS` pixels; nothing of it was decoded."""


@contextlib.contextmanager
def open_image(source: bytes | str | os.PathLike | IO[bytes]) -> Iterator[Image.Image]:
    """``Image.open`` (which reads the header only) of ``source`` (bytes, a path or a binary stream), refusing an
    image that declares more than :data:`MAX_IMAGE_PIXELS` pixels with :class:`ImageTooLarge` before it is decoded."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, in one line of ours
        try:
            img = Image.open(stream)
        except Image.DecompressionBombError as exc:  # beyond twice Pillow's bound: it says how many
            declared = re.search(r"\((\d+) pixels\)", str(exc))
            raise ImageTooLarge(_too_large(declared.group(1) if declared else "more")) from None
    with img:
        width, height = img.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageTooLarge(_too_large(f"{width * height} ({width}x{height})"))
        yield img


def _too_large(pixels: str) -> str:
    return (f"it declares {pixels} pixels, more than the {MAX_IMAGE_PIXELS} an image may have (a possible "
            "decompression bomb)")


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # a malformed EXIF block: shown unturned, as viewers do
        return 1


def background_colour(background: Sequence[int]) -> tuple[int, int, int]:
    """``background`` as an RGB triple; a bad value is one line naming it."""
    ok = not isinstance(background, (str, bytes)) and isinstance(background, Sequence) and len(background) == 3
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in background)
    if not ok:
        shown = list(background) if isinstance(background, Sequence) and not isinstance(background, str) else background
        raise ValueError(f"data.background={shown!r}; expected three integers in [0, 255] (R, G, B), e.g. [255, 255, 255]")
    return tuple(background)  # type: ignore[return-value]


def decode_image(data: bytes, background: Sequence[int] = WHITE,
                 converted: Callable[[str], None] | None = None) -> Image.Image:
    """Decode PNG/JPEG/WebP/GIF bytes to the RGB image a viewer shows (no resize); raises on corrupt data (the
    caller skips and counts it).

    ``convert("RGB")`` alone shows the colour hidden under transparent pixels (often black), trains a phone photo
    sideways and clips 16-bit greyscale to white. Here transparency is composited onto ``background``, the EXIF
    orientation is applied, and ``I;16`` is scaled to 8 bits. ``converted`` is called with each of
    ``CONVERSIONS`` the image needed. An image that declares more than :data:`MAX_IMAGE_PIXELS` pixels raises
    :class:`ImageTooLarge` before it is decoded.
    """
    note = converted or (lambda name: None)
    fill = background_colour(background)
    with open_image(data) as img:
        if getattr(img, "n_frames", 1) > 1:
            note("animation")  # Image.open is positioned on the first frame
        img.load()
        if _orientation(img) != 1:
            note("exif orientation")
            img = ImageOps.exif_transpose(img)
        else:
            img = img.copy()
    mode = img.mode
    if mode in SIXTEEN_BIT:
        note("16-bit")
        values = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)).convert("RGB")
    if mode == "CMYK":
        note("cmyk")
    elif mode in ("L", "1", "LA", "La"):
        note("greyscale")
    elif mode in ("P", "PA"):
        note("palette")
    if "A" in mode or "a" in mode or "transparency" in img.info:
        rgba = img.convert("RGBA")
        if rgba.getextrema()[3][0] < 255:
            note("transparency")
            canvas = Image.new("RGBA", rgba.size, fill + (255,))
            return Image.alpha_composite(canvas, rgba).convert("RGB")
        return rgba.convert("RGB")
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
