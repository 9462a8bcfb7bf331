"""A small handed file costs no more than the honest file it imitates (issue 75): a 9.8 KB ``tokenizer.json`` whose
normalizer doubles a letter 40 times, one whose padding asks for 10^6 caption positions, and shards whose members
a reader would inflate or read whole (a 1 MB gzip stream under a ``.tar`` name holding a 1 GiB member; a plain tar
whose member is larger than any image or token array can be).

Each input is first shown to be potent with the library alone, under a bound (``tokenizers`` builds the pipeline
and doubles the text at every step; it pads every caption to 10^6 ids; ``tarfile``'s ``r|*``, as webdataset opens a
shard, inflates the member; webdataset reads an oversized member whole), then refused cheaply: a tokenizer file in
one line naming the file and the component (exit code 2 at the command), a shard or sample skipped and counted by
reason (``data/skipped/compressed_shard``, ``image_too_large``, ``member_too_large``) without being read.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import struct
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from tokenizers import Tokenizer

from dalle_lightning.artifacts import read_meta
from dalle_lightning.data.datamodule import ImageTextDataModule, TokenDataModule
from dalle_lightning.data.skips import SkipCounter, read_shards
from dalle_lightning.data.tar_members import MAX_CAPTION_BYTES, MAX_IMAGE_BYTES, MAX_MEMBER_BYTES
from dalle_lightning.data.tokenizer import MAX_TEXT_LEN, CaptionTokenizer, read_tokenizer
from dalle_lightning.evaluation.captioned_data import _first_json
from dalle_lightning.outputs import _shard_members
from dalle_lightning.world import write_world
from tests.conftest import run_app
from tests.test_eval_report import work  # noqa: F401  (the tiny saved pipeline dalle-generate runs on)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

DOUBLINGS = 40  # the file: 2^40 letters from one
MIB = 2**20


# ---------------------------------------------------------------------------------------------- crafted inputs


def crafted_tokenizer(path: Path, honest: Path, **changes: object) -> Path:
    """``honest`` (a tokenizer.json this project wrote) with ``changes`` to its top-level keys, written to ``path``."""
    record = json.loads(honest.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))
    return path


def doubling(n: int) -> dict:
    """A normalizer replacing ``e`` with ``ee``, ``n`` times over: 2^n letters from one."""
    return {"type": "Sequence", "normalizers": [{"type": "Replace", "pattern": {"String": "e"}, "content": "ee"}] * n}


def fixed_padding(length: int) -> dict:
    return {"strategy": {"Fixed": length}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
            "pad_type_id": 0, "pad_token": "[PAD]"}


def header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def member(name: str, data: bytes) -> bytes:
    return header(name, len(data)) + data + bytes(-len(data) % 512)


def gzip_tar(path: Path, name: str, size: int) -> Path:
    """A gzip stream of a tar holding ``name`` (``size`` zero bytes) and a caption: every MiB of zeros compresses
    to the same ~1 KB (each flushed whole), so a 1 GiB member costs ~1 MB of file and no memory to write."""
    chunk = bytes(MIB)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    head = header(name, size)
    tail = member(name.split(".")[0] + ".txt", b"a caption") + bytes(1024)
    crc = zlib.crc32(head)
    with open(path, "wb") as out:
        out.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff")  # gzip, deflate, no name, no mtime
        out.write(deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH))
        zeros = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
        for _ in range(size // MIB):
            out.write(zeros)
            crc = zlib.crc32(chunk, crc)
        out.write(deflate.compress(tail) + deflate.flush())
        out.write(struct.pack("<II", zlib.crc32(tail, crc), (len(head) + size + len(tail)) % 2**32))
    return path


def sparse_tar(path: Path, big: str, size: int, fine: dict[str, bytes]) -> Path:
    """A plain tar whose first sample's member ``big`` is ``size`` zero bytes (a hole: no disk), then a fine
    sample of the members ``fine`` (key ``fine``)."""
    with open(path, "wb") as out:
        out.write(header(big, size))
        out.seek(size + (-size % 512), io.SEEK_CUR)
        out.write(b"".join(member(f"fine.{ext}", data) for ext, data in fine.items()) + bytes(1024))
    return path


def png(colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buf, "PNG")
    return buf.getvalue()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.fixture(scope="module")
def gzip_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 GiB image member in a ~1 MB gzip stream named ``000009.tar``."""
    return gzip_tar(tmp_path_factory.mktemp("bomb") / "000009.tar", "bomb.png", 2**30)


def peak_bytes(run) -> int:
    """The most bytes Python held at once while ``run()`` ran (tracemalloc: bytes objects, numpy, PIL's buffers)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _error(capsys: pytest.CaptureFixture, main, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *overrides)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0].startswith("error:"), err
    return errors[0]


# ------------------------------------------------------------------------------------------- tokenizer files


def test_a_doubling_normalizer_is_potent_in_tokenizers_alone(work: Path, tmp_path: Path) -> None:  # noqa: F811
    """tokenizers builds the 40-step pipeline from the ~10 KB file at once; every step doubles each ``e``, so one
    caption letter would become 2^40 (shown on the file's first steps: 2^n ids from ``e`` after n)."""
    crafted = crafted_tokenizer(tmp_path / "tokenizer.json", work / "tokenizer.json", normalizer=doubling(DOUBLINGS))
    assert crafted.stat().st_size < 16 * 1024
    built = json.loads(Tokenizer.from_file(str(crafted)).to_str())  # built whole, without a word of warning
    assert len(built["normalizer"]["normalizers"]) == DOUBLINGS
    for n in (8, 10, 12):
        tok = Tokenizer.from_file(str(crafted_tokenizer(tmp_path / f"{n}.json", crafted, normalizer=doubling(n))))
        assert tok.normalizer.normalize_str("e") == "e" * 2**n


def test_a_doubling_normalizer_is_refused_at_the_command(work: Path, tmp_path: Path,  # noqa: F811
                                                         capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    crafted = crafted_tokenizer(tmp_path / "tokenizer.json", work / "tokenizer.json", normalizer=doubling(DOUBLINGS))
    # A prompt without an e: on a reader without the check, the command ends (draws) instead of running for ever.
    line = _error(capsys, generate.main, f"paths.work_dir={work}", f"out_dir={tmp_path / 'out'}", "clip=null",
                  "prompts=[a pink box]", "num_candidates=2", f"tokenizer={crafted}")
    assert line.startswith(f"error: tokenizer file {str(crafted)!r}: normalizer is a Sequence of {DOUBLINGS}, so it "
                           "was not read; expected null, or one of ['NFKC', 'Lowercase']"), line
    assert not (tmp_path / "out").exists()
    replacing = crafted_tokenizer(tmp_path / "one.json", work / "tokenizer.json", normalizer=doubling(1))
    with pytest.raises(ValueError, match=r"normalizer holds 'Replace', so it was not read"):
        read_tokenizer(replacing)  # a single Replace is no normalizer this project writes either
    assert CaptionTokenizer.load(work / "tokenizer.json").vocab_size > 0  # the project's own file loads


@pytest.mark.parametrize("change,component", [
    ({"model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                "max_input_chars_per_word": 10**9, "vocab": {"[PAD]": 0, "[UNK]": 1}}}, "model is 'WordPiece'"),
    ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a*)*b"}, "behavior": "Isolated", "invert": False}},
     "pre_tokenizer is 'Split'"),
    ({"decoder": {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}}, "decoder is 'Replace'"),
    ({"added_tokens": [{"id": i, "content": f"[T{i}]", "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": True} for i in range(2000)]}, "added_tokens holds 2000 tokens"),
    ({"truncation": {"direction": "Right", "max_length": 10**9, "strategy": "LongestFirst", "stride": 0}},
     "truncation is set"),
])
def test_every_component_beyond_the_project_s_own_is_refused(change: dict, component: str, work: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """Each is a component tokenizers builds (shown first), but none this project writes."""
    crafted = crafted_tokenizer(tmp_path / "tokenizer.json", work / "tokenizer.json", **change)
    Tokenizer.from_file(str(crafted))
    with pytest.raises(ValueError) as refused:
        read_tokenizer(crafted)
    assert str(refused.value).startswith(f"tokenizer file {str(crafted)!r}: {component}, so it was not read"), refused
    assert "\n" not in str(refused.value)


def test_a_tokenizer_nested_too_deeply_is_refused_in_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "tokenizer.json"
    deep.write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError) as refused:
        read_tokenizer(deep)
    assert str(refused.value).startswith(f"tokenizer file {str(deep)!r}: the JSON is nested too deeply to read")


def test_a_padding_of_a_million_positions_is_potent_in_tokenizers_alone(work: Path,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """The file's padding is the caption length the prior and dalle-encode read (``${meta:tokenizer.json,text_len}``):
    tokenizers pads every caption to 10^6 ids, and the prior's attention mask over (10^6 + 1 + its image tokens)
    positions squared would be more than 10^12 bytes."""
    crafted = crafted_tokenizer(tmp_path / "tokenizer.json", work / "tokenizer.json", padding=fixed_padding(10**6))
    tok = Tokenizer.from_file(str(crafted))
    assert tok.padding["length"] == 10**6 and len(tok.encode("a red square").ids) == 10**6
    assert (10**6 + 1) ** 2 > 10**12


def test_a_padding_of_a_million_positions_is_refused_at_the_command(tiny_artifacts: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode

    honest = tiny_artifacts / "tokenizer.json"  # the dVAE's pipeline's: unchecked, the command encodes with it
    crafted = crafted_tokenizer(tmp_path / "tokenizer.json", honest, padding=fixed_padding(10**6))
    write_world(tmp_path / "world", 8, 0, 0, shard_size=8)
    line = _error(capsys, encode.main, f"paths.work_dir={tmp_path}", f"dvae={tiny_artifacts / 'dvae.pt'}",
                  f"tokenizer={crafted}", f"out_dir={tmp_path / 'tokens'}", "splits.val=null", "num_workers=0")
    assert line.startswith(f"error: text_len: tokenizer file {str(crafted)!r}: padding.length (the recorded "
                           "text_len) is {'Fixed': 1000000}, so it was not read; expected a fixed length of 1 to "
                           f"{MAX_TEXT_LEN}"), line
    assert not (tmp_path / "tokens").exists()
    with pytest.raises(ValueError, match="padding.length"):
        read_meta(crafted, "text_len")  # the ${meta:...} resolver the prior's config reads its text_len through
    at_bound = crafted_tokenizer(tmp_path / "bound.json", honest, padding=fixed_padding(MAX_TEXT_LEN))
    assert read_meta(at_bound, "text_len") == MAX_TEXT_LEN
    with pytest.raises(ValueError, match=f"at most {MAX_TEXT_LEN}"):
        CaptionTokenizer(read_tokenizer(honest), text_len=MAX_TEXT_LEN + 1)


# ------------------------------------------------------------------------------------------------------ shards


def test_a_gzip_shard_is_potent_in_tarfile_alone(gzip_bomb: Path) -> None:
    """webdataset opens every shard with tarfile's ``r|*``, which inflates a gzip stream whatever its name, and reads
    each member whole: here 1 GiB from ~1 MB (1 MiB of it inflated to show it)."""
    assert gzip_bomb.stat().st_size < 2 * MIB
    with open(gzip_bomb, "rb") as f, tarfile.open(fileobj=f, mode="r|*") as tar:
        first = tar.next()
        assert first.name == "bomb.png" and first.size == 2**30
        assert tar.extractfile(first).read(MIB) == bytes(MIB)


def test_a_gzip_shard_is_skipped_and_counted_at_the_command(tiny_artifacts: Path, gzip_bomb: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode

    write_world(tmp_path / "world", 8, 0, 0, shard_size=8)
    (tmp_path / "world" / "train" / gzip_bomb.name).write_bytes(gzip_bomb.read_bytes())  # ~1 MB
    run_app(encode.main, f"paths.work_dir={tmp_path}", f"dvae={tiny_artifacts / 'dvae.pt'}",
            f"tokenizer={tiny_artifacts / 'tokenizer.json'}", f"out_dir={tmp_path / 'tokens'}", "splits.val=null",
            "num_workers=0", "batch_size=8")
    log = capsys.readouterr().out  # the command's log lines
    assert "[INFO] - train: skipped/compressed_shard=1\n" in log, log
    assert "corrupt_image" not in log and "image_too_large" not in log  # never inflated, so never decoded
    with tarfile.open(tmp_path / "tokens" / "train" / "000000.tar") as tar:
        assert len([m for m in tar if m.name.endswith(".codes.npy")]) == 8  # every sample of the plain shard


def test_a_gzip_shard_costs_nothing_to_look_at(tmp_path: Path) -> None:
    """Neither the legacy-output check (its first members' names) nor dalle-eval's shapes-world hint (its first json)
    inflates a compressed shard; a plain one still answers both."""
    small = gzip_tar(tmp_path / "000000.tar", "0.json", 64 * MIB)
    assert _shard_members(small) == set()
    assert peak_bytes(lambda: _first_json(str(small))) < MIB
    assert _first_json(str(small)) is None
    plain = tmp_path / "plain.tar"
    scene = json.dumps({"caption": "a red square", "relation": None, "objects": []}).encode()
    plain.write_bytes(member("0.png", png()) + member("0.txt", b"a red square") + member("0.json", scene) + bytes(1024))
    assert _shard_members(plain) == {"png", "txt", "json"} and _first_json(str(plain))["caption"] == "a red square"
    sparse = sparse_tar(tmp_path / "big.tar", "0.json", 64 * MIB, {"png": png()})
    assert peak_bytes(lambda: _first_json(str(sparse))) < MIB  # a json beyond a hint's size is not read


@pytest.mark.parametrize("kind,compress", [("gzip", gzip.compress), ("bzip2", bz2.compress), ("xz", lzma.compress),
                                           ("zstd", lambda data: b"\x28\xb5\x2f\xfd" + data)])  # its magic number
def test_every_compressed_stream_is_refused_unread(kind: str, compress, tmp_path: Path) -> None:
    plain = member("0.png", png()) + member("0.txt", b"a red square") + bytes(1024)
    shard = tmp_path / "000000.tar"
    shard.write_bytes(compress(plain))
    skipped = SkipCounter()
    assert list(read_shards([str(shard)], skipped)) == []
    assert skipped["compressed shard"] == 1 and skipped["unreadable shard"] == 0, skipped.summary()
    shard.write_bytes(plain)
    assert [s["txt"] for s in read_shards([str(shard)], skipped)] == [b"a red square"]  # the plain tar is read


def test_an_image_member_beyond_any_image_is_skipped_unread(tmp_path: Path) -> None:
    shard = sparse_tar(tmp_path / "000000.tar", "big.png", MAX_IMAGE_BYTES + 1,
                       {"png": png(), "txt": b"a red square"})
    dm = ImageTextDataModule(image_size=16, train_shards=str(shard), val_shards=str(shard), batch_size=1,
                             shuffle_buffer=0)
    batches: list = []
    assert peak_bytes(lambda: batches.extend(dm.val_dataloader())) < 16 * MIB
    assert [b["text"] for b in batches] == [["a red square"]]
    assert dm.skipped["image too large"] == 1 and dm.skipped["corrupt image"] == 0, dm.skipped.summary()


def test_a_caption_beyond_any_caption_is_skipped_unread(tmp_path: Path) -> None:
    """Tokenizing a caption costs far more than its bytes (a 16 MiB one: seconds and gigabytes, for ids cut to
    text_len): one over MAX_CAPTION_BYTES is never read, nor handed to the tokenizer."""
    shard = tmp_path / "000000.tar"
    shard.write_bytes(member("long.png", png()) + member("long.txt", b"a" * (MAX_CAPTION_BYTES + 1))
                      + member("fine.png", png()) + member("fine.txt", b"a red square") + bytes(1024))
    dm = ImageTextDataModule(image_size=16, train_shards=str(shard), val_shards=str(shard), batch_size=1,
                             shuffle_buffer=0)
    assert [b["text"] for b in dm.val_dataloader()] == [["a red square"]]
    assert dm.skipped["member too large"] == 1, dm.skipped.summary()


def test_a_token_member_beyond_any_token_array_is_potent_in_webdataset_alone(tmp_path: Path) -> None:
    shard = sparse_tar(tmp_path / "000000.tar", "big.codes.npy", MAX_MEMBER_BYTES + 1, {})
    (sample,) = wds.tarfile_samples([{"url": str(shard)}])
    assert len(sample["codes.npy"]) == MAX_MEMBER_BYTES + 1  # read whole before anything looked at it


def test_a_token_member_beyond_any_token_array_is_skipped_unread(tmp_path: Path) -> None:
    good = {"codes.npy": npy(np.arange(16, dtype=np.uint16)), "ids.npy": npy(np.array([3, 4])), "txt": b"a b"}
    shard = sparse_tar(tmp_path / "000000.tar", "big.codes.npy", MAX_MEMBER_BYTES + 1, good)
    dm = TokenDataModule(text_len=4, image_tokens=16, image_vocab_size=32, text_vocab_size=8,
                         train_shards=str(shard), val_shards=str(shard), batch_size=1, shuffle_buffer=0)
    batches: list = []
    assert peak_bytes(lambda: batches.extend(dm.val_dataloader())) < 4 * MIB
    assert len(batches) == 1 and batches[0]["image"].tolist() == [list(range(16))]
    assert dm.skipped["member too large"] == 1 and dm.skipped["bad token arrays"] == 0, dm.skipped.summary()
