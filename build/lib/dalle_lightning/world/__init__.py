"""The shapes world: dalle-lightning's embedded data set and benchmark (specified in ``docs/shapes-world.md``).

``scene`` samples scenes and captions, ``render`` draws them, ``shards`` writes WebDataset shards,
``parse`` reads captions back, and ``detect`` judges whether an image matches its caption.
"""

from dalle_lightning.world.detect import Detected, MatchResult, caption_accuracy, detect, match
from dalle_lightning.world.parse import CaptionObject, CaptionSpec, parse_caption
from dalle_lightning.world.render import render
from dalle_lightning.world.scene import (
    COLOURS,
    HELD_OUT,
    RELATIONS,
    SHAPES,
    SIZES,
    SPLITS,
    TEMPLATES,
    ObjectSpec,
    Scene,
    sample_captions,
    sample_scene,
    sample_scenes,
)
from dalle_lightning.world.shards import write_world

__all__ = [
    "COLOURS",
    "HELD_OUT",
    "RELATIONS",
    "SHAPES",
    "SIZES",
    "SPLITS",
    "TEMPLATES",
    "CaptionObject",
    "CaptionSpec",
    "Detected",
    "MatchResult",
    "ObjectSpec",
    "Scene",
    "caption_accuracy",
    "detect",
    "match",
    "parse_caption",
    "render",
    "sample_captions",
    "sample_scene",
    "sample_scenes",
    "write_world",
]
