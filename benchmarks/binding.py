"""Does each shape land on its own colour? Per-sample checks by object count, and the shape binding of
two-object samples, as JSON.

Two-object captions are where the pipeline loses most (docs/results.md, "Two-object captions: the shapes trade
places"). For each split this draws ``samples`` images for each of ``n`` one-object and ``n`` two-object fresh
captions and reports the share of samples passing each check of ``caption_accuracy`` (``accuracy``: all of them). For two-object captions whose
objects differ in both colour and shape, every sample showing exactly those two colours is sorted by its shapes:

* ``both_right``: each colour carries its own shape (the caption's binding);
* ``swapped``: each colour carries the *other* object's shape (every attribute drawn, bound wrongly);
* ``one_wrong`` / ``both_wrong``: one or both shapes are neither.

On zero-shot captions a swap turns the held-out colour-shape pair into two training pairs, so ``swapped`` against
``both_right`` measures how far the prior falls back to pairs it has seen. The reranker's own binding (does it
score a render above the same render with the shapes traded?) is ``benchmarks/clip_attributes.py``'s ``swap``.

Usage: ``python benchmarks/binding.py [--work outputs/demo] [--prior PATH] [--n 100] [--samples 4] [--seed 77]
[--cond-scale 2.5] [--threads N]`` (by default the demo's artifacts; no contrastive model is needed).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from dalle_lightning.evaluation.evaluate import eval_scenes
from dalle_lightning.generation.generate import Generator
from dalle_lightning.world.detect import MatchResult, match, summarize_matches
from dalle_lightning.world.parse import CaptionSpec, parse_caption
from dalle_lightning.world.scene import Scene

KINDS = ("both_right", "swapped", "one_wrong", "both_wrong")


def binding_kind(result: MatchResult, spec: CaptionSpec) -> str | None:
    """How a sample binds the two shapes of ``spec`` to its two colours (module docstring), or None when the
    caption's objects share a colour or a shape, or the sample does not show exactly the caption's two colours."""
    a, b = spec.objects if len(spec.objects) == 2 else (None, None)
    if a is None or a.colour == b.colour or a.shape == b.shape or len(result.detected) != 2:
        return None
    shapes = {d.colour: d.shape for d in result.detected}
    if set(shapes) != {a.colour, b.colour}:
        return None
    right = [shapes[a.colour] == a.shape, shapes[b.colour] == b.shape]
    if all(right):
        return "both_right"
    if shapes[a.colour] == b.shape and shapes[b.colour] == a.shape:
        return "swapped"
    return "one_wrong" if any(right) else "both_wrong"


def captions_by_count(seed: int, split: str, n: int) -> dict[int, list[str]]:
    """The first ``n`` fresh one-object and two-object captions of ``split`` (stream of ``eval_scenes``)."""
    by_count: dict[int, list[str]] = {1: [], 2: []}
    drawn = 0
    while min(len(c) for c in by_count.values()) < n:
        scenes: list[Scene] = eval_scenes(seed, split, drawn + 8 * n)[drawn:]
        drawn += len(scenes)
        for scene in scenes:
            captions = by_count[len(scene.objects)]
            if len(captions) < n:
                captions.append(scene.caption)
    return by_count


def split_report(gen: Generator, split: str, n: int, samples: int, seed: int, cond_scale: float) -> dict:
    """Per object count: each check's pass rate over every sample; for two objects, the binding counts too."""
    report: dict = {}
    for count, captions in captions_by_count(seed, split, n).items():
        result = gen.generate(captions, num_candidates=samples, seed=seed, cond_scale=cond_scale)
        judged = [[match(image, c) for image in images] for images, c in zip(result.candidates, captions)]
        flat = [r for row in judged for r in row]
        entry: dict = {k: round(v, 3) for k, v in summarize_matches(flat).items() if k != "n"}
        if count == 2:
            specs = [parse_caption(c) for c in captions]
            kinds = Counter(binding_kind(r, spec) for row, spec in zip(judged, specs) for r in row)
            sorted_samples = sum(kinds[k] for k in KINDS)
            entry["binding"] = {k: kinds[k] for k in KINDS} | {"samples_sorted": sorted_samples}
        report[f"{count}_object"] = entry | {"captions": len(captions), "samples": len(flat)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("outputs/demo"), help="the pipeline's work dir")
    parser.add_argument("--prior", type=Path, default=None, help="prior file (default: <work>/prior.pt)")
    parser.add_argument("--n", type=int, default=100, help="captions per object count and split")
    parser.add_argument("--samples", type=int, default=4, help="images per caption")
    parser.add_argument("--seed", type=int, default=77, help="caption and sampling seed")
    parser.add_argument("--cond-scale", type=float, default=2.5, help="super-conditioning scale (the demo's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.n < 1 or args.samples < 1:
        raise SystemExit(f"error: --n={args.n} --samples={args.samples}; expected both >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    prior = args.prior or args.work / "prior.pt"
    gen = Generator.from_files(prior, args.work / "dvae.pt", args.work / "tokenizer.json")
    out = {"prior": str(prior), "n": args.n, "samples": args.samples,
           "seed": args.seed, "cond_scale": args.cond_scale}
    for split, name in (("val", "seen"), ("zeroshot", "zeroshot")):
        out[name] = split_report(gen, split, args.n, args.samples, args.seed, args.cond_scale)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
