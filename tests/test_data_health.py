"""Data that never hangs or aborts: unreadable shards are counted (across loader workers) and logged as metrics,
bad token samples are skipped, and a data set with no usable sample ends with one line within seconds."""

from __future__ import annotations

import csv
import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from dalle_lightning.data.datamodule import ImageTextDataModule, TokenDataModule
from dalle_lightning.world import write_world
from tests.conftest import run_app
from tests.test_pipeline import TINY_DVAE

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on shared cores

QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


def _bad_shards(folder: Path, good: Path, keep: float = 0.5) -> None:
    """An empty file, a text file, and a copy of ``good`` cut after ``keep`` of its bytes, in ``folder``."""
    (folder / "000100.tar").write_bytes(b"")
    (folder / "000101.tar").write_text("not a tar at all\n")
    data = good.read_bytes()
    (folder / "000102.tar").write_bytes(data[: int(len(data) * keep) + 100])


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_unreadable_shards_are_counted_across_loader_workers(tmp_path: Path) -> None:
    write_world(tmp_path, 20, 0, 0, shard_size=10)
    train = tmp_path / "train"
    _bad_shards(train, train / "000000.tar")
    dm = ImageTextDataModule(train_shards=str(train), image_size=64, batch_size=4, num_workers=2, shuffle_buffer=0)
    samples = sum(len(batch["text"]) for batch in dm.train_dataloader())
    assert dm.skipped["unreadable shard"] == 3  # counted in the workers, seen by the main process
    assert 20 < samples < 30  # the cut shard still gives the samples before the cut
    assert dm.skip_counts()["unreadable shard"] == 3 and "unreadable shard: 3" in dm.skipped.summary()


def test_bad_token_samples_are_skipped_and_counted(tmp_path: Path) -> None:
    good = {"codes.npy": _npy(np.arange(16, dtype=np.uint16)), "ids.npy": _npy(np.array([3, 4])), "txt": b"a b"}
    samples = [
        {"__key__": "0", **good},
        {"__key__": "1", **good, "codes.npy": _npy(np.arange(9, dtype=np.uint16))},  # wrong length
        {"__key__": "2", **good, "codes.npy": _npy(np.full(16, 9999, dtype=np.uint16))},  # code >= vocabulary
        {"__key__": "3", **good, "ids.npy": _npy(np.array([3, 50]))},  # caption id >= vocabulary
        {"__key__": "4", **good, "codes.npy": _npy(np.zeros(16, dtype=np.float32))},  # not integer codes
    ]
    with wds.TarWriter(str(tmp_path / "000000.tar")) as sink:
        for s in samples:
            sink.write(s)
    dm = TokenDataModule(train_shards=str(tmp_path / "000000.tar"), text_len=4, image_grid=4, image_vocab_size=16,
                         text_vocab_size=10, batch_size=8, shuffle_buffer=0)
    (batch,) = list(dm.train_dataloader())
    assert batch["image"].shape == (1, 16)
    assert {k: v for k, v in dm.skipped.items() if v} == {
        "wrong image token count": 1, "image code out of range": 1, "caption id out of range": 1, "bad token arrays": 1}


def test_every_shard_unreadable_ends_with_one_line_within_seconds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    write_world(tmp_path / "good", 10, 0, 0, shard_size=10)
    for split in ("train", "val"):
        (tmp_path / "world" / split).mkdir(parents=True)
        _bad_shards(tmp_path / "world" / split, tmp_path / "good" / "train" / "000000.tar")
        (tmp_path / "world" / split / "000102.tar").write_bytes(b"\0" * 100)  # nothing readable at all
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, "stage=dvae", f"paths.work_dir={tmp_path}", "trainer.max_steps=5", *TINY_DVAE, *QUIET)
    elapsed = time.perf_counter() - start
    assert exit_info.value.code == 2 and elapsed < 20
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    # The readability probe before training: the split's key, its shards, what was skipped.
    assert len(errors) == 1 and "data.train_shards='auto'" in errors[0], errors
    assert "no readable image-caption sample in its 3 shard(s)" in errors[0], errors
    assert "000100.tar" in errors[0] and "unreadable shard: 3" in errors[0]
    assert not (tmp_path / "dvae.pt").exists()


def test_skipped_shards_are_logged_as_metrics(tiny_world: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import train as train_app

    shutil.copytree(tiny_world / "world" / "val", tmp_path / "world" / "val")
    train = tmp_path / "world" / "train"
    train.mkdir()
    shutil.copy(tiny_world / "world" / "train" / "000000.tar", train / "000200.tar")
    _bad_shards(train, train / "000200.tar", keep=0.05)  # read first: the cut copy holds a few samples
    run_app(train_app.main, "stage=dvae", f"paths.work_dir={tmp_path}", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
            "logger=csv", "data.shuffle_buffer=0", *TINY_DVAE, *QUIET)
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("data/skipped_total")]
    assert rows and float(rows[-1]["data/skipped/unreadable_shard"]) == 3.0
    reasons = [k for k in rows[-1] if k.startswith("data/skipped/")]
    # The cut copy's last sample lost members: a sample-level skip, counted beside the three shards.
    assert float(rows[-1]["data/skipped_total"]) == sum(float(rows[-1][k]) for k in reasons) >= 3.0
