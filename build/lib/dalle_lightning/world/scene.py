"""The shapes world's vocabulary and its scene sampler (specified in ``docs/shapes-world.md``).

A *scene* is what one image shows plus the caption that describes it. Everything here is pure data and a
seeded ``numpy`` generator, so the same seed always yields the same scenes on any machine; rendering and
shard writing live in their own modules.

Choices that a looser statement of the world would leave open, made here (and recorded on that page):

* Boxes are half-open pixel ranges ``(x0, y0, x1, y1)``: the object covers columns ``x0 .. x1 - 1``.
* In a two-object scene the first object of the caption is the *subject*: ``"<subject> above <reference>"``.
  Besides the page's rule (box centres at least 16 px apart along the relation's axis, in its direction),
  the off-axis offset is at most half the on-axis one, so the stated relation is the one a reader sees
  (a subject far up *and* left would fit "above" as well as "to the left of").
* Two objects may share colour and shape; the caption's relation still says which is which.
* Zero-shot scenes contain at least one held-out pair; the other object (if any) is drawn from all pairs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 220, 40),
    "purple": (160, 70, 210),
    "white": (235, 235, 235),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
SIZES: dict[str, int] = {"small": 12, "large": 24}
HELD_OUT: frozenset[tuple[str, str]] = frozenset({("red", "triangle"), ("green", "circle"), ("blue", "square")})
RELATIONS: tuple[str, ...] = ("to the left of", "to the right of", "above", "below")
TEMPLATES: tuple[str, ...] = ("{}", "a picture of {}", "an image of {}", "{} on a black background")
SPLITS: tuple[str, ...] = ("train", "val", "zeroshot")

MARGIN = 2  # px between every object and the canvas edge
GAP = 4  # px between the boxes of two objects
MIN_CENTRE_DISTANCE = 16  # px between box centres along the relation's axis

# Relation -> (axis, sign): the subject's centre minus the reference's, along axis (0 = x, 1 = y), has this sign.
RELATION_AXIS: dict[str, tuple[int, int]] = {
    "to the left of": (0, -1),
    "to the right of": (0, 1),
    "above": (1, -1),
    "below": (1, 1),
}

_ALL_PAIRS: tuple[tuple[str, str], ...] = tuple((c, s) for c in COLOURS for s in SHAPES)
_SEEN_PAIRS: tuple[tuple[str, str], ...] = tuple(p for p in _ALL_PAIRS if p not in HELD_OUT)
_HELD_OUT_PAIRS: tuple[tuple[str, str], ...] = tuple(sorted(HELD_OUT))
_SPLIT_ID = {name: i for i, name in enumerate(SPLITS)}


@dataclass(frozen=True)
class ObjectSpec:
    """One drawn object: ``box`` is half-open ``(x0, y0, x1, y1)``; ``size_stated`` says if the caption names the size."""

    colour: str
    shape: str
    size: str
    box: tuple[int, int, int, int]
    size_stated: bool

    @property
    def centre(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2

    def phrase(self) -> str:
        """The caption's object phrase, ``a [size] <colour> <shape>``."""
        size = f"{self.size} " if self.size_stated else ""
        return f"a {size}{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """Objects in caption order (subject first), the relation between them (None for one object), the caption."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None
    caption: str

    def to_json(self) -> dict:
        """The per-sample ``.json`` of the shards: caption, relation and each object's attributes and box."""
        return {
            "caption": self.caption,
            "relation": self.relation,
            "objects": [{**asdict(o), "box": list(o.box)} for o in self.objects],
        }


def _check_split(split: str) -> None:
    if split not in _SPLIT_ID:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")


def _check_image_size(image_size: int) -> None:
    # Two large objects side by side need 2 * margin + 2 * 24 + gap px.
    need = 2 * MARGIN + 2 * SIZES["large"] + GAP
    if image_size < need:
        raise ValueError(f"image_size {image_size} is too small for the shapes world; expected at least {need}")


def split_rng(seed: int, split: str, stream: int) -> np.random.Generator:
    """An independent generator per (seed, split, stream): splits never share draws, whatever their lengths.

    ``spawn_key`` is numpy's mechanism for independent child streams (an entropy list like ``[seed, 0, 0]``
    would not do: trailing zeros hash like ``seed`` alone).
    """
    _check_split(split)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_SPLIT_ID[split], stream)))


def _pairs(rng: np.random.Generator, split: str, n: int) -> list[tuple[str, str]]:
    """Colour-shape pairs for ``n`` objects: none held out in train/val, at least one held out in zero-shot."""
    if split != "zeroshot":
        return [_SEEN_PAIRS[i] for i in rng.integers(len(_SEEN_PAIRS), size=n)]
    pairs = [_ALL_PAIRS[i] for i in rng.integers(len(_ALL_PAIRS), size=n)]
    held = int(rng.integers(n))
    pairs[held] = _HELD_OUT_PAIRS[int(rng.integers(len(_HELD_OUT_PAIRS)))]
    return pairs


def _place_pair(
    rng: np.random.Generator, sizes: tuple[int, int], relation: str, image_size: int
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Uniform over placements that satisfy the margin, gap and relation rules (rejection sampling in batches)."""
    axis, sign = RELATION_AXIS[relation]
    (sa, sb), hi = sizes, [image_size - MARGIN - s + 1 for s in sizes]
    while True:
        xa, ya = rng.integers(MARGIN, hi[0], size=(2, 256))
        xb, yb = rng.integers(MARGIN, hi[1], size=(2, 256))
        d = np.stack([(xa + sa / 2) - (xb + sb / 2), (ya + sa / 2) - (yb + sb / 2)])
        on, off = sign * d[axis], np.abs(d[1 - axis])
        gap = np.maximum.reduce([xb - (xa + sa), xa - (xb + sb), yb - (ya + sa), ya - (yb + sb)])
        ok = np.flatnonzero((on >= MIN_CENTRE_DISTANCE) & (off <= on / 2) & (gap >= GAP))
        if ok.size:
            i = int(ok[0])
            a = (int(xa[i]), int(ya[i]), int(xa[i]) + sa, int(ya[i]) + sa)
            b = (int(xb[i]), int(yb[i]), int(xb[i]) + sb, int(yb[i]) + sb)
            return a, b


def sample_scene(rng: np.random.Generator, split: str, image_size: int = 64) -> Scene:
    """Draw one scene of ``split``: one or two objects (even odds), sizes, placement, relation and caption."""
    _check_split(split)
    _check_image_size(image_size)
    n = int(rng.integers(1, 3))
    pairs = _pairs(rng, split, n)
    size_names = [list(SIZES)[i] for i in rng.integers(len(SIZES), size=n)]
    stated = rng.random(n) < 0.5
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    pixels = [SIZES[s] for s in size_names]
    if n == 1:
        x, y = rng.integers(MARGIN, image_size - MARGIN - pixels[0] + 1, size=2)
        boxes = [(int(x), int(y), int(x) + pixels[0], int(y) + pixels[0])]
        relation = None
    else:
        relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
        boxes = list(_place_pair(rng, (pixels[0], pixels[1]), relation, image_size))
    objects = tuple(
        ObjectSpec(colour=c, shape=s, size=z, box=b, size_stated=bool(t))
        for (c, s), z, b, t in zip(pairs, size_names, boxes, stated)
    )
    text = objects[0].phrase() if relation is None else f"{objects[0].phrase()} {relation} {objects[1].phrase()}"
    return Scene(objects=objects, relation=relation, caption=template.format(text))


def sample_scenes(seed: int, split: str, n: int, image_size: int = 64) -> list[Scene]:
    """The ``n`` scenes of ``split`` that ``write_world`` writes for ``seed`` (stream 0 of that split)."""
    rng = split_rng(seed, split, stream=0)
    return [sample_scene(rng, split, image_size) for _ in range(n)]


def sample_captions(seed: int, split: str, n: int) -> list[str]:
    """Fresh captions of ``split`` for evaluation prompts.

    They come from their own stream (1), so for the same seed they are not the captions of the written shards.
    """
    if n < 0:
        raise ValueError(f"n={n} captions requested; expected n >= 0")
    rng = split_rng(seed, split, stream=1)
    return [sample_scene(rng, split).caption for _ in range(n)]
