"""Hard negative captions: a caption changed in one detail so that its image no longer matches it.

The reranker must choose among candidates drawn for the *same* caption, which differ in a colour, a shape, a
size or the side an object is on. Random in-batch captions rarely differ from the true one by so little, so a
contrastive model trained on them alone learns the easy parts (how many objects, roughly which colours) and
ranks near-misses no better than chance. Each edit here makes a caption that the world's matching rule
(``docs/shapes-world.md``) certainly rejects for the original image:

* ``colour`` / ``shape``: one object gets another colour or shape;
* ``size``: a stated size flips (small <-> large); an unstated one is never added, as it might be true;
* ``relation``: the relation turns to its opposite (left <-> right, above <-> below), unless one object
  could match both phrases ("a blue circle above a blue circle" flipped describes the same image);
* ``swap``: the two objects trade colours (or shapes), so each attribute is present but bound wrongly;
* ``count``: a two-object caption loses its second object, a one-object caption gains one.

Edits never name a held-out colour-shape pair, so training text stays as free of them as training images.
"""

from __future__ import annotations

import random

from dalle_lightning.world.parse import CaptionObject, CaptionSpec, parse_caption
from dalle_lightning.world.scene import COLOURS, HELD_OUT, RELATIONS, SHAPES

OPPOSITE = {"to the left of": "to the right of", "to the right of": "to the left of", "above": "below", "below": "above"}
EDITS = ("colour", "shape", "size", "relation", "swap", "count")


def format_caption(spec: CaptionSpec) -> str:
    """The caption text of ``spec`` (the inverse of :func:`parse_caption`)."""
    phrases = [" ".join(["a", *([o.size] if o.size else []), o.colour, o.shape]) for o in spec.objects]
    body = phrases[0] if spec.relation is None else f"{phrases[0]} {spec.relation} {phrases[1]}"
    return spec.template.format(body)


def _seen(obj: CaptionObject) -> bool:
    return (obj.colour, obj.shape) not in HELD_OUT


def _interchangeable(a: CaptionObject, b: CaptionObject) -> bool:
    """Whether one drawn object could match both phrases: then "a above b" and "a below b" fit the same image."""
    return a.colour == b.colour and a.shape == b.shape and (a.size is None or b.size is None or a.size == b.size)


def _candidates(spec: CaptionSpec) -> dict[str, list[CaptionSpec]]:
    """Every one-edit negative of ``spec`` that names no held-out pair, by kind of edit (:data:`EDITS`)."""
    objs, out = list(spec.objects), {k: [] for k in EDITS}

    def with_objects(kind: str, new: list[CaptionObject], relation: str | None = spec.relation) -> None:
        if all(_seen(o) for o in new):
            out[kind].append(CaptionSpec(objects=tuple(new), relation=relation, template=spec.template))

    for i, o in enumerate(objs):
        for colour in COLOURS:
            if colour != o.colour:
                with_objects("colour", objs[:i] + [CaptionObject(colour, o.shape, o.size)] + objs[i + 1 :])
        for shape in SHAPES:
            if shape != o.shape:
                with_objects("shape", objs[:i] + [CaptionObject(o.colour, shape, o.size)] + objs[i + 1 :])
        if o.size is not None:
            flipped = "large" if o.size == "small" else "small"
            with_objects("size", objs[:i] + [CaptionObject(o.colour, o.shape, flipped)] + objs[i + 1 :])
    if spec.relation is not None:
        a, b = objs
        if not _interchangeable(a, b):
            with_objects("relation", objs, OPPOSITE[spec.relation])
        if a.colour != b.colour:
            with_objects("swap", [CaptionObject(b.colour, a.shape, a.size), CaptionObject(a.colour, b.shape, b.size)])
        if a.shape != b.shape:
            with_objects("swap", [CaptionObject(a.colour, b.shape, a.size), CaptionObject(b.colour, a.shape, b.size)])
        with_objects("count", [a], None)
    return out


def _added_object(spec: CaptionSpec, rng: random.Random) -> CaptionSpec:
    """A one-object caption with a second, seen object in a random relation to the first."""
    while True:
        extra = CaptionObject(rng.choice(list(COLOURS)), rng.choice(SHAPES), None)
        if _seen(extra):
            return CaptionSpec(objects=(spec.objects[0], extra), relation=rng.choice(RELATIONS), template=spec.template)


def negative_caption(caption: str | CaptionSpec, rng: random.Random) -> str:
    """A caption one edit away from ``caption`` that its image cannot match.

    The kind of edit is drawn first (uniformly among those the caption allows), then the edit itself, so a
    two-object caption is not dominated by its many colour edits. ``ValueError`` if ``caption`` is not in the
    world's grammar, or if every edit would keep a held-out pair (meant for training captions, which have none).
    """
    spec = parse_caption(caption) if isinstance(caption, str) else caption
    by_kind = _candidates(spec)
    if spec.relation is None and _seen(spec.objects[0]):  # (two-object captions drop one object instead)
        by_kind["count"] = [_added_object(spec, rng)]
    kinds = [k for k in EDITS if by_kind[k]]
    if not kinds:
        raise ValueError(f"caption {format_caption(spec)!r} has no one-edit negative free of held-out colour-shape pairs")
    return format_caption(rng.choice(by_kind[rng.choice(kinds)]))


def edit_kind(spec: CaptionSpec, neg: CaptionSpec) -> str:
    """Which of :data:`EDITS` turns ``spec`` into ``neg`` (both one edit apart), read off the two captions."""
    if len(neg.objects) != len(spec.objects):
        return "count"
    if neg.relation != spec.relation:
        return "relation"
    changed = [(o, n) for o, n in zip(spec.objects, neg.objects) if o != n]
    if len(changed) == 2:
        return "swap"
    o, n = changed[0]
    return "colour" if o.colour != n.colour else "shape" if o.shape != n.shape else "size"


class NegativeCaptions:
    """A seeded caption -> negative caption callable, the ``negatives`` protocol :class:`ClipModule` takes."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def __call__(self, caption: str) -> str:
        try:
            spec = parse_caption(caption)
        except ValueError as err:
            raise ValueError(f"{err}; hard negatives need shapes-world captions (module.negatives=null for other data)") from None
        return negative_caption(spec, self.rng)
