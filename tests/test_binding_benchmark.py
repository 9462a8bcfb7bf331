"""The binding benchmarks sort samples the way their docstrings say (their figures are in docs/results.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from dalle_lightning.evaluation.evaluate import eval_scenes
from dalle_lightning.world import render
from dalle_lightning.world.detect import match
from dalle_lightning.world.parse import parse_caption

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_render_binds_its_shapes_and_the_traded_render_is_a_swap() -> None:
    binding, attributes = load("binding"), load("clip_attributes")
    scenes = eval_scenes(5, "val", 60)
    others, changed = attributes.swapped(scenes)
    assert changed.any() and not changed.all()  # one-object and same-shape scenes stay as they are
    kinds = []
    for scene, other, swap in zip(scenes, others, changed):
        if not swap:
            assert other == scene
            continue
        assert [o.colour for o in other.objects] == [o.colour for o in scene.objects]
        assert [o.shape for o in other.objects] == [o.shape for o in reversed(scene.objects)]
        spec = parse_caption(scene.caption)
        kind_true = binding.binding_kind(match(render(scene), spec), spec)
        kind_swapped = binding.binding_kind(match(render(other), spec), spec)
        if spec.objects[0].colour != spec.objects[1].colour:
            kinds.append((kind_true, kind_swapped))
        else:  # one colour twice: no binding to sort
            assert kind_true is None and kind_swapped is None
    assert kinds and all(k == ("both_right", "swapped") for k in kinds)


def test_captions_by_count_gives_n_of_each_from_the_evaluation_stream() -> None:
    binding = load("binding")
    by_count = binding.captions_by_count(3, "zeroshot", 7)
    assert {k: len(v) for k, v in by_count.items()} == {1: 7, 2: 7}
    stream = [s.caption for s in eval_scenes(3, "zeroshot", 200)]
    for count, captions in by_count.items():
        positions = [stream.index(c) for c in captions]
        assert positions == sorted(positions)
        assert all(len(parse_caption(c).objects) == count for c in captions)
