"""Image priming, the paper's image-to-image translation: the dVAE encodes an image, the top ``rows`` rows of its
token grid become the start of every sample, and the prior completes the rest under the caption (the paper
primes with the top 15 of 32 rows). Since codes are in raster order, the first ``rows * grid`` tokens are exactly
those rows, and the sampler keeps them as given (``sample_image_tokens(image_prefix=...)``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import UnidentifiedImageError
from torch import nn

from dalle_lightning.data.transforms import MAX_IMAGE_PIXELS, ImageTooLarge, center_square_resize, open_image, to_tensor


def load_prime_image(path: str | Path, size: int) -> torch.Tensor:
    """The image at ``path`` as the dVAE sees it: centre square crop resized to ``size``, ``[1, 3, size, size]``
    in [0, 1] (the evaluation transform of the training data)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prime_image {str(path)!r} does not exist; expected an image file (PNG, JPEG, ...)")
    try:
        with open_image(path) as img:  # its header's size checked before any pixel is decoded
            rgb = img.convert("RGB")
    except ImageTooLarge as exc:
        raise ValueError(f"prime_image {str(path)!r}: {exc}, so it was not decoded; expected an image of at most "
                         f"{MAX_IMAGE_PIXELS} pixels (it is cut to {size}x{size} pixels anyway)") from None
    except UnidentifiedImageError:
        raise ValueError(f"prime_image {str(path)!r} is not an image file; expected a PNG, JPEG or another format "
                         "Pillow reads") from None
    return to_tensor(center_square_resize(rgb, size)).unsqueeze(0)


def check_prime_rows(rows: int, grid: int) -> int:
    """``rows`` must leave at least one row to generate and prime with at least one."""
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= grid - 1:
        raise ValueError(f"prime_rows={rows} is out of range; expected 1 to {grid - 1} of the {grid} token rows "
                         "(the rest is generated)")
    return rows


@torch.no_grad()
def prime_tokens(dvae: nn.Module, image: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``image``'s dVAE codes in raster order, ``LongTensor[B, rows * grid]``."""
    grid = dvae.grid_size
    check_prime_rows(rows, grid)
    device = next(dvae.parameters()).device
    codes = dvae.get_codebook_indices(image.to(device))  # [B, grid, grid]
    return codes[:, :rows].reshape(codes.shape[0], rows * grid)
