"""Every stage runs from the command line on a tiny shapes world (tests/test_configs.py composes every config).

The pipeline order is the real one: world -> tokenizer -> dVAE -> token shards -> CLIP -> prior ->
generation -> evaluation. Training stages run a handful of steps with tiny models (their quality is not the
point here; the demo reports quality).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from tests.conftest import run_app

TINY_DVAE = ["model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16", "data.batch_size=8", "data.num_workers=0"]
TINY_PRIOR = ["model.n_layer=2", "model.n_head=2", "model.d_head=8", "data.batch_size=8", "data.num_workers=0"]


def test_mistyped_key_is_an_error(tiny_world: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    with pytest.raises(SystemExit):
        run_app(train.main, "stage=dvae", f"paths.work_dir={tiny_world}", "trainer.max_step=3")
    assert "Key 'max_step' is not in struct" in capsys.readouterr().err
    # A key that an experiment file adds by mistake (appended here with +) is caught before any work.
    with pytest.raises(SystemExit):
        run_app(train.main, "stage=dvae", f"paths.work_dir={tiny_world}", "+trainr.max_steps=3")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainr" in errors[0]


@pytest.mark.slow
def test_missing_shards_is_a_one_line_error_from_the_console_script(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "dalle_lightning.cli.train", "stage=dvae", f"paths.work_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and f"paths.world='{tmp_path / 'world'}'" in err[0], proc.stderr
    assert err[0].startswith("error: data.train_shards=auto:"), proc.stderr  # the key, its value, then the fix


def test_bad_image_size_is_a_one_line_error(tiny_world: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import train

    with pytest.raises(SystemExit):
        run_app(train.main, "stage=dvae", f"paths.work_dir={tiny_world}", "model.image_size=60", "trainer.fast_dev_run=true")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "60" in errors[0]


@pytest.mark.slow
def test_every_stage_runs_from_the_command_line(tiny_world: Path) -> None:
    from dalle_lightning.cli import encode, evaluate, generate, train

    work = f"paths.work_dir={tiny_world}"
    quiet = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    run_app(train.main, "stage=tokenizer", work)
    assert (tiny_world / "tokenizer.json").is_file()

    run_app(train.main, "stage=dvae", work, "trainer.fast_dev_run=true", *TINY_DVAE, *quiet)
    assert not (tiny_world / "dvae.pt").exists()  # a smoke test leaves no artifact behind
    run_app(train.main, "stage=dvae", work, "trainer.max_steps=2", *TINY_DVAE, *quiet)
    assert (tiny_world / "dvae.pt").is_file()

    run_app(encode.main, work, "batch_size=32")
    assert sorted(p.name for p in (tiny_world / "tokens").iterdir()) == ["train", "val"]
    shards = sorted((tiny_world / "tokens").glob("*/*.tar"))
    first = [p.read_bytes() for p in shards]
    with tarfile.open(shards[0]) as tar:
        assert all(m.mtime == 0 and not m.pax_headers for m in tar.getmembers())  # one header per member
    run_app(encode.main, work, "batch_size=32", "force=true")
    assert [p.read_bytes() for p in shards] == first  # token shards are reproducible byte for byte

    run_app(train.main, "stage=clip", work, "trainer.fast_dev_run=true", "data.batch_size=8", "data.num_workers=0", *quiet)
    run_app(train.main, "stage=clip", work, "trainer.max_steps=2", "data.batch_size=8", "data.num_workers=0", *quiet)
    run_app(train.main, "stage=prior", work, "trainer.fast_dev_run=true", *TINY_PRIOR, *quiet)
    run_app(train.main, "stage=prior", work, "trainer.max_steps=2", *TINY_PRIOR, *quiet)
    assert (tiny_world / "clip.pt").is_file() and (tiny_world / "prior.pt").is_file()

    run_app(generate.main, work, "num_candidates=2", "prompts=[a red square,a blue circle above a white square]")
    assert (tiny_world / "samples" / "grid.png").is_file() and (tiny_world / "samples" / "1.png").is_file()
    run_app(evaluate.main, work, "n_seen=4", "n_zeroshot=4", "candidates=[1,2]")
    report = json.loads((tiny_world / "eval.json").read_text())
    assert set(report["seen"]) >= {"1", "2"} and 0.0 <= report["zeroshot"]["2"]["accuracy"] <= 1.0
    assert report["seen"]["reference_renders"] >= 0.99


def test_generate_rejects_empty_prompt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    with pytest.raises(SystemExit):
        run_app(generate.main, f"paths.work_dir={tmp_path}", "prompts=[a red square,'']")
    assert "prompt 1 is empty" in capsys.readouterr().err
