"""Read a shapes-world caption back into what the image must show.

The grammar is the world's own: an optional template around ``<object>`` or ``<object> <relation> <object>``,
each object ``a [small|large] <colour> <shape>``. Parsing is exact (after lower-casing, collapsing whitespace
and dropping a final full stop), so a caption the world could not have produced is an error, not a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dalle_lightning.world.scene import COLOURS, RELATIONS, SHAPES, SIZES, TEMPLATES


@dataclass(frozen=True)
class CaptionObject:
    """An object the caption asks for; ``size`` is None when the caption does not say."""

    colour: str
    shape: str
    size: str | None


@dataclass(frozen=True)
class CaptionSpec:
    """Objects in caption order (subject first), the relation (None for one object) and the template used."""

    objects: tuple[CaptionObject, ...]
    relation: str | None
    template: str


def _alternatives(words) -> str:
    return "|".join(re.escape(w) for w in words)


_OBJECT = rf"a (?:({_alternatives(SIZES)}) )?({_alternatives(COLOURS)}) ({_alternatives(SHAPES)})"
_BODY = re.compile(rf"{_OBJECT}(?: ({_alternatives(RELATIONS)}) {_OBJECT})?")
# Each template as a regex with one group for the wrapped body.
_TEMPLATES = [(t, re.compile(re.escape(t).replace(re.escape("{}"), "(.+)"))) for t in TEMPLATES]


def _parse_body(body: str) -> tuple[tuple[CaptionObject, ...], str | None] | None:
    m = _BODY.fullmatch(body)
    if m is None:
        return None
    size_a, colour_a, shape_a, relation, size_b, colour_b, shape_b = m.groups()
    objects = [CaptionObject(colour_a, shape_a, size_a)]
    if relation is not None:
        objects.append(CaptionObject(colour_b, shape_b, size_b))
    return tuple(objects), relation


def parse_caption(caption: str) -> CaptionSpec:
    """The objects and relation ``caption`` states; ``ValueError`` naming the caption if it is not in the grammar."""
    if not isinstance(caption, str):
        raise ValueError(f"caption {caption!r} is not a string")
    text = " ".join(caption.lower().split()).removesuffix(".")
    # The plain template "{}" matches everything, so the wrapping templates are tried first.
    for template, pattern in sorted(_TEMPLATES, key=lambda tp: tp[0] == "{}"):
        m = pattern.fullmatch(text)
        parsed = _parse_body(m.group(1)) if m else None
        if parsed is not None:
            return CaptionSpec(objects=parsed[0], relation=parsed[1], template=template)
    raise ValueError(
        f"caption {caption!r} is not in the shapes-world grammar "
        "('[template] a [size] <colour> <shape> [<relation> a [size] <colour> <shape>]')"
    )
