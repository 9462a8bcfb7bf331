"""The WebDataset data modules: decoding, rank/worker splitting, augmentation, and skipping bad samples."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from dalle_lightning.data.datamodule import ImageTextDataModule, ShardStream, TokenDataModule
from dalle_lightning.data.shards import resolve_shards
from dalle_lightning.data.transforms import paper_augment


def _png(seed: int, size: int = 32, fmt: str = "PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _write(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for s in samples:
            sink.write(s)


def _good(i: int, fmt: str = "png") -> dict:
    return {"__key__": f"{i:06d}", fmt: _png(i, fmt="JPEG" if fmt == "jpg" else "PNG"), "txt": f"caption {i}".encode()}


@pytest.fixture
def shards(tmp_path: Path) -> str:
    for s in range(4):
        _write(tmp_path / f"{s:06d}.tar", [_good(s * 10 + i, "png" if s % 2 else "jpg") for i in range(10)])
    return str(tmp_path / "{000000..000003}.tar")


def _all(dm: ImageTextDataModule, rank: int = 0, world: int = 1, workers: int = 0) -> list[str]:
    ds = ShardStream(resolve_shards(dm.train_shards), dm.decode, rank, world, 0, 0)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers)
    texts: list[str] = []
    for batch in loader:
        assert batch["image"].shape[1:] == (3, 16, 16)
        assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0
        texts.extend(batch["text"])
    return texts


def test_reads_png_and_jpg_with_brace_patterns_and_lists(shards: str, tmp_path: Path) -> None:
    dm = ImageTextDataModule(train_shards=shards, image_size=16)
    assert sorted(_all(dm)) == sorted(f"caption {i}" for i in range(40))
    listed = ImageTextDataModule(train_shards=[str(tmp_path / "000000.tar"), str(tmp_path / "000001.tar")], image_size=16)
    assert len(_all(listed)) == 20


def test_ranks_and_workers_see_disjoint_samples(shards: str) -> None:
    dm = ImageTextDataModule(train_shards=shards, image_size=16)
    per_rank = [set(_all(dm, rank=r, world=2, workers=2)) for r in range(2)]
    assert per_rank[0].isdisjoint(per_rank[1])
    assert len(per_rank[0]) + len(per_rank[1]) == 40


def test_bad_samples_are_skipped_and_counted(tmp_path: Path) -> None:
    bad = [
        _good(0),
        {"__key__": "000001", "png": b"\x89PNG not really", "txt": b"corrupt"},
        {"__key__": "000002", "png": _png(2)},
        {"__key__": "000003", "png": _png(3), "txt": b"   "},
        {"__key__": "000004", "png": _png(4), "txt": b"\xff\xfe\xfa"},
        {"__key__": "000005", "txt": b"no image"},
        _good(6),
    ]
    _write(tmp_path / "bad.tar", bad)
    dm = ImageTextDataModule(train_shards=str(tmp_path / "bad.tar"), image_size=16)
    assert sorted(_all(dm)) == ["caption 0", "caption 6"]
    assert sum(dm.skipped.values()) == 5
    assert dm.skipped["empty caption"] == 1 and dm.skipped["caption is not UTF-8"] == 1
    assert dm.skipped["missing caption"] == 1 and dm.skipped["missing image"] == 1


def test_missing_shard_is_a_one_line_error(tmp_path: Path) -> None:
    _write(tmp_path / "000008.tar", [_good(0)])
    with pytest.raises(FileNotFoundError, match=r"000009\.tar' does not exist"):
        resolve_shards(str(tmp_path / "{000008..000009}.tar"))


def test_shuffling_changes_order_but_not_content(shards: str) -> None:
    dm = ImageTextDataModule(train_shards=shards, image_size=16, shuffle_buffer=50, batch_size=4)
    first = [t for b in dm.train_dataloader() for t in b["text"]]
    plain = _all(dm)
    assert sorted(first) == sorted(plain) and first != plain


def test_paper_augmentation_output_size_and_range() -> None:
    import random

    img = Image.open(io.BytesIO(_png(0, size=48)))
    out = paper_augment(img.crop((0, 0, 48, 40)), 16, random.Random(0))
    assert out.size == (16, 16)


def test_token_module_pads_text_and_skips_bad_arrays(tmp_path: Path) -> None:
    def npy(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    _write(
        tmp_path / "tok.tar",
        [
            {"__key__": "0", "codes.npy": npy(np.arange(16, dtype=np.uint16)), "ids.npy": npy(np.array([5, 6, 7])), "txt": b"a b"},
            {"__key__": "1", "codes.npy": b"garbage", "ids.npy": npy(np.array([5])), "txt": b"x"},
            {"__key__": "2", "codes.npy": npy(np.arange(9, dtype=np.uint16)), "ids.npy": npy(np.array([5])), "txt": b"x"},
        ],
    )
    dm = TokenDataModule(train_shards=str(tmp_path / "tok.tar"), text_len=6, image_tokens=16, batch_size=2, shuffle_buffer=0)
    (batch,) = list(dm.train_dataloader())
    assert batch["text"].tolist() == [[5, 6, 7, 0, 0, 0]]
    assert batch["image"].tolist() == [list(range(16))]
    assert sum(dm.skipped.values()) == 2
