"""Inputs of absurd size are refused before they are read whole (issue 69): a tokenizer file beyond any real one, and
an image whose header declares more pixels than an image may have (a decompression bomb: a few kilobytes of PNG
that decode to 100 million pixels). A bomb in a training shard is skipped and counted (``image too large``), as a
corrupt sample is; a file a user hands a command (``tokenizer=``, ``prime_image=``) ends it with one line naming the
file, exit code 2. (A DCP ``.metadata`` too large: ``tests/test_dcp_paths.py``.)

Each bomb is first shown to be potent: Pillow alone opens it with a warning only, and would decode it.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from dalle_lightning.data.datamodule import ImageTextDataModule
from dalle_lightning.artifacts import read_meta
from dalle_lightning.data.tokenizer import MAX_TOKENIZER_BYTES, CaptionTokenizer
from dalle_lightning.data.transforms import MAX_IMAGE_PIXELS, ImageTooLarge, decode_image
from tests.conftest import run_app
from tests.test_eval_report import work  # noqa: F401  (the tiny saved pipeline)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

SIDE = 10_000  # 100 million pixels: above the bound, below twice Pillow's own (where Pillow only warns)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A real PNG of SIDE x SIDE one-bit pixels: about 12 KB that decode to 100 million pixels (300 MB as RGB)."""
    buf = io.BytesIO()
    Image.new("1", (SIDE, SIDE)).save(buf, "PNG")
    return buf.getvalue()


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` pixels, with one row of data: what a header costs."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # one-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(1 + width // 8)))
            + chunk(b"IEND", b""))


def test_pillow_alone_would_decode_the_bomb(bomb: bytes) -> None:
    """The threat is real: Pillow's own bound only warns at this size (and raises only above twice its bound)."""
    assert len(bomb) < 64 * 1024
    with pytest.warns(Image.DecompressionBombWarning), Image.open(io.BytesIO(bomb)) as img:
        assert img.size == (SIDE, SIDE) and SIDE * SIDE > MAX_IMAGE_PIXELS


@pytest.mark.parametrize("declared", [(SIDE, SIDE), (100_000, 100_000), (MAX_IMAGE_PIXELS + 1, 1)])
def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(declared: tuple[int, int], bomb: bytes) -> None:
    data = bomb if declared == (SIDE, SIDE) else declared_png(*declared)
    with pytest.raises(ImageTooLarge) as refused:
        decode_image(data)
    pixels = declared[0] * declared[1]
    assert str(refused.value).startswith(f"it declares {pixels} "), refused.value
    assert "\n" not in str(refused.value) and "decompression bomb" in str(refused.value)
    assert decode_image(declared_png(64, 1)).size == (64, 1)  # an image of a sane size decodes


def test_a_bomb_in_a_training_shard_is_skipped_and_counted(bomb: bytes, tmp_path: Path) -> None:
    shard = tmp_path / "000000.tar"
    ok = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 0, 0)).save(ok, "PNG")
    with wds.TarWriter(str(shard)) as sink:
        sink.write({"__key__": "bomb", "png": bomb, "txt": b"a caption"})
        sink.write({"__key__": "fine", "png": ok.getvalue(), "txt": b"a red square"})
    dm = ImageTextDataModule(image_size=16, train_shards=str(shard), val_shards=str(shard), batch_size=1,
                             shuffle_buffer=0)
    batches = list(dm.val_dataloader())
    assert len(batches) == 1 and batches[0]["text"] == ["a red square"]
    assert dm.skipped["image too large"] == 1 and dm.skipped["corrupt image"] == 0, dm.skipped.summary()


def _error(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    from dalle_lightning.cli import generate

    with pytest.raises(SystemExit) as exit_info:
        run_app(generate.main, "clip=null", "prompts=[a red square]", *overrides)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0].startswith("error:"), err
    return errors[0]


def test_a_bomb_handed_to_generate_is_refused_in_one_line(bomb: bytes, work: Path, tmp_path: Path,  # noqa: F811
                                                          capsys: pytest.CaptureFixture) -> None:
    prime = tmp_path / "prime.png"
    prime.write_bytes(bomb)
    line = _error(capsys, f"paths.work_dir={work}", f"out_dir={tmp_path / 'out'}", f"prime_image={prime}")
    assert line.startswith(f"error: prime_image {str(prime)!r}: it declares {SIDE * SIDE} ({SIDE}x{SIDE}) pixels, "
                           f"more than the {MAX_IMAGE_PIXELS} an image may have"), line
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_file_beyond_any_tokenizer_is_refused_before_it_is_read(work: Path, tmp_path: Path,  # noqa: F811
                                                                           capsys: pytest.CaptureFixture) -> None:
    huge = tmp_path / "tokenizer.json"
    with open(huge, "wb") as f:  # sparse: the size without the disk
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    line = _error(capsys, f"paths.work_dir={work}", f"out_dir={tmp_path / 'out'}", f"tokenizer={huge}")
    assert line == (f"error: tokenizer file {str(huge)!r} holds {MAX_TOKENIZER_BYTES + 1} bytes, so it was not read; "
                    "expected a tokenizer.json of at most 64 MiB (the largest published tokenizers are about 33 MB)")
    assert CaptionTokenizer.load(work / "tokenizer.json").vocab_size > 0  # a real one loads
    # the ${meta:...} resolver the prior's and dalle-encode's configs read sizes through: the same bound
    with pytest.raises(ValueError, match="so it was not read"):
        read_meta(huge, "vocab_size")
    assert read_meta(work / "tokenizer.json", "vocab_size") == CaptionTokenizer.load(work / "tokenizer.json").vocab_size
    with pytest.raises(ValueError, match="is not a regular file"):
        CaptionTokenizer.load("/dev/zero")
