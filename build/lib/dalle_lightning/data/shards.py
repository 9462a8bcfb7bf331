"""Resolve WebDataset shard specifications and split them among ranks and loader workers.

Shards may be given as a directory (every ``*.tar`` in it), a brace pattern (``data/train/{000000..000009}.tar``), a ``::``-separated string,
or a list of either; remote URLs (``s3://``, ``pipe:``...) pass through untouched. Local shards that do not
exist fail fast with the missing path, before a long run starts reading.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Sequence

import torch.utils.data
from webdataset.shardlists import expand_urls


def is_remote(url: str) -> bool:
    return "://" in url or url.startswith("pipe:")


def resolve_shards(spec: str | Sequence[str]) -> list[str]:
    """Expand ``spec`` to a list of shard URLs; raise ``FileNotFoundError`` naming a missing local shard."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    if not parts:
        raise ValueError("no shards given; expected a path, a brace pattern or a list of them")
    urls: list[str] = []
    for part in parts:
        part = str(part)
        if not is_remote(part) and os.path.isdir(part):
            found = sorted(str(p) for p in Path(part).glob("*.tar"))
            if not found:
                raise FileNotFoundError(f"shard directory {part!r} holds no .tar shards")
            urls.extend(found)
        else:
            urls.extend(expand_urls(part))
    for url in urls:
        if not is_remote(url) and not os.path.isfile(url):
            raise FileNotFoundError(f"shard {url!r} does not exist (from {spec!r})")
    return urls


def split_for(urls: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The shards this rank and this loader worker read: disjoint, so no two consumers see the same sample.

    Splitting by shard (not by sample) keeps reads sequential. With fewer shards than consumers some read
    nothing, so write at least ``world_size * num_workers`` shards.
    """
    consumer, consumers = consumer_index(rank, world_size)
    return list(urls[consumer::consumers])


def consumer_index(rank: int, world_size: int) -> tuple[int, int]:
    """``(index, count)`` of this reader among every loader worker of every rank."""
    info = torch.utils.data.get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world_size * workers
