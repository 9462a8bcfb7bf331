"""Image files written whole or not at all: a PIL image encoded in memory, then written through the plugins'
atomic writer (``dalle_lightning_plugins.io.atomic_files``: a temporary file beside the target, renamed into place).

Here rather than beside the atomic writer: it needs Pillow, which ``dalle-lightning`` requires and the plugins'
distribution does not. The image grids of the callbacks and ``dalle_lightning``'s PNG outputs (``dalle-generate``'s
images and grid, ``dalle-eval``'s charts) write through it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from PIL import Image

from dalle_lightning_plugins.io.atomic_files import write_bytes


def save_image(image: Image.Image, path: str | os.PathLike, **options: Any) -> Path:
    """Save a PIL image to ``path`` atomically, in the format its suffix names (``.png``, ``.jpg``, ...)."""
    path = Path(path)
    fmt = Image.registered_extensions().get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell an image format from {str(path)!r}; expected a suffix such as .png or .jpg")
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return write_bytes(path, buf.getvalue())
