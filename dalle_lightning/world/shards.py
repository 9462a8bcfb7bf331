"""Write the shapes world as WebDataset shards in the img2dataset layout.

Each split goes to ``out_dir/<split>/NNNNNN.tar``; sample ``i`` of a split has the key ``f"{i:06d}"`` and the
members ``<key>.png`` (the render), ``<key>.txt`` (the caption) and ``<key>.json`` (``Scene.to_json``).

Reruns with the same seed give byte-identical shards: the scenes come from a seeded per-split stream, PNGs carry
no metadata, and tar members get a fixed mtime, owner and mode. Each shard is written under a temporary name and
renamed when complete, so a crash never leaves a truncated ``.tar`` that a later run would read as data.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

from PIL import Image
from webdataset import TarWriter

from dalle_lightning.outputs import claim, remove_stale_shards, write_marker
from dalle_lightning.world.render import render
from dalle_lightning_plugins.io.atomic_files import atomic_path
from dalle_lightning.world.scene import SPLITS, Scene, split_rng, sample_scene

# Fixed tar member time, for reproducible bytes. An int: a float mtime makes tarfile add a PAX header to every
# member, which doubles the headers a reader parses (see docs/results.md for what that costs).
_MTIME = 0


def encode_png(image) -> bytes:
    """PNG bytes of an H x W x 3 uint8 array, without timestamps or other metadata."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def sample_record(key: str, scene: Scene, image_size: int) -> dict:
    """One WebDataset sample: the members of ``<key>.png``, ``<key>.txt`` and ``<key>.json``, as bytes."""
    return {
        "__key__": key,
        "png": encode_png(render(scene, image_size)),
        "txt": scene.caption.encode("utf-8"),
        "json": json.dumps(scene.to_json(), sort_keys=True).encode("utf-8"),
    }


def _write_shard(path: Path, records: Iterable[dict]) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as stream, TarWriter(stream, encoder=False, mtime=_MTIME) as sink:
            for record in records:
                sink.write(record)


def write_split(out_dir: str | os.PathLike, split: str, n: int, seed: int, shard_size: int, image_size: int) -> str:
    """Write ``n`` samples of ``split`` and return their brace pattern (``.../{000000..000003}.tar``).

    The split's folder must be new or hold image shards of an earlier run; the earlier run's shards beyond this
    run's count are removed, so a smaller rerun never leaves stale samples for training to read.
    """
    folder = Path(out_dir) / split
    if not claim(folder, "images") and n == 0:
        return ""  # nothing to write and nothing of an earlier run to clear
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, "images", split=split, samples=n, seed=seed, image_size=image_size)
    rng = split_rng(seed, split, stream=0)
    n_shards = math.ceil(n / shard_size)
    for shard in range(n_shards):
        start, stop = shard * shard_size, min(n, (shard + 1) * shard_size)
        records = (sample_record(f"{i:06d}", sample_scene(rng, split, image_size), image_size) for i in range(start, stop))
        _write_shard(folder / f"{shard:06d}.tar", records)
    remove_stale_shards(folder, keep=n_shards)
    return str(folder / f"{{{0:06d}..{n_shards - 1:06d}}}.tar")


def write_world(
    out_dir: str | os.PathLike,
    n_train: int,
    n_val: int,
    n_zeroshot: int,
    seed: int = 0,
    shard_size: int = 1000,
    image_size: int = 64,
) -> dict[str, str]:
    """Write the train, val and zero-shot splits; return ``{split: brace pattern}`` for the non-empty ones.

    The splits draw from independent seed streams, so changing ``n_train`` leaves val and zero-shot unchanged.
    """
    counts = dict(zip(SPLITS, (n_train, n_val, n_zeroshot)))
    for split, n in counts.items():
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n_{split}={n!r}; expected a non-negative integer")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size={shard_size!r}; expected a positive integer")
    for split in counts:  # refuse before writing anything, not after the first split
        claim(Path(out_dir) / split, "images")
    # An empty split is written too: it clears the shards an earlier run with samples in that split left.
    patterns = {split: write_split(out_dir, split, n, seed, shard_size, image_size) for split, n in counts.items()}
    return {split: pattern for split, pattern in patterns.items() if counts[split] > 0}
