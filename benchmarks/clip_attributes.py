"""Which details the contrastive reranker sees, as JSON: for one caption, does it score the caption's own image
above the same image with one object's shape (or colour) changed?

The reranker picks among candidates drawn for one caption, which differ in such details; its pick can only fix a
detail it tells apart. For each of ``n`` fresh scenes per split, one object (drawn at random) gets another shape
or colour, everything else (boxes, the other object) unchanged, and the pair is scored with the true caption; the
share of pairs where the true image wins is reported on the clean renders and, given a dVAE, on both images'
reconstructions (what the generator's images look like), overall and by the edited object's size and the
caption's object count. 50% is chance.

``swap`` tests binding rather than a detail: in each two-object scene whose objects differ in shape, the two
objects trade shapes (boxes and colours unchanged), so every word of the caption is still drawn, on the wrong
object. On zero-shot captions the swap turns the held-out colour-shape pair into two training pairs.

Usage: ``python benchmarks/clip_attributes.py [--work outputs/demo] [--clip PATH] [--dvae PATH | --no-dvae]
[--seed 7] [--n 200]`` (by default the demo's ``clip.pt`` and ``dvae.pt``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from dalle_lightning.artifacts import load_model
from dalle_lightning.evaluation.evaluate import eval_scenes, images_of
from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.world.scene import COLOURS, SHAPES, Scene

EDITS = {"shape": SHAPES, "colour": tuple(COLOURS)}


def edited(scenes: list[Scene], attribute: str, rng: np.random.Generator) -> tuple[list[Scene], np.ndarray]:
    """Each scene with one random object's ``attribute`` changed to another value, and whether that object is small."""
    out, small = [], []
    for scene in scenes:
        i = int(rng.integers(len(scene.objects)))
        obj = scene.objects[i]
        value = str(rng.choice([v for v in EDITS[attribute] if v != getattr(obj, attribute)]))
        objects = list(scene.objects)
        objects[i] = dataclasses.replace(obj, **{attribute: value})
        out.append(dataclasses.replace(scene, objects=tuple(objects)))
        small.append(obj.size == "small")
    return out, np.array(small)


def swapped(scenes: list[Scene]) -> tuple[list[Scene], np.ndarray]:
    """Each two-object scene with the objects' shapes traded, and which scenes that changes (objects of two shapes)."""
    out, changed = [], []
    for scene in scenes:
        objs = scene.objects
        if len(objs) == 2 and objs[0].shape != objs[1].shape:
            objs = (dataclasses.replace(objs[0], shape=objs[1].shape), dataclasses.replace(objs[1], shape=objs[0].shape))
            changed.append(True)
        else:
            changed.append(False)
        out.append(dataclasses.replace(scene, objects=tuple(objs)))
    return out, np.array(changed)


def shares(wins: np.ndarray, small: np.ndarray, two: np.ndarray) -> dict[str, float]:
    return {"all": round(float(wins.mean()), 3), "small_object": round(float(wins[small].mean()), 3),
            "large_object": round(float(wins[~small].mean()), 3), "one_object": round(float(wins[~two].mean()), 3),
            "two_objects": round(float(wins[two].mean()), 3)}


def report(clip_path: str, dvae_path: str | None, seed: int, n: int) -> dict:
    torch.manual_seed(seed)
    clip = Reranker.from_saved(clip_path)
    dvae = load_model(dvae_path).eval() if dvae_path else None
    rng = np.random.default_rng(seed)
    out: dict = {"clip": clip_path, "dvae": dvae_path, "seed": seed, "n_per_split": n}
    for split in ("val", "zeroshot"):
        scenes = eval_scenes(seed, split, n)
        captions = [s.caption for s in scenes]
        two = np.array([len(s.objects) == 2 for s in scenes])
        views = {"renders": lambda images: images}  # how the images are shown to CLIP
        if dvae is not None:
            views["reconstructions"] = lambda images: dvae.reconstruct(images).float().clamp(0, 1)
        true_images = images_of(scenes)
        with torch.no_grad():  # the true images' scores, once per split and view (every edit is scored against them)
            true_scores = {kind: clip.score(view(true_images), captions) for kind, view in views.items()}

        @torch.no_grad()
        def wins(others: list[Scene], keep: np.ndarray) -> dict[str, np.ndarray]:
            """Per view, whether each kept scene's true image outscores its edited one under the true caption."""
            images, kept = images_of([s for s, k in zip(others, keep) if k]), [c for c, k in zip(captions, keep) if k]
            return {kind: (true_scores[kind][keep] > clip.score(view(images), kept)).numpy()
                    for kind, view in views.items()}

        every = np.ones(len(scenes), dtype=bool)
        for attribute in EDITS:
            others, small = edited(scenes, attribute, rng)
            for kind, won in wins(others, every).items():
                out[f"{split}/{attribute}/{kind}"] = shares(won, small, two)
        others, changed = swapped(scenes)  # only the changed scenes are scored
        for kind, won in wins(others, changed).items():
            out[f"{split}/swap/{kind}"] = {"two_objects": round(float(won.mean()), 3), "scenes": int(changed.sum())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="outputs/demo", help="folder with clip.pt and dvae.pt (the demo's)")
    parser.add_argument("--clip", default=None, help="a CLIP written by `dalle-train stage=clip` (default: WORK/clip.pt)")
    parser.add_argument("--dvae", default=None, help="a dVAE whose reconstructions are scored too (default: WORK/dvae.pt)")
    parser.add_argument("--no-dvae", action="store_true", help="clean renders only")
    parser.add_argument("--seed", type=int, default=7, help="scene and edit seed (not the demo's eval seed)")
    parser.add_argument("--n", type=int, default=200, help="scenes per split")
    args = parser.parse_args()
    clip = args.clip or str(Path(args.work) / "clip.pt")
    dvae = None if args.no_dvae else args.dvae or str(Path(args.work) / "dvae.pt")
    print(json.dumps(report(clip, dvae, args.seed, args.n)))


if __name__ == "__main__":
    main()
