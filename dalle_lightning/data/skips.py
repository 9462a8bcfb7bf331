"""Counting what the loaders skip: unreadable shards and unusable samples, summed over loader workers.

A skipped sample or shard never stops training, but it must not go unseen: each one is logged with its key and
counted by reason. Loader workers are separate processes, so a plain counter in a worker dies with it; the
counts live in a shared-memory tensor, one row per process (the main one, then each worker), which the main
process sums. ``dalle_lightning_callbacks.skipped_samples`` then sums them over ranks and logs them as metrics.

Each sample (or shard) is counted once per reason, the first time it is met: a second epoch, a validation pass
that reads the same samples again, or the readability probe before training do not count it again. Which
(reason, key) pairs were met lives in a shared-memory bitmap (a hash of the pair), so loader workers see each
other's. Under ``rank_split=samples`` every rank has its own bitmap, and a bad sample met by two ranks in two
epochs counts once on each.

Shard-level failures are counted once per shard: an empty file, a file that is not a tar, and a truncated tar
(which Python's stream reader ends silently at a cut header, so the file's end is checked too); a compressed stream,
which is never decompressed (``data.tar_members``). A member larger than its bound is never read: its sample is
skipped and counted (``image too large`` for an image, ``member too large`` for any other member).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.data
from webdataset.tariterators import group_by_keys

from dalle_lightning.data.tar_members import CompressedShard, TooLarge, open_shard, shard_files

log = logging.getLogger(__name__)

REASONS = (
    "unreadable shard",
    "compressed shard",  # a gzip, bzip2, xz or zstd stream (under any name): never decompressed
    "member too large",  # a caption over data.tar_members.MAX_CAPTION_BYTES, another member over MAX_MEMBER_BYTES
    "missing image",
    "corrupt image",
    "image too large",  # more pixels than data.transforms.MAX_IMAGE_PIXELS (a decompression bomb, never decoded), or
    #                     more bytes than data.tar_members.MAX_IMAGE_BYTES (never read)
    "missing caption",
    "caption is not UTF-8",
    "empty caption",
    "bad token arrays",
    "wrong image token count",
    "image code out of range",
    "caption id out of range",
)
TAR_BLOCK = 512
SEEN_BITS = 1 << 20  # (reason, key) pairs remembered per counter: 1 MiB shared, a false "seen" at 1e-3 per 1,000 pairs


class SharedCounts(Mapping[str, int]):
    """Counts by name (every one of ``names``, 0 when none), summed over loader workers: one shared-memory row per
    process (the main one, then each worker), so a worker's counts outlive it."""

    def __init__(self, names: tuple[str, ...], workers: int = 0) -> None:
        self.names = names
        # One row per process; with more workers than rows, rows are shared and a simultaneous increment may be lost.
        self._counts = torch.zeros(workers + 1, len(names), dtype=torch.int64).share_memory_()
        self._seen = torch.zeros(SEEN_BITS, dtype=torch.bool).share_memory_()

    def add(self, name: str, key: str | None = None) -> bool:
        """Count one ``name`` in this process's (or loader worker's) row; with ``key`` (the sample), only the first
        time that sample is met for that name. Returns whether it was counted."""
        if key is not None:
            slot = zlib.crc32(f"{name}|{key}".encode()) % SEEN_BITS
            if bool(self._seen[slot]):
                return False
            self._seen[slot] = True
        info = torch.utils.data.get_worker_info()
        row = (info.id + 1 if info is not None else 0) % self._counts.shape[0]
        self._counts[row, self.names.index(name)] += 1
        return True

    def __getitem__(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(name)
        return int(self._counts[:, self.names.index(name)].sum())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def summary(self) -> str:
        """The non-zero counts, for messages: ``"unreadable shard: 4, corrupt image: 1"`` (or ``"none"``)."""
        return ", ".join(f"{name}: {n}" for name, n in self.items() if n) or "none"


class SkipCounter(SharedCounts):
    """Skipped samples by reason (every reason of ``REASONS``, 0 when none), summed over loader workers."""

    def __init__(self, workers: int = 0, quiet: bool = False) -> None:
        super().__init__(REASONS, workers)
        self.quiet = quiet  # count without a log line (a probe of a few samples, which training meets again)

    def skip(self, reason: str, key: str, detail: str = "") -> None:
        """Count one skipped sample (or shard) and log it with its key, so the bad data can be found: once per
        sample, the first time it is met."""
        if not self.add(reason, key) or self.quiet:
            return
        log.warning("skipped %s: %s%s (%d skipped for this reason so far)", key, reason,
                    f" ({detail})" if detail else "", self[reason])


def truncated(url: str) -> bool:
    """A local non-empty tar that does not end with the archive's zero blocks (cut short by a crash or copy)."""
    if "://" in url or url.startswith("pipe:") or not os.path.isfile(url):
        return False
    size = os.path.getsize(url)
    if size == 0:
        return False  # the reader itself fails on an empty file
    if size % TAR_BLOCK:
        return True
    with open(url, "rb") as f:
        f.seek(size - 2 * TAR_BLOCK)
        return any(f.read(2 * TAR_BLOCK))


def read_shards(urls: list[str], skipped: SkipCounter | None,
                keep: Callable[[dict[str, Any]], bool] | None = None) -> Iterator[dict[str, Any]]:
    """The raw samples of ``urls`` (those ``keep`` keeps), shard after shard, read as plain tars at a bounded cost
    (``data.tar_members``). A shard that fails is counted once as unreadable (its readable samples, if any, still
    come through), a compressed one as compressed (none of it read); a sample with a member over its bound is
    skipped and counted, its member unread."""
    for url in urls:
        errors: list[Exception] = []
        try:
            stream = open_shard(url)
        except CompressedShard as exc:
            _shard_failed(skipped, "compressed shard", url, str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - a shard that cannot be opened is counted, never fatal
            stream, errors = None, [exc]
        if stream is not None:
            try:
                files = shard_files(url, stream, errors.append)
                for sample in group_by_keys(files, handler=lambda exn: errors.append(exn) or True):
                    if keep is not None and not keep(sample):
                        continue
                    large = next((v for v in sample.values() if isinstance(v, TooLarge)), None)
                    if large is None:
                        yield sample
                    elif skipped is not None:
                        skipped.skip(large.reason, f"{url}:{sample.get('__key__', '?')}", large.describe())
            finally:
                try:
                    stream.close()
                except Exception as exc:  # noqa: BLE001 - a pipe: whose command failed; its shard is counted
                    errors.append(exc)
        if errors:
            _shard_failed(skipped, "unreadable shard", url,
                          f"{type(errors[0]).__name__}: {errors[0].args[0] if errors[0].args else ''}")
        elif skipped is not None and truncated(url):
            skipped.skip("unreadable shard", url, "truncated tar")


def _shard_failed(skipped: SkipCounter | None, reason: str, url: str, detail: str) -> None:
    """Count a shard that gave no (or not all of its) samples, or log it where no counter is kept."""
    if skipped is not None:
        skipped.skip(reason, url, detail)
    else:
        log.warning("%s %s: %s", reason, url, detail)
