"""Images decode as a person sees them: each format is built with PIL, written into a WebDataset shard, and read
back through the project's loader (``ImageTextDataModule``); the pixels are checked against what the image shows.

The reference for each case is the image as drawn (the opaque colour, the background under transparent pixels,
the turned layout), not the decoder's own output.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image, features

from dalle_lightning.data.datamodule import ImageTextDataModule
from dalle_lightning.data.transforms import decode_image

S = 16  # square, so the loader's centre crop and resize leave every pixel as it is
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)
HIDDEN = (0, 0, 0)  # the colour stored under fully transparent pixels (what convert("RGB") used to show)


def _encode(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def _halves(left: tuple, right: tuple, mode: str = "RGBA") -> Image.Image:
    img = Image.new(mode, (S, S), right)
    img.paste(Image.new(mode, (S // 2, S), left), (0, 0))
    return img


def _load(tmp_path: Path, member: str, data: bytes, background=(255, 255, 255)) -> tuple[np.ndarray, dict]:
    """The image after the project's loader (uint8 HxWx3) and the conversions it counted."""
    shard = tmp_path / "000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        sink.write({"__key__": "k0", member: data, "txt": b"a caption"})
    dm = ImageTextDataModule(image_size=S, train_shards=str(shard), val_shards=str(shard), batch_size=1,
                             shuffle_buffer=0, background=background)
    batches = list(dm.val_dataloader())
    assert len(batches) == 1, dm.skipped.summary()
    pixels = (batches[0]["image"][0].permute(1, 2, 0) * 255).round().to(dtype=__import__("torch").uint8).numpy()
    return pixels, {k: v for k, v in dm.conversion_counts().items() if v}


def _near(pixels: np.ndarray, colour: tuple, tol: int = 0) -> bool:
    return bool(np.abs(pixels.astype(int) - np.array(colour)).max() <= tol)


def _rgba_with_hidden_colour() -> Image.Image:
    return _halves(RED + (255,), HIDDEN + (0,))


def test_rgba_png_transparency_is_composited_onto_white(tmp_path: Path) -> None:
    pixels, counts = _load(tmp_path, "png", _encode(_rgba_with_hidden_colour(), "PNG"))
    assert _near(pixels[:, : S // 2], RED) and _near(pixels[:, S // 2 :], WHITE)
    assert counts == {"transparency": 1}


def test_half_transparent_pixels_blend_with_the_background(tmp_path: Path) -> None:
    img = Image.new("RGBA", (S, S), (0, 0, 0, 128))  # black at ~50% on white: mid grey, 255 * (1 - 128/255)
    pixels, _ = _load(tmp_path, "png", _encode(img, "PNG"))
    assert _near(pixels, (127, 127, 127), tol=1)


def test_background_is_configurable(tmp_path: Path) -> None:
    pixels, _ = _load(tmp_path, "png", _encode(_rgba_with_hidden_colour(), "PNG"), background=BLUE)
    assert _near(pixels[:, S // 2 :], BLUE) and _near(pixels[:, : S // 2], RED)


def test_bad_background_is_one_line_naming_it() -> None:
    with pytest.raises(ValueError, match=r"data.background=\[255, 255\]; expected three integers"):
        ImageTextDataModule(image_size=S, background=[255, 255])


def test_la_png_transparency_is_composited(tmp_path: Path) -> None:
    img = _halves((60, 255), (0, 0), mode="LA")
    pixels, counts = _load(tmp_path, "png", _encode(img, "PNG"))
    assert _near(pixels[:, : S // 2], (60, 60, 60)) and _near(pixels[:, S // 2 :], WHITE)
    assert counts == {"transparency": 1, "greyscale": 1}


def test_palette_png_with_a_transparent_index_is_composited(tmp_path: Path) -> None:
    img = Image.new("P", (S, S), 0)
    img.putpalette(list(HIDDEN) + list(RED) + [0] * (254 * 3))
    img.paste(1, (0, 0, S // 2, S))
    pixels, counts = _load(tmp_path, "png", _encode(img, "PNG", transparency=0))
    assert _near(pixels[:, : S // 2], RED) and _near(pixels[:, S // 2 :], WHITE)
    assert counts == {"transparency": 1, "palette": 1}


@pytest.mark.skipif(not features.check("webp"), reason="Pillow built without WebP")
def test_webp_with_alpha_is_composited(tmp_path: Path) -> None:
    pixels, counts = _load(tmp_path, "webp", _encode(_rgba_with_hidden_colour(), "WEBP", lossless=True))
    assert _near(pixels[:, : S // 2], RED) and _near(pixels[:, S // 2 :], WHITE)
    assert counts == {"transparency": 1}


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """Orientation 6 (a phone held upright): the stored top is shown on the right."""
    stored = Image.new("RGB", (S, S), BLUE)
    stored.paste(Image.new("RGB", (S, S // 2), RED), (0, 0))  # top half red as stored
    exif = Image.Exif()
    exif[0x0112] = 6
    pixels, counts = _load(tmp_path, "jpg", _encode(stored, "JPEG", quality=95, exif=exif.tobytes()))
    inner = slice(2, S - 2)  # away from JPEG's blur at the edge between the halves
    assert _near(pixels[inner, S // 2 + 2 :], RED, tol=40) and _near(pixels[inner, : S // 2 - 2], BLUE, tol=40)
    assert counts == {"exif orientation": 1}


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.full((S, S), 32896, dtype=np.uint16)  # 128 * 257: mid grey in 16 bits
    values[:, : S // 2] = 65535
    img = Image.fromarray(values)  # uint16: mode I;16
    data = _encode(img, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    pixels, counts = _load(tmp_path, "png", data)
    assert _near(pixels[:, S // 2 :], (128, 128, 128)) and _near(pixels[:, : S // 2], WHITE)
    assert counts == {"16-bit": 1}


def test_cmyk_jpeg(tmp_path: Path) -> None:
    img = Image.new("CMYK", (S, S), (0, 255, 255, 0))  # no cyan, full magenta and yellow: red
    pixels, counts = _load(tmp_path, "jpg", _encode(img, "JPEG", quality=95))
    assert _near(pixels, RED, tol=8)
    assert counts == {"cmyk": 1}


def test_greyscale_jpeg(tmp_path: Path) -> None:
    pixels, counts = _load(tmp_path, "jpg", _encode(Image.new("L", (S, S), 100), "JPEG", quality=95))
    assert _near(pixels, (100, 100, 100), tol=2)
    assert counts == {"greyscale": 1}


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animation_gives_its_first_frame(tmp_path: Path, fmt: str) -> None:
    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("Pillow built without WebP")
    frames = [Image.new("RGB", (S, S), RED), Image.new("RGB", (S, S), BLUE)]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    pixels, counts = _load(tmp_path, fmt.lower() if fmt == "WEBP" else "png", data)
    assert _near(pixels, RED, tol=2)
    assert counts["animation"] == 1


def test_plain_rgb_needs_no_conversion(tmp_path: Path) -> None:
    pixels, counts = _load(tmp_path, "png", _encode(_halves(RED, BLUE, mode="RGB"), "PNG"))
    assert _near(pixels[:, : S // 2], RED) and _near(pixels[:, S // 2 :], BLUE) and counts == {}


def test_corrupt_bytes_still_raise() -> None:
    with pytest.raises(Exception):
        decode_image(b"not an image")


@pytest.mark.usefixtures("one_thread")
def test_training_summary_counts_conversions(tmp_path: Path) -> None:
    """The dvae stage's metrics.json says how many decoded images needed each conversion (summed over the run:
    every pass over the 8 samples, half of them transparent, decodes 4 that need compositing)."""
    import json

    from dalle_lightning.cli import train
    from tests.conftest import run_app
    from tests.test_pipeline import TINY_DVAE

    for split in ("train", "val"):
        (tmp_path / "world" / split).mkdir(parents=True)
        with wds.TarWriter(str(tmp_path / "world" / split / "000000.tar")) as sink:
            for i in range(8):
                img = _rgba_with_hidden_colour() if i % 2 else _halves(RED, BLUE, mode="RGB")
                sink.write({"__key__": f"k{i}", "png": _encode(img, "PNG"), "txt": b"a red square"})
    run_app(train.main, "stage=dvae", f"paths.work_dir={tmp_path}", "trainer.max_steps=2", "data.batch_size=4",
            "data.shuffle_buffer=0", "model.image_size=16", "data.image_size=16", "trainer.limit_val_batches=0",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", *TINY_DVAE)
    (metrics_file,) = (tmp_path / "runs").rglob("metrics.json")
    metrics = json.loads(metrics_file.read_text())["metrics"]
    transparent = metrics["data/converted/transparency"]
    assert transparent >= 4 and transparent % 4 == 0 and metrics["data/converted/exif_orientation"] == 0.0
