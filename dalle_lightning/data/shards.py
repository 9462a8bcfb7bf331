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


def expected(key: str) -> str:
    """What a shard specification may be, with the brace form written for ``key``."""
    name = key if "." in key else "data.train_shards"
    return ("expected a directory of .tar shards, a shard, a list of them, or a brace pattern "
            f"(\"{name}='/data/{{00000..00099}}.tar'\": Hydra needs the inner quotes)")


def resolve_shards(spec: str | Sequence[str], key: str = "shards") -> list[str]:
    """Expand ``spec`` to a list of shard URLs; raise a one-line ``FileNotFoundError`` naming ``key`` (the config
    key that gave ``spec``) and the missing local path."""
    if spec is None or (not isinstance(spec, str) and not isinstance(spec, Sequence)):
        raise ValueError(f"{key}={spec!r}; {expected(key)}")
    parts = [spec] if isinstance(spec, str) else [str(p) for p in spec]
    if not parts:
        raise ValueError(f"{key}={spec!r} names no shards; {expected(key)}")
    shown = spec if isinstance(spec, str) else parts
    urls: list[str] = []
    for part in parts:
        part = str(part)
        if not is_remote(part) and os.path.isdir(part):
            found = sorted(str(p) for p in Path(part).glob("*.tar"))
            if not found:
                raise FileNotFoundError(f"{key}={shown!r}: the directory {part!r} holds no .tar shards; {expected(key)}")
            urls.extend(found)
        else:
            urls.extend(expand_urls(part))
    for url in urls:
        if not is_remote(url) and not os.path.isfile(url):
            what = "shard" if url.endswith(".tar") else "path"
            raise FileNotFoundError(f"{key}={shown!r}: {what} {url!r} does not exist; {expected(key)}")
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
