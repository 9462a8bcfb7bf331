"""Tar shards read at a bounded cost: uncompressed only, and every member's size checked on its header first.

webdataset opens a shard with ``tarfile``'s ``r|*``, which decompresses whatever it is handed, and reads each member
whole before anything looks at it: a 1 MB gzip stream under a ``.tar`` name can hold a 1 GiB member, read into
memory before the image's pixel bound is checked. Here a shard is read as a plain tar: a compressed stream (its
first bytes are gzip's, bzip2's, xz's or zstd's magic number) is refused before a byte of it is decompressed
(:class:`CompressedShard`), and a member larger than its bound (:func:`member_bound`) is passed over without being
read, standing in the sample as a :class:`TooLarge` (``data.skips.read_shards`` skips and counts that sample).
Honest members are read as webdataset reads them, and grouped into samples by webdataset's own ``group_by_keys``.
"""

from __future__ import annotations

import contextlib
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from webdataset.gopen import gopen

from dalle_lightning.data.transforms import MAX_IMAGE_PIXELS

IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")  # the members a sample's image is read from
# Compressed streams a tar reader would inflate, by their first bytes (gzip, bzip2, xz, zstd).
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
MAGIC_BYTES = max(len(magic) for magic, _ in COMPRESSED)
# An image file of more bytes than an uncompressed 8-bit RGBA raster at the pixel bound (4 bytes a pixel, plus 1 MiB
# of headers and metadata) holds more than any image that may be decoded (data.transforms.MAX_IMAGE_PIXELS): about
# 342 MiB, where a LAION jpg is a few MB.
MAX_IMAGE_BYTES = 4 * MAX_IMAGE_PIXELS + 2**20
# A caption: 64 KiB, 64x the ~1 KB of text the paper's 256 caption tokens hold (an alt-text caption is a few hundred
# bytes). Tokenizing costs far more than the bytes (a 16 MiB caption: 26 s and 3 GB, for ids cut to text_len anyway).
MAX_CAPTION_BYTES = 64 * 2**10
CAPTION_KEYS = ("txt",)
# Any other member (img2dataset's json, a token shard's codes.npy and ids.npy): 16 MiB, where a json is a few KB and
# a 1024 x 1024 grid of int64 codes 8 MiB.
MAX_MEMBER_BYTES = 16 * 2**20
SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's own: names that are no sample's member


class CompressedShard(ValueError):
    """A shard whose bytes are a compressed stream: refused before any of it is inflated."""


@dataclass(frozen=True)
class TooLarge:
    """A member passed over unread: its name, the size its header declares and the bound it exceeds."""

    name: str
    size: int
    bound: int

    @property
    def reason(self) -> str:
        """Why its sample is skipped (one of ``data.skips.REASONS``)."""
        return "image too large" if is_image(self.name) else "member too large"

    def describe(self) -> str:
        return f"member {self.name!r} of {self.size} bytes, more than the {self.bound} allowed"


def suffix(name: str) -> str:
    """A member's suffix as webdataset keys the sample with it (after the first dot of its base name)."""
    return name.rsplit("/", 1)[-1].split(".", 1)[-1].lower()


def is_image(name: str) -> bool:
    """Whether member ``name`` is one a sample's image is read from (its suffix is one of :data:`IMAGE_KEYS`)."""
    return suffix(name) in IMAGE_KEYS


def member_bound(name: str) -> int:
    """The most bytes member ``name`` may hold: :data:`MAX_IMAGE_BYTES` for an image, :data:`MAX_CAPTION_BYTES` for
    a caption, :data:`MAX_MEMBER_BYTES` for any other member."""
    if is_image(name):
        return MAX_IMAGE_BYTES
    return MAX_CAPTION_BYTES if suffix(name) in CAPTION_KEYS else MAX_MEMBER_BYTES


def compression(head: bytes) -> str | None:
    """The compression whose magic number ``head`` starts with (``"gzip"``...), or None for a plain stream."""
    return next((name for magic, name in COMPRESSED if head.startswith(magic)), None)


class _Rejoined:
    """A stream whose first bytes were read to look at them, read again from its start."""

    def __init__(self, head: bytes, stream: IO[bytes]) -> None:
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(size)
        if 0 <= size <= len(self.head):
            out, self.head = self.head[:size], self.head[size:]
            return out
        out, self.head = self.head, b""
        return out + self.stream.read(-1 if size < 0 else size - len(out))

    def close(self) -> None:
        self.stream.close()


def open_shard(url: str) -> _Rejoined:
    """The shard ``url`` (a path or any URL webdataset opens) as a byte stream, refused with
    :class:`CompressedShard` when its first bytes are a compressed stream's."""
    stream = gopen(url)
    try:
        head = stream.read(MAGIC_BYTES)
        kind = compression(head)
        if kind is not None:
            raise CompressedShard(f"a {kind} stream, never decompressed (a shard must be a plain tar: decompress it "
                                  "and name it .tar)")
    except BaseException:
        with contextlib.suppress(Exception):  # a pipe's exit status: the refusal is what is said
            stream.close()
        raise
    return _Rejoined(head, stream)


def shard_files(url: str, stream: Any, errors: Callable[[Exception], Any],
                bound: Callable[[str], int] = member_bound,
                select: Callable[[str], bool] | None = None) -> Iterator[dict[str, Any]]:
    """The regular members of the plain tar ``stream`` (those ``select`` selects, the others passed over unread) as
    webdataset's ``{"fname", "data", "__url__"}`` records, each checked on its header before it is read: one over its
    ``bound`` comes as a :class:`TooLarge`, unread. The first error ends the shard, handed to ``errors`` (the
    readable members before it still come)."""
    try:
        tar = tarfile.open(fileobj=stream, mode="r|", bufsize=2**16)  # a plain tar: never decompressed
        for info in tar:
            tar.members = []  # a stream's members are not kept: a shard of any length costs one member
            if not info.isreg() or SKIP_META.match(info.name) or (select is not None and not select(info.name)):
                continue
            most = bound(info.name)
            if info.size > most:
                data: Any = TooLarge(info.name, info.size, most)  # the next header is read past it, unread
            else:
                data = tar.extractfile(info).read()
            yield {"fname": info.name, "data": data, "__url__": url}
    except Exception as exc:  # noqa: BLE001 - a shard that cannot be read is counted, never fatal
        errors(exc)
