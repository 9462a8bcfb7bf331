"""Real captioned images for ``dalle-eval``: the first n samples of a split, and whether a split is the shapes world.

Splits are what training reads (``data.splits.resolve_splits`` on the ``data`` config: ``auto`` finds ``val/`` or
holds out a slice of the last training shard, and the training split then skips that slice). Images are read as
validation reads them (``ImageTextDataModule.decode(train=False)``: decoded as a viewer shows them,
centre-cropped, resized to the dVAE's image size, no augmentation), in shard order, so every run evaluates the
same captions. Unreadable samples are skipped and counted as in training.

The shapes world is recognised by what ``dalle-data`` leaves: its marker in the shard directory
(``outputs.read_marker``, kind ``images``), or, for copies without it, a first sample whose ``json`` member is a
shapes scene (``caption``, ``relation``, ``objects``; img2dataset's ``json`` has other keys). Only there does the
shapes detector, hence caption accuracy and the waterfall, mean anything.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch

from dalle_lightning.data.datamodule import ImageTextDataModule, ShardStream
from dalle_lightning.data.shards import is_remote
from dalle_lightning.data.splits import Split
from dalle_lightning.data.tar_members import open_shard, shard_files
from dalle_lightning.outputs import read_marker

SCENE_KEYS = {"caption", "relation", "objects"}  # the shapes world's per-sample json (world.scene.Scene.to_json)
MAX_HINT_BYTES = 64 * 1024  # a json read as a hint: a shapes scene is a few hundred bytes, img2dataset's a few KB


def read_captioned(split: Split, n: int, image_size: int, background: Any = (255, 255, 255)
                   ) -> tuple[torch.Tensor, list[str], dict[str, int]]:
    """Images ``[m, 3, S, S]`` in [0, 1], their captions and the skip counts by reason, of the first ``n`` usable
    samples of ``split`` in shard order (m < n when it holds fewer)."""
    reader = ImageTextDataModule(image_size=image_size, background=background)
    stream = ShardStream(split.urls, lambda s: reader.decode(s, train=False), rank=0, world_size=1, shuffle=0, seed=0,
                         skipped=reader.skipped, keep=split.keep)
    samples = list(itertools.islice(stream, n))
    skipped = {reason: count for reason, count in reader.skip_counts().items() if count}
    if not samples:
        return torch.zeros(0, 3, image_size, image_size), [], skipped
    return torch.stack([s["image"] for s in samples]), [s["text"] for s in samples], skipped


def _first_json(url: str) -> dict | None:
    """The first ``.json`` member among a tar shard's first 8, parsed (None when there is none, it is not a JSON
    object or larger than :data:`MAX_HINT_BYTES`, or the shard is compressed: nothing of it is inflated)."""
    try:
        stream = open_shard(url)
    except (OSError, ValueError):
        return None
    try:
        # Only a json member is read (at most MAX_HINT_BYTES of it); every other one is passed over unread.
        members = shard_files(url, stream, lambda exc: None,
                              bound=lambda name: MAX_HINT_BYTES if name.endswith(".json") else -1)
        for member in itertools.islice(members, 8):
            if member["fname"].endswith(".json"):
                record = json.loads(member["data"]) if isinstance(member["data"], bytes) else None
                return record if isinstance(record, dict) else None
    except (ValueError, RecursionError):
        return None
    finally:
        stream.close()
    return None


def shapes_world(split: Split) -> bool:
    """Whether ``split``'s shards are the shapes world."""
    urls = [u for u in split.urls if not is_remote(u)]
    if not urls:
        return False  # remote shards: not the embedded world, which dalle-data writes locally
    marker = read_marker(Path(urls[0]).parent)
    if marker is not None:
        return marker.get("kind") == "images" and marker.get("writer") == "dalle-data"
    record = _first_json(urls[0])
    return record is not None and SCENE_KEYS <= set(record)
