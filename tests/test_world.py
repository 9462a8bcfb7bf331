"""The shapes world's generator and shard writer obey docs/shapes-world.md.

References here are written independently of the implementation: shapes by explicit geometry per pixel,
captions rebuilt from the JSON attributes, box gaps by interval arithmetic.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from scipy import ndimage

import dalle_lightning.world.shards as shards_module
from dalle_lightning.world import (
    COLOURS,
    HELD_OUT,
    RELATIONS,
    SIZES,
    TEMPLATES,
    ObjectSpec,
    Scene,
    parse_caption,
    render,
    sample_captions,
    sample_scene,
    sample_scenes,
    write_world,
)

PAGE_COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 220, 40),
    "purple": (160, 70, 210),
    "white": (235, 235, 235),
}
PAGE_HELD_OUT = {("red", "triangle"), ("green", "circle"), ("blue", "square")}


def test_constants_match_the_page() -> None:
    assert COLOURS == PAGE_COLOURS
    assert SIZES == {"small": 12, "large": 24}
    assert HELD_OUT == frozenset(PAGE_HELD_OUT)
    assert set(RELATIONS) == {"to the left of", "to the right of", "above", "below"}
    assert set(TEMPLATES) == {"{}", "a picture of {}", "an image of {}", "{} on a black background"}


@pytest.fixture(scope="module")
def scenes() -> dict[str, list[Scene]]:
    return {"train": sample_scenes(0, "train", 3000), "val": sample_scenes(0, "val", 1000),
            "zeroshot": sample_scenes(0, "zeroshot", 1000)}


def pairs(scene: Scene) -> set[tuple[str, str]]:
    return {(o.colour, o.shape) for o in scene.objects}


def test_held_out_pairs_never_seen_and_zero_shot_always_has_one(scenes) -> None:
    for split in ("train", "val"):
        assert all(not (pairs(s) & PAGE_HELD_OUT) for s in scenes[split]), split
    assert all(pairs(s) & PAGE_HELD_OUT for s in scenes["zeroshot"])
    # Fresh evaluation captions follow the same rule.
    for caption in sample_captions(3, "train", 300):
        assert not {(o.colour, o.shape) for o in parse_caption(caption).objects} & PAGE_HELD_OUT
    for caption in sample_captions(3, "zeroshot", 300):
        assert {(o.colour, o.shape) for o in parse_caption(caption).objects} & PAGE_HELD_OUT


def test_distribution_covers_the_world(scenes) -> None:
    train = scenes["train"]
    two = np.mean([len(s.objects) == 2 for s in train])
    stated = np.mean([o.size_stated for s in train for o in s.objects])
    assert 0.45 < two < 0.55 and 0.45 < stated < 0.55
    seen = {p for s in train for p in pairs(s)}
    assert len(seen) == 18 - 3  # every non-held-out pair occurs
    assert {s.relation for s in train} == set(RELATIONS) | {None}
    assert {o.size for s in train for o in s.objects} == {"small", "large"}


@functools.cache
def reference_mask(shape: str, side: int) -> np.ndarray:
    """Pixel (x, y) is in the shape when its centre is; triangle by the sign of three edge functions."""
    mask = np.zeros((side, side), dtype=bool)
    apex, left, right = (side / 2, 0.0), (0.0, float(side)), (float(side), float(side))

    def edge(a, b, p) -> float:
        return (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])

    for y in range(side):
        for x in range(side):
            p = (x + 0.5, y + 0.5)
            if shape == "square":
                mask[y, x] = True
            elif shape == "circle":
                mask[y, x] = np.hypot(p[0] - side / 2, p[1] - side / 2) <= side / 2
            else:
                e = (edge(apex, left, p), edge(left, right, p), edge(right, apex, p))
                mask[y, x] = all(v <= 0 for v in e) or all(v >= 0 for v in e)
    return mask


@pytest.mark.parametrize("shape", ["square", "circle", "triangle"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_shape_pixels_follow_the_definition(shape: str, size: str) -> None:
    side = SIZES[size]
    box = (5, 7, 5 + side, 7 + side)
    image = render(Scene((ObjectSpec("purple", shape, size, box, True),), None, "x"), 64)
    drawn = (image[7 : 7 + side, 5 : 5 + side] == PAGE_COLOURS["purple"]).all(-1)
    np.testing.assert_array_equal(drawn, reference_mask(shape, side))
    assert image.sum() == drawn.sum() * sum(PAGE_COLOURS["purple"])  # nothing outside the box
    fill = drawn.mean()
    assert {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5}[shape] == pytest.approx(fill, abs=0.06)


def expected_captions(record: dict) -> set[str]:
    """Every caption the page's grammar allows for this JSON record (one per template)."""
    def phrase(o: dict) -> str:
        return "a " + (o["size"] + " " if o["size_stated"] else "") + f"{o['colour']} {o['shape']}"

    objs = record["objects"]
    body = phrase(objs[0]) if len(objs) == 1 else f"{phrase(objs[0])} {record['relation']} {phrase(objs[1])}"
    return {body, f"a picture of {body}", f"an image of {body}", f"{body} on a black background"}


def test_rendering_and_caption_rules(scenes) -> None:
    palette = {(r << 16) | (g << 8) | b for r, g, b in PAGE_COLOURS.values()} | {0}
    for scene in scenes["train"][:400] + scenes["zeroshot"][:200]:
        record = json.loads(json.dumps(scene.to_json()))
        image = render(scene)
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        packed = (image[..., 0].astype(np.int32) << 16) | (image[..., 1].astype(np.int32) << 8) | image[..., 2]
        assert set(np.unique(packed).tolist()) <= palette
        assert scene.caption in expected_captions(record)
        assert scene.caption.isascii() and scene.caption == scene.caption.lower()
        boxes = [o["box"] for o in record["objects"]]
        for o, (x0, y0, x1, y1) in zip(record["objects"], boxes):
            side = SIZES[o["size"]]
            assert x1 - x0 == side and y1 - y0 == side
            assert x0 >= 2 and y0 >= 2 and x1 <= 62 and y1 <= 62  # >= 2 px margin
            inside = image[y0:y1, x0:x1]
            np.testing.assert_array_equal((inside == PAGE_COLOURS[o["colour"]]).all(-1), reference_mask(o["shape"], side))
        if len(boxes) == 2:
            (a, b), relation = boxes, record["relation"]
            # Boxes grown by 4 px on every side do not overlap <=> at least 4 empty rows or columns between them.
            grown = (a[0] - 4, a[1] - 4, a[2] + 4, a[3] + 4)
            assert grown[2] <= b[0] or b[2] <= grown[0] or grown[3] <= b[1] or b[3] <= grown[1]
            assert ndimage.label(image.any(-1), structure=np.ones((3, 3)))[1] == 2  # the objects do not touch
            dx = (a[0] + a[2]) / 2 - (b[0] + b[2]) / 2
            dy = (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2
            along, across = {"to the left of": (-dx, dy), "to the right of": (dx, dy),
                             "above": (-dy, dx), "below": (dy, dx)}[relation]
            assert along >= 16 and abs(across) <= along / 2
        else:
            assert record["relation"] is None


def test_parse_caption_round_trip_and_errors(scenes) -> None:
    for scene in scenes["train"][:300]:
        spec = parse_caption(scene.caption)
        assert spec.relation == scene.relation
        assert [(o.colour, o.shape, o.size) for o in spec.objects] == [
            (o.colour, o.shape, o.size if o.size_stated else None) for o in scene.objects
        ]
    spec = parse_caption("  An image of a LARGE white circle   below a red square. ")
    assert spec.template == "an image of {}" and spec.relation == "below"
    assert [(o.colour, o.shape, o.size) for o in spec.objects] == [("white", "circle", "large"), ("red", "square", None)]
    for bad in ["a red hexagon", "two red squares", "a picture of a red square on a black background",
                "a red square next to a blue circle", "a huge red square", "red square", ""]:
        with pytest.raises(ValueError, match="not in the shapes-world grammar") as err:
            parse_caption(bad)
        assert repr(bad) in str(err.value)


def test_sampling_is_deterministic_and_validates_input() -> None:
    a = [s.caption for s in sample_scenes(7, "val", 50)]
    assert a == [s.caption for s in sample_scenes(7, "val", 50)]
    assert a != [s.caption for s in sample_scenes(8, "val", 50)]
    assert sample_captions(7, "val", 50) == sample_captions(7, "val", 50)
    assert sample_captions(7, "val", 50) != a  # evaluation prompts are a fresh stream
    with pytest.raises(ValueError, match="'test'"):
        sample_scene(np.random.default_rng(0), "test")
    with pytest.raises(ValueError, match="image_size 32"):
        sample_scene(np.random.default_rng(0), "train", image_size=32)
    with pytest.raises(ValueError, match="n=-1"):
        sample_captions(0, "train", -1)


def digest(folder: Path) -> dict[str, str]:
    """The shards' digests (the folders' markers, which record the sample counts, aside)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.tar"))}


def test_write_world_is_deterministic_and_splits_are_independent(tmp_path: Path) -> None:
    first = write_world(tmp_path / "a", 25, 10, 7, seed=3, shard_size=10)
    write_world(tmp_path / "b", 25, 10, 7, seed=3, shard_size=10)
    write_world(tmp_path / "c", 12, 10, 7, seed=3, shard_size=10)
    write_world(tmp_path / "d", 25, 10, 7, seed=4, shard_size=10)
    a, b, c, d = (digest(tmp_path / x) for x in "abcd")
    assert a == b
    assert sorted(a) == [f"train/00000{i}.tar" for i in range(3)] + ["val/000000.tar", "zeroshot/000000.tar"]
    assert first["train"] == str(tmp_path / "a" / "train" / "{000000..000002}.tar")
    assert {k: v for k, v in c.items() if not k.startswith("train")} == {
        k: v for k, v in a.items() if not k.startswith("train")}  # fewer train samples: val, zero-shot unchanged
    assert c["train/000000.tar"] == a["train/000000.tar"]  # and a shorter train split is a prefix
    assert all(a[k] != d[k] for k in a)
    with tarfile.open(tmp_path / "a" / "val" / "000000.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:3]] == ["000000.json", "000000.png", "000000.txt"]
    assert {m.mtime for m in members} == {0}
    assert all(not m.pax_headers for m in members)  # one header per member: a float mtime would add a PAX one


def test_shards_read_back_with_webdataset(tmp_path: Path) -> None:
    patterns = write_world(tmp_path, 23, 5, 6, seed=1, shard_size=10)
    assert set(patterns) == {"train", "val", "zeroshot"}
    expected = sample_scenes(1, "train", 23)
    samples = list(wds.WebDataset(patterns["train"], shardshuffle=False).decode("rgb8"))
    assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(23)]
    for sample, scene in zip(samples, expected):
        np.testing.assert_array_equal(sample["png"], render(scene))
        assert sample["txt"] == scene.caption
        assert sample["json"] == scene.to_json()
    zeroshot = list(wds.WebDataset(patterns["zeroshot"], shardshuffle=False).decode("rgb8"))
    assert len(zeroshot) == 6 and all(pairs_of(s["json"]) & PAGE_HELD_OUT for s in zeroshot)
    raw = next(iter(wds.WebDataset(patterns["val"], shardshuffle=False)))
    assert Image.open(io.BytesIO(raw["png"])).format == "PNG"


def pairs_of(record: dict) -> set[tuple[str, str]]:
    return {(o["colour"], o["shape"]) for o in record["objects"]}


def test_failed_shard_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_render = shards_module.render

    def failing_render(scene, image_size=64):
        calls["n"] += 1
        if calls["n"] == 15:
            raise RuntimeError("disk on fire")
        return real_render(scene, image_size)

    monkeypatch.setattr(shards_module, "render", failing_render)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_world(tmp_path, 30, 0, 0, shard_size=10)
    assert sorted(p.name for p in (tmp_path / "train").glob("*.tar")) == ["000000.tar"]


def test_write_world_rejects_bad_counts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_val=-1"):
        write_world(tmp_path, 1, -1, 0)
    with pytest.raises(ValueError, match="shard_size=0"):
        write_world(tmp_path, 1, 1, 1, shard_size=0)
    assert write_world(tmp_path, 2, 0, 0).keys() == {"train"}
