"""Hard negative captions: judged by the world's own detector, each must miss the image its source caption fits."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dalle_lightning.world import HELD_OUT, match, parse_caption, render, sample_scenes
from dalle_lightning.world.negatives import EDITS, NegativeCaptions, edit_kind, format_caption, negative_caption


@pytest.fixture(scope="module")
def scenes():
    return sample_scenes(5, "train", 400)


def test_every_negative_misses_the_image_of_its_source(scenes) -> None:
    rng = random.Random(0)
    kinds: Counter[str] = Counter()
    for scene in scenes:
        image = render(scene)
        assert match(image, scene.caption).ok
        for _ in range(3):
            negative = negative_caption(scene.caption, rng)
            assert negative != scene.caption
            assert not match(image, negative).ok, (scene.caption, negative)
            spec = parse_caption(negative)  # in the grammar, with the source's template
            assert spec.template == parse_caption(scene.caption).template
            assert all((o.colour, o.shape) not in HELD_OUT for o in spec.objects)
            kinds[edit_kind(parse_caption(scene.caption), spec)] += 1
    # Every kind of edit occurs, none dominates.
    assert set(kinds) == set(EDITS), kinds
    assert max(kinds.values()) < 0.4 * sum(kinds.values()), kinds


def test_relation_is_not_flipped_between_interchangeable_objects() -> None:
    rng = random.Random(0)
    caption = "a blue circle above a large blue circle"
    negatives = {negative_caption(caption, rng) for _ in range(300)}
    assert "a blue circle below a large blue circle" not in negatives
    assert "a small blue circle below a large blue circle" not in negatives  # a size flip would need a stated size
    assert "a small blue circle above a large blue circle" not in negatives


def test_format_inverts_parse_and_callable_is_seeded(scenes) -> None:
    for scene in scenes[:50]:
        assert format_caption(parse_caption(scene.caption)) == scene.caption
    captions = [s.caption for s in scenes[:20]]
    assert [NegativeCaptions(3)(c) for c in captions] == [NegativeCaptions(3)(c) for c in captions]
    with pytest.raises(ValueError, match="not in the shapes-world grammar"):
        negative_caption("a teal hexagon", random.Random(0))
    with pytest.raises(ValueError, match="module.negatives=null"):
        NegativeCaptions(0)("a photo of a dog")
    with pytest.raises(ValueError, match="held-out"):
        negative_caption("a green circle below a green circle", random.Random(0))
