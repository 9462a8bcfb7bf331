"""Writers never destroy or mix: each case of data loss or stale output now refuses or stays clean.

Tiny untrained artifacts (``tiny_artifacts``) are built in-process: the point is which files survive, not images.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dalle_lightning.artifacts import read_file
from dalle_lightning.data.datamodule import ImageTextDataModule
from dalle_lightning.world import write_world
from tests.conftest import run_app

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on shared cores

def _tar_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.tar"))


def _error_lines(capsys: pytest.CaptureFixture) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_encode_into_the_image_world_refuses_and_deletes_nothing(tiny_artifacts: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode

    write_world(tmp_path / "world", 20, 10, 0, shard_size=10)
    before = {s: _tar_names(tmp_path / "world" / s) for s in ("train", "val")}
    with pytest.raises(SystemExit) as exit_info:
        run_app(encode.main, f"paths.work_dir={tmp_path}", f"dvae={tiny_artifacts / 'dvae.pt'}",
                f"tokenizer={tiny_artifacts / 'tokenizer.json'}", f"out_dir={tmp_path / 'world'}", "force=true")
    assert exit_info.value.code == 2
    (line,) = _error_lines(capsys)
    assert "image shards written by dalle-data" in line and "nothing was deleted" in line
    assert {s: _tar_names(tmp_path / "world" / s) for s in ("train", "val")} == before


def test_data_into_a_folder_of_other_files_refuses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import data

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        run_app(data.main, f"out_dir={tmp_path}", "n_train=10", "n_val=0", "n_zeroshot=0", "force=true")
    (line,) = _error_lines(capsys)
    assert "notes.txt" in line and (tmp_path / "train" / "notes.txt").read_text() == "mine"


def test_smaller_data_rerun_leaves_no_stale_shards(tmp_path: Path) -> None:
    write_world(tmp_path, 30, 10, 10, shard_size=10)
    write_world(tmp_path, 10, 10, 0, shard_size=10)
    assert _tar_names(tmp_path / "train") == ["000000.tar"]
    assert _tar_names(tmp_path / "zeroshot") == []  # an emptied split is cleared too
    dm = ImageTextDataModule(train_shards=str(tmp_path / "train"), image_size=64, batch_size=64, shuffle_buffer=0)
    assert sum(len(batch["text"]) for batch in dm.train_dataloader()) == 10


def test_generate_rerun_clears_only_its_own_files(tiny_artifacts: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import generate

    out = tmp_path / "samples"
    common = [f"paths.work_dir={tiny_artifacts}", f"out_dir={out}", "clip=null", "num_candidates=2"]
    run_app(generate.main, *common, "save_candidates=true", "prompts=[a red square,a blue circle,a green square]")
    assert (out / "2.png").is_file() and (out / "candidates" / "2_1.png").is_file()
    (out / "notes.txt").write_text("mine")
    run_app(generate.main, *common, "prompts=[a red square]")
    assert sorted(p.name for p in out.iterdir()) == [".dalle-lightning.json", "0.png", "grid.png", "notes.txt"]


def test_generate_into_a_folder_of_other_files_refuses(tiny_artifacts: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    (tmp_path / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(SystemExit):
        run_app(generate.main, f"paths.work_dir={tiny_artifacts}", f"out_dir={tmp_path}", "clip=null")
    (line,) = _error_lines(capsys)
    assert "holiday.jpg" in line and (tmp_path / "holiday.jpg").exists()


def test_prior_sampled_with_another_dvae_is_a_one_line_error(tiny_artifacts: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    common = [f"paths.work_dir={tiny_artifacts}", f"out_dir={tmp_path / 's'}", "clip=null", "num_candidates=1",
              "prompts=[a red square]"]
    with pytest.raises(SystemExit) as exit_info:
        run_app(generate.main, *common, f"dvae={tiny_artifacts / 'other_dvae.pt'}")
    assert exit_info.value.code == 2
    (line,) = _error_lines(capsys)
    assert "dVAE" in line and "other_dvae.pt" in line and not (tmp_path / "s").exists()
    # A prior saved before artifacts recorded their dVAE is unknown, not a mismatch: it still samples.
    run_app(generate.main, *common, f"dvae={tiny_artifacts / 'other_dvae.pt'}", f"prior={tiny_artifacts / 'legacy_prior.pt'}")
    assert (tmp_path / "s" / "grid.png").is_file()


def test_prior_training_refuses_token_shards_of_another_dvae(tiny_artifacts: Path, tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from dalle_lightning.lineage import stage_record
    from dalle_lightning.outputs import write_marker
    from tests.conftest import CONF

    (tmp_path / "tokens" / "train").mkdir(parents=True)
    (tmp_path / "tokens" / "train" / "000000.tar").write_bytes(b"")
    other = read_file(tiny_artifacts / "other_dvae.pt")["meta"]
    write_marker(tmp_path / "tokens" / "train", "tokens", dvae={"sha256": other["sha256"], "vocab_size": 32})
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["stage=prior", f"paths.work_dir={tiny_artifacts}",
                                          f"paths.tokens={tmp_path / 'tokens'}"])
    with pytest.raises(ValueError, match="token shards.*dVAE.*module.dvae"):
        stage_record(cfg)
