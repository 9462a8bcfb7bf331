"""Decide by program whether an image shows what its shapes-world caption says.

The detector finds connected coloured regions. It has to work on generated images (dVAE reconstructions,
prior samples: soft edges, colour noise), not only on exact renders, so each step tolerates some damage:

* **Pixel colour.** A blurred edge is a mix of a palette colour and black, i.e. a point on the ray from black
  to that colour. Each pixel is given the palette colour whose ray passes closest, and counts as foreground when
  it is at least half as bright as that colour along the ray. (Plain nearest-colour would call a half-bright
  white edge "green" and ring every white object with a green region.)
* **Regions.** The foreground mask gets a 3x3 majority vote (noise at soft edges flips single pixels), then
  connected components (8-neighbour); specks under ``MIN_AREA`` pixels are ignored. A region's colour is the
  majority colour of its pixels, so stray off-colour pixels do not split it.
* **Shape** by template fit: each of square, circle and triangle (fill ratios 1, pi/4, 1/2 of the box) is
  placed at the region's centroid with the side its area implies, and the one overlapping the region best
  (intersection over union) wins. Area and centroid are sums over all pixels, so ragged edges hardly move them,
  unlike the extremes of a bounding box.
* **Size** from that fitted side: small (12 px) up to ``SIZE_SPLIT`` = 18 px, large (24 px) above.

Matching follows the world's rule "a reader would agree". Relation tolerance (chosen here): the subject's box
centre must be at least ``RELATION_MIN_PX`` = 8 px from the reference's in the stated direction, and the offset
along the other axis may not exceed that distance (the stated direction is within 45 degrees). Renders have at
least 16 px and at most half that off-axis, so they pass with room to spare, while a swapped relation fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from dalle_lightning.world.parse import CaptionObject, CaptionSpec, parse_caption
from dalle_lightning.world.scene import COLOURS, RELATION_AXIS, SIZES

MIN_AREA = 20  # px; the smallest real object (small triangle) has about 70
FOREGROUND_BRIGHTNESS = 0.5  # fraction of the palette colour's brightness along its ray
SIZE_SPLIT = (SIZES["small"] + SIZES["large"]) / 2
RELATION_MIN_PX = 8.0
SHAPE_FILL: dict[str, float] = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}  # area / side^2

_NAMES = list(COLOURS)
_PALETTE = np.array([COLOURS[c] for c in _NAMES], dtype=np.float32)  # (K, 3)
_NORMS = np.linalg.norm(_PALETTE, axis=1)  # (K,)


@dataclass(frozen=True)
class Detected:
    """A found object: half-open ``box`` (x0, y0, x1, y1), box ``centre`` (x, y) and pixel ``area``."""

    colour: str
    shape: str
    size: str
    box: tuple[int, int, int, int]
    centre: tuple[float, float]
    area: int


@dataclass(frozen=True)
class MatchResult:
    """Which of the caption's requirements the image meets; ``ok`` is all of them."""

    count: bool
    colour: bool
    shape: bool
    size: bool
    relation: bool
    ok: bool
    detected: tuple[Detected, ...] = field(default=(), repr=False)


def as_image(image) -> np.ndarray:
    """H x W x 3 uint8 from a numpy array or torch tensor, HWC or CHW, uint8 or float in [0, 1]."""
    if hasattr(image, "detach"):  # a torch tensor, without importing torch here
        image = image.detach().float().cpu().numpy()
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3:
        array = array.transpose(1, 2, 0)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"image of shape {array.shape} is not an RGB image; expected H x W x 3 or 3 x H x W")
    if array.dtype != np.uint8:
        array = np.clip(np.rint(array.astype(np.float32) * 255), 0, 255).astype(np.uint8)
    return array


def classify_pixels(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel: the index of the palette colour whose ray is closest, and whether the pixel is foreground.

    For a pixel p and colour c (both non-negative) the distance to the ray is sqrt(|p|^2 - (p.c / |c|)^2), so the
    closest ray is the one with the largest p.c / |c|, and the position along it is p.c / |c|^2.
    """
    dot = image.astype(np.float32) @ _PALETTE.T  # (H, W, K)
    best = (dot / _NORMS).argmax(-1)
    brightness = np.take_along_axis(dot, best[..., None], -1)[..., 0] / _NORMS[best] ** 2
    return best, brightness >= FOREGROUND_BRIGHTNESS


def _shape_mask(shape: str, side: float, cx: float, cy: float, h: int, w: int) -> np.ndarray:
    """``shape`` with side ``side`` and centroid (cx, cy), rasterised by pixel centres on an h x w grid."""
    x0 = cx - side / 2
    y0 = cy - (2 * side / 3 if shape == "triangle" else side / 2)  # a triangle's centroid is 2/3 down
    u = ((np.arange(w) + 0.5 - x0) / side)[None, :]
    v = ((np.arange(h) + 0.5 - y0) / side)[:, None]
    if shape == "square":
        return (u >= 0) & (u <= 1) & (v >= 0) & (v <= 1)
    if shape == "circle":
        return (u - 0.5) ** 2 + (v - 0.5) ** 2 <= 0.25
    return (np.abs(u - 0.5) <= v / 2) & (v <= 1)


def classify_shape(region: np.ndarray) -> tuple[str, float]:
    """Best-fitting shape of a boolean region (cropped to its box) and that shape's side in pixels.

    Each candidate is placed by the region's centroid and sized by its area, and the one with the largest
    intersection over union wins; area and centroid are sums over all pixels, so ragged edges hardly move them.
    """
    pad = max(region.shape) // 2 + 2
    canvas = np.pad(region, pad)
    ys, xs = np.nonzero(canvas)
    cx, cy, area = xs.mean() + 0.5, ys.mean() + 0.5, xs.size
    best = ("", -1.0, 0.0)
    for shape, fill in SHAPE_FILL.items():
        side = float(np.sqrt(area / fill))
        candidate = _shape_mask(shape, side, cx, cy, *canvas.shape)
        iou = (candidate & canvas).sum() / (candidate | canvas).sum()
        if iou > best[1]:
            best = (shape, iou, side)
    return best[0], best[2]


def detect(image) -> list[Detected]:
    """Objects in ``image`` (see ``as_image`` for accepted formats), in raster order of their first pixel."""
    pixels = as_image(image)
    colour_index, foreground = classify_pixels(pixels)
    # 3x3 majority vote: noise flips single pixels at soft edges; this removes spurs and fills pinholes.
    foreground = ndimage.uniform_filter(foreground.astype(np.float32), 3, mode="constant") > 0.5
    labels, _ = ndimage.label(foreground, structure=np.ones((3, 3), dtype=bool))
    found: list[Detected] = []
    for label, box in enumerate(ndimage.find_objects(labels), start=1):
        region = labels[box] == label
        area = int(region.sum())
        if area < MIN_AREA:
            continue
        colour = _NAMES[int(np.bincount(colour_index[box][region], minlength=len(_NAMES)).argmax())]
        y0, y1, x0, x1 = box[0].start, box[0].stop, box[1].start, box[1].stop
        shape, side = classify_shape(region)
        found.append(
            Detected(
                colour=colour,
                shape=shape,
                size="large" if side > SIZE_SPLIT else "small",
                box=(x0, y0, x1, y1),
                centre=((x0 + x1) / 2, (y0 + y1) / 2),
                area=area,
            )
        )
    return found


def relation_holds(relation: str, subject: Detected, reference: Detected) -> bool:
    """The stated relation between two detections, with the tolerance in the module docstring."""
    axis, sign = RELATION_AXIS[relation]
    d = np.subtract(subject.centre, reference.centre)
    along, across = sign * d[axis], abs(d[1 - axis])
    return bool(along >= RELATION_MIN_PX and across <= along)


def _agreement(wanted: CaptionObject, seen: Detected) -> tuple[bool, bool, bool]:
    return wanted.colour == seen.colour, wanted.shape == seen.shape, wanted.size in (None, seen.size)


def match(image, caption: str | CaptionSpec) -> MatchResult:
    """Does ``image`` show ``caption``? Caption objects are paired with detections by trying every assignment.

    Like a reader, the pairing goes by description first: the assignment kept is the one whose pairs agree on
    the most colours, shapes and sizes, and the relation is judged on it (a wrong relation is reported as a
    wrong relation, not as swapped colours). With a wrong count the booleans still say what else went wrong;
    a caption object left without a detection fails colour, shape and size.
    """
    spec = parse_caption(caption) if isinstance(caption, str) else caption
    found = detect(image)
    best: tuple[tuple[int, bool], dict[str, bool]] | None = None
    for chosen in itertools.permutations(found, min(len(found), len(spec.objects))):
        agreement = [_agreement(c, d) for c, d in zip(spec.objects, chosen)]
        complete = len(chosen) == len(spec.objects)
        checks = {
            name: complete and all(a[k] for a in agreement) for k, name in enumerate(("colour", "shape", "size"))
        }
        checks["relation"] = spec.relation is None or (complete and relation_holds(spec.relation, *chosen))
        rank = (sum(map(sum, agreement)), checks["relation"])
        if best is None or rank > best[0]:
            best = (rank, checks)
    assert best is not None  # permutations always yields at least the empty assignment
    count, checks = len(found) == len(spec.objects), best[1]
    return MatchResult(count=count, **checks, ok=count and all(checks.values()), detected=tuple(found))


def caption_accuracy(images: Iterable, captions: Sequence[str]) -> dict[str, float]:
    """Share of images matching their captions (``accuracy``) and share passing each check.

    A check with nothing to verify passes (``size`` when no size is stated, ``relation`` for one object).
    ``images`` is a sequence of images or a batch (N x H x W x 3 or N x 3 x H x W, uint8 or float in [0, 1]).
    """
    images = list(images)
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions; expected one caption per image")
    return summarize_matches([match(image, caption) for image, caption in zip(images, captions)])


def summarize_matches(results: Sequence[MatchResult]) -> dict[str, float]:
    """The :func:`caption_accuracy` report of results already judged, so a caller that judged every candidate
    once can report any selection of them without running the detector again."""
    if not results:
        raise ValueError("caption_accuracy got no images; expected at least one image-caption pair")
    keys = ("count", "colour", "shape", "size", "relation")
    report = {k: float(np.mean([getattr(r, k) for r in results])) for k in keys}
    return {"accuracy": float(np.mean([r.ok for r in results])), **report, "n": len(results)}
