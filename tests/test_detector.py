"""The caption-matching detector: right on the world's renders, wrong captions rejected, mild damage tolerated.

Ground truth is the scene the image was rendered from (its JSON attributes and boxes), never the detector.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from dalle_lightning.world import (
    COLOURS,
    SHAPES,
    ObjectSpec,
    Scene,
    caption_accuracy,
    detect,
    match,
    render,
    sample_scenes,
)

OPPOSITE = {"to the left of": "to the right of", "to the right of": "to the left of", "above": "below", "below": "above"}


@pytest.fixture(scope="module")
def scenes() -> list[Scene]:
    return sample_scenes(11, "train", 300) + sample_scenes(11, "zeroshot", 100)


@pytest.fixture(scope="module")
def images(scenes) -> list[np.ndarray]:
    return [render(s) for s in scenes]


def test_scores_at_least_99_percent_on_own_renders(scenes, images) -> None:
    report = caption_accuracy(images, [s.caption for s in scenes])
    assert report["n"] == 400
    assert report["accuracy"] >= 0.99
    assert min(report[k] for k in ("count", "colour", "shape", "size", "relation")) >= 0.99


def test_detections_agree_with_the_scene(scenes, images) -> None:
    agree = 0
    for scene, image in zip(scenes, images):
        found = sorted(detect(image), key=lambda d: d.box)
        truth = sorted(scene.objects, key=lambda o: o.box)
        same = len(found) == len(truth) and all(
            (d.colour, d.shape, d.size) == (o.colour, o.shape, o.size)
            and np.abs(np.subtract(d.box, o.box)).max() <= 3  # triangle apex rows are thin
            and np.abs(np.subtract(d.centre, o.centre)).max() <= 2
            for d, o in zip(found, truth)
        )
        agree += same
    assert agree / len(scenes) >= 0.99


def phrase(o: ObjectSpec, colour: str | None = None, shape: str | None = None, size: str | None = None) -> str:
    size = size or (o.size if o.size_stated else None)
    return f"a {size + ' ' if size else ''}{colour or o.colour} {shape or o.shape}"


def caption(scene: Scene, objects: list[str], relation: str | None = None) -> str:
    return objects[0] if len(objects) == 1 else f"{objects[0]} {relation or scene.relation} {objects[1]}"


def test_mismatched_captions_are_rejected(scenes, images) -> None:
    for scene, image in list(zip(scenes, images))[:120]:
        objs = list(scene.objects)
        base = [phrase(o) for o in objs]
        assert match(image, caption(scene, base)).ok
        i = len(objs) - 1  # alter the last object (the reference in two-object captions)
        other_colour = next(c for c in COLOURS if c != objs[i].colour)
        other_shape = next(s for s in SHAPES if s != objs[i].shape)
        other_size = "small" if objs[i].size == "large" else "large"
        for altered, attribute in [
            (phrase(objs[i], colour=other_colour), "colour"),
            (phrase(objs[i], shape=other_shape), "shape"),
            (phrase(objs[i], size=other_size), "size"),
        ]:
            result = match(image, caption(scene, base[:i] + [altered]))
            assert not result.ok and result.count, (scene.caption, altered)
            if len({(o.colour, o.shape) for o in objs}) == len(objs):  # objects told apart by colour and shape
                assert not getattr(result, attribute), (scene.caption, altered)
        if len(objs) == 1:
            result = match(image, f"{base[0]} above {phrase(objs[0], colour=other_colour)}")
            assert not result.ok and not result.count
            continue
        result = match(image, base[0])
        assert not result.ok and not result.count
        for relation in OPPOSITE:
            if relation == scene.relation:
                continue
            indistinguishable = (objs[0].colour, objs[0].shape) == (objs[1].colour, objs[1].shape)
            if relation == OPPOSITE[scene.relation] and indistinguishable:
                continue  # "a red square left of a red square" is true read either way round
            result = match(image, caption(scene, base, relation))
            assert not result.ok and not result.relation, (scene.caption, relation)


def two_squares(dx: int, dy: int) -> np.ndarray:
    """A small red square (subject) displaced by (dx, dy) px from a small white square at (26, 26)."""
    ref = ObjectSpec("white", "square", "small", (26, 26, 38, 38), False)
    sub = ObjectSpec("red", "square", "small", (26 + dx, 26 + dy, 38 + dx, 38 + dy), False)
    return render(Scene((sub, ref), "above", "unused"))


@pytest.mark.parametrize(
    ("dx", "dy", "holds"),
    [
        (-16, 0, {"to the left of"}),
        (-16, 12, {"to the left of"}),
        (-16, 17, {"below"}),  # off-axis larger than on-axis: the other direction is the one a reader sees
        (16, -16, {"to the right of", "above"}),  # exactly diagonal: both readings are fair
        (0, -16, {"above"}),
        (-9, 20, {"below"}),
    ],
)
def test_relation_tolerance(dx: int, dy: int, holds: set[str]) -> None:
    image = two_squares(dx, dy)
    for relation in OPPOSITE:
        result = match(image, f"a red square {relation} a white square")
        assert result.ok == (relation in holds), relation
        assert result.relation == (relation in holds)


def test_relation_needs_a_clear_gap() -> None:
    # Centres 6 px apart (less than the 8 px tolerance): a reader would call them side by side, not stacked.
    ref = ObjectSpec("white", "square", "large", (20, 20, 44, 44), False)
    sub = ObjectSpec("red", "square", "small", (2, 14, 14, 26), False)
    image = render(Scene((sub, ref), "above", "unused"))
    assert not match(image, "a red square above a white square").relation
    assert match(image, "a red square to the left of a white square").ok


def degrade(image: np.ndarray, rng: np.random.Generator, noise: float, blur: float) -> np.ndarray:
    x = ndimage.gaussian_filter(image.astype(np.float64), (blur, blur, 0)) + rng.normal(0, noise, image.shape)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def test_robust_to_mild_noise_and_blur(scenes, images) -> None:
    rng = np.random.default_rng(0)
    damaged = [degrade(im, rng, noise=12.0, blur=0.8) for im in images[:200]]
    assert not any(np.array_equal(a, b) for a, b in zip(damaged, images))
    report = caption_accuracy(damaged, [s.caption for s in scenes[:200]])
    assert report["accuracy"] >= 0.98, report


def one(colour: str, shape: str, size: str = "small") -> ObjectSpec:
    side = 12 if size == "small" else 24
    return ObjectSpec(colour, shape, size, (10, 10, 10 + side, 10 + side), False)


def test_accepts_float_tensors_and_reports_per_attribute() -> None:
    left = ObjectSpec("yellow", "triangle", "large", (4, 20, 28, 44), False)
    right = ObjectSpec("purple", "circle", "small", (40, 26, 52, 38), False)
    images = [render(Scene(objs, None, "unused")) for objs in [(one("red", "circle"),), (one("blue", "circle"),),
                                                              (one("white", "square", "large"),), (left, right)]]
    captions = [
        "a red circle",  # right
        "a picture of a blue triangle",  # wrong shape
        "a small white square",  # wrong size
        "a purple circle to the left of a yellow triangle",  # wrong relation
    ]
    batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255  # B x 3 x H x W in [0, 1]
    assert detect(batch[3]) == detect(images[3])
    report = caption_accuracy(batch, captions)
    assert report == {"accuracy": 0.25, "count": 1.0, "colour": 1.0, "shape": 0.75, "size": 0.75, "relation": 0.75,
                      "n": 4}
    assert caption_accuracy(images, ["a yellow triangle"] * 4)["count"] == 0.75  # three single objects, one pair


def test_bad_input_errors(images) -> None:
    with pytest.raises(ValueError, match="'a red hexagon'"):
        match(images[0], "a red hexagon")
    with pytest.raises(ValueError, match=r"shape \(64, 64\)"):
        detect(np.zeros((64, 64)))
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        caption_accuracy(images[:2], ["a red square"])
    assert detect(np.zeros((64, 64, 3), dtype=np.uint8)) == []
