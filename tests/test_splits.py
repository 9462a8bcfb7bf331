"""Splits as downloads have them (``data.splits``): train/ and val/ folders, or one folder with validation held out
of the last training shard, the same samples for every stage; every split read a little before anything starts;
skips counted once per sample; and one source for each size (``cli.sizes``): an override that contradicts an
artifact is one line naming both keys."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from dalle_lightning.data.datamodule import ImageTextDataModule
from dalle_lightning.data.splits import AUTO, resolve_splits
from tests.conftest import run_app

pytestmark = pytest.mark.usefixtures("one_thread")


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 12), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256)).save(buf, "PNG")
    return buf.getvalue()


def _download(folder: Path, shards: int = 3, per_shard: int = 30) -> list[str]:
    """An img2dataset-style folder of shards (keys 000000000, ...), one sample without a caption; all keys."""
    folder.mkdir(parents=True)
    keys = []
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as sink:
            for j in range(per_shard):
                key = f"{s * per_shard + j:09d}"
                sample = {"__key__": key, "png": _png(s * per_shard + j)}
                if key != "000000005":
                    sample["txt"] = f"picture number {s * per_shard + j}".encode()
                sink.write(sample)
                keys.append(key)
        (folder / f"{s:05d}_stats.json").write_text("{}")  # what img2dataset leaves beside each shard
    return keys


def _keys(dm: ImageTextDataModule, loader) -> list[str]:  # noqa: ANN001
    return sorted(text.split()[-1] for batch in loader for text in batch["text"])


def test_one_folder_holds_out_a_slice_of_the_last_shard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _download(tmp_path / "dl")
    dm = ImageTextDataModule(world=str(tmp_path / "dl"), train_shards=AUTO, val_shards=AUTO, val_holdout=0.3,
                             image_size=8, batch_size=7, shuffle_buffer=0)
    with caplog.at_level("INFO"):
        dm.setup("fit")
    train, val = dm.splits()
    assert [Path(u).name for u in train.urls] == ["00000.tar", "00001.tar", "00002.tar"]
    assert [Path(u).name for u in val.urls] == ["00002.tar"]
    said = [r.getMessage() for r in caplog.records if "holds out" in r.getMessage()]
    assert len(said) == 1 and "data.val_holdout=0.3" in said[0] and "data.val_shards=null: no validation" in said[0]
    trained = _keys(dm, dm.train_dataloader())
    validated = _keys(dm, dm.val_dataloader())
    # Disjoint, together every readable sample (89: one has no caption), validation only from the last shard,
    # and close to the share asked for (30 samples in that shard).
    assert not set(trained) & set(validated)
    assert len(trained) + len(validated) == 89
    assert all(60 <= int(k) < 90 for k in validated) and 3 <= len(validated) <= 17
    # The same slice for every stage and every run: a function of the keys alone.
    again = ImageTextDataModule(world=str(tmp_path / "dl"), val_holdout=0.3, train_shards=AUTO, val_shards=AUTO,
                                image_size=8, batch_size=7, shuffle_buffer=0, seed=5)
    assert _keys(again, again.val_dataloader()) == validated


def test_train_and_val_folders_are_used_as_they_are(tmp_path: Path) -> None:
    _download(tmp_path / "dl" / "train", shards=2, per_shard=5)
    _download(tmp_path / "dl" / "val", shards=1, per_shard=4)
    train, val = resolve_splits(str(tmp_path / "dl"), AUTO, AUTO, 0.1)
    assert train.keep is None and val.keep is None and len(train.urls) == 2 and len(val.urls) == 1
    assert resolve_splits(str(tmp_path / "dl"), AUTO, None, 0.1)[1] is None
    assert resolve_splits(str(tmp_path / "dl" / "train"), AUTO, AUTO, 0.0)[1] is None  # no val/ and no holdout


def test_skips_and_conversions_count_once_per_sample(tmp_path: Path) -> None:
    """Three epochs and two validations meet the caption-less sample many times; it counts once."""
    _download(tmp_path / "dl", shards=1, per_shard=12)
    dm = ImageTextDataModule(world=str(tmp_path / "dl"), train_shards=AUTO, val_shards=str(tmp_path / "dl"),
                             image_size=8, batch_size=4, shuffle_buffer=0)
    dm.setup("fit")
    for _ in range(3):
        list(dm.train_dataloader())
        list(dm.val_dataloader())
    assert dm.skip_counts()["missing caption"] == 1


@pytest.mark.parametrize("layout", ["folders", "one_folder"])
def test_encode_splits_as_training_sees_them(resume_work: Path, tmp_path: Path, layout: str) -> None:
    """dalle-encode with splits.val=null, and on a one-folder download (the held-out slice becomes tokens/val)."""
    from dalle_lightning.cli import encode

    work = tmp_path / "work"
    shutil.copytree(resume_work, work, ignore=shutil.ignore_patterns("runs", "tokens"))
    if layout == "folders":
        run_app(encode.main, f"paths.work_dir={work}", "batch_size=16", "num_workers=0", "splits.val=null")
        assert (work / "tokens" / "train").is_dir() and not (work / "tokens" / "val").exists()
        return
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, shard in enumerate(sorted((work / "world" / "train").glob("*.tar"))):
        shutil.copy(shard, flat / f"{i:05d}.tar")
    run_app(encode.main, f"paths.work_dir={work}", f"paths.world={flat}", "batch_size=16", "num_workers=0",
            "val_holdout=0.5")
    counts = {split: sum(1 for shard in (work / "tokens" / split).glob("*.tar")
                         for _ in wds.WebDataset(str(shard), shardshuffle=False)) for split in ("train", "val")}
    assert counts["val"] >= 2 and counts["train"] + counts["val"] == 40  # the 40 training samples, split


def _error(capsys: pytest.CaptureFixture, main, *overrides: str) -> str:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *overrides)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


def test_sizes_come_from_the_artifacts_and_contradictions_name_both_keys(
        resume_work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.artifacts import read_meta
    from dalle_lightning.cli import encode, train
    from dalle_lightning.data.tokenizer import CaptionTokenizer

    tokenizer, dvae = resume_work / "tokenizer.json", resume_work / "dvae.pt"
    assert read_meta(tokenizer, "text_len") == 20 and CaptionTokenizer.load(tokenizer).text_len == 20
    assert read_meta(dvae, "image_size") == 64  # from the building config of a file whose meta lacks it
    out = [f"paths.work_dir={resume_work}", f"out_dir={tmp_path / 'tokens'}"]
    line = _error(capsys, encode.main, *out, "image_size=256")
    assert line.startswith(f"error: image_size=256 contradicts dvae='{dvae}', which records image_size=64; expected 64")
    line = _error(capsys, encode.main, *out, "text_len=256")
    assert line.startswith(f"error: text_len=256 contradicts tokenizer='{tokenizer}', which records text_len=20")
    assert "model.text_len=256" in line  # the fix: a tokenizer trained for that length
    line = _error(capsys, train.main, "stage=prior", f"paths.work_dir={resume_work}", "model.text_len=32",
                  f"output={tmp_path / 'p.pt'}")
    assert line.startswith("error: model.text_len=32 contradicts paths.tokenizer=") and "text_len=20" in line
    line = _error(capsys, train.main, "stage=dvae", f"paths.work_dir={resume_work}", "data.image_size=32",
                  f"output={tmp_path / 'd.pt'}")
    assert line.startswith("error: data.image_size=32 contradicts model.image_size=64")


def test_a_tokenizer_records_its_text_len(tmp_path: Path) -> None:
    from dalle_lightning.data.tokenizer import CaptionTokenizer

    captions = [f"a long caption with many words number {i} " * 4 for i in range(50)]
    tok = CaptionTokenizer.train(captions, vocab_size=300, text_len=7)
    tok.save(tmp_path / "t.json")
    loaded = CaptionTokenizer.load(tmp_path / "t.json")
    assert loaded.text_len == 7 and loaded.tokenizer.padding is None  # recorded, and ids come unpadded
    ids = loaded.encode_batch(captions[:3])
    assert ids.shape == (3, 7) and loaded.truncated == 3
    line = loaded.truncation_line("prompts", 3)
    assert line.startswith("prompts: 3 of 3 captions were longer than text_len=7") and f"model.text_len={loaded.longest}" in line


def test_unquoted_braces_are_one_line_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    line = _error(capsys, train.main, "stage=dvae", "data.train_shards=/data/{00000..00009}.tar")
    assert line == ("error: data.train_shards=/data/{00000..00009}.tar: a brace pattern needs Hydra's own quotes "
                    "inside the shell's; expected \"data.train_shards='/data/{00000..00009}.tar'\"")


def test_a_missing_clip_for_the_prior_fid_is_one_line(resume_work: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """The prior's FID callback loads the CLIP: without one, the line names the callback's key and both fixes."""
    from dalle_lightning.cli import train

    line = _error(capsys, train.main, "stage=prior", f"paths.work_dir={resume_work}", f"paths.clip={tmp_path / 'c.pt'}",
                  f"output={tmp_path / 'p.pt'}")
    assert line == (f"error: callbacks.fid.feature_extractor.path='{tmp_path / 'c.pt'}'; expected an existing file: "
                    "the trained CLIP (`dalle-train stage=clip` writes paths.clip), or train without this callback "
                    "('~callbacks.fid')")
