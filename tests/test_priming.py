"""Image priming from the command line (``dalle-generate prime_image=PATH prime_rows=K``): every candidate's first
K token rows are the prime's own dVAE codes, computed here straight from the PNG; bad values are one-line errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from dalle_lightning.artifacts import load_model
from tests.conftest import CONF, run_app
from tests.test_eval_report import DVAE, work  # noqa: F401  (the tiny saved pipeline: 32x32 images, 4x4 tokens)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

GRID = 4


@pytest.fixture(scope="module")
def prime_png(work: Path) -> Path:  # noqa: F811
    """A 32x32 picture (the dVAE's input size, so no resizing): red, green, blue and white bands."""
    pixels = np.zeros((DVAE["image_size"], DVAE["image_size"], 3), dtype=np.uint8)
    pixels[:8, :, 0], pixels[8:16, :, 1], pixels[16:24, :, 2], pixels[24:] = 255, 255, 255, 255
    path = work / "prime.png"
    Image.fromarray(pixels).save(path)
    return path


def reference_codes(work: Path, png: Path) -> torch.Tensor:  # noqa: F811
    """The PNG's codes by hand: pixels to [0, 1], through the saved dVAE's encoder, argmax, raster order."""
    pixels = torch.from_numpy(np.asarray(Image.open(png).convert("RGB")).copy()).permute(2, 0, 1).float() / 255
    return load_model(work / "dvae.pt").get_codebook_indices(pixels[None])[0].flatten()


@pytest.mark.parametrize("rows", [1, 3])
def test_first_rows_of_every_candidate_are_the_primes_codes(work: Path, prime_png: Path, rows: int) -> None:  # noqa: F811
    from dalle_lightning.cli import generate

    out = work / f"primed{rows}"
    common = [f"paths.work_dir={work}", "clip=null", "num_candidates=3", "cond_scale=1",
              "prompts=[a red square,a blue circle]"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        primed = generate.run(compose("generate", overrides=[*common, f"out_dir={out}", f"prime_image={prime_png}",
                                                             f"prime_rows={rows}"]))
        unprimed = generate.run(compose("generate", overrides=[*common, f"out_dir={work / 'unprimed'}"]))
    want = reference_codes(work, prime_png)[: rows * GRID].expand(2, 3, -1)
    assert primed.tokens.shape == (2, 3, GRID * GRID)
    assert torch.equal(primed.tokens[..., : rows * GRID], want)
    assert not torch.equal(unprimed.tokens[..., : rows * GRID], want)  # the same draw without the prime: other rows
    assert {p.name for p in out.iterdir()} >= {"prime.png", "0.png", "1.png", "grid.png"}


def _error(capsys: pytest.CaptureFixture, *overrides: str) -> str:
    from dalle_lightning.cli import generate

    with pytest.raises(SystemExit):
        run_app(generate.main, "clip=null", "prompts=[a red square]", *overrides)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:"), errors
    return errors[0]


def test_missing_file_and_rows_out_of_range_are_one_line_errors(work: Path, prime_png: Path,  # noqa: F811
                                                                capsys: pytest.CaptureFixture) -> None:
    at = f"paths.work_dir={work}"
    assert "nope.png" in _error(capsys, at, f"prime_image={work / 'nope.png'}", "prime_rows=2")
    for rows in (0, GRID):
        line = _error(capsys, at, f"prime_image={prime_png}", f"prime_rows={rows}")
        assert f"prime_rows={rows}" in line and f"1 to {GRID - 1}" in line
    assert "prime_image" in _error(capsys, at, "prime_rows=2")  # rows without an image
    not_an_image = work / "notes.txt"
    not_an_image.write_text("not a picture")
    assert "not an image" in _error(capsys, at, f"prime_image={not_an_image}")

