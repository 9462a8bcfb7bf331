"""Writers never destroy or mix: each case of data loss or stale output now refuses or stays clean.

Tiny untrained artifacts are built in-process (no training): the point is which files survive, not image quality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalle_lightning.artifacts import save_model
from dalle_lightning.data.datamodule import ImageTextDataModule
from dalle_lightning.tokenizer import CaptionTokenizer
from dalle_lightning.world import write_world
from dalle_lightning.world.scene import sample_captions
from tests.conftest import run_app

DVAE = {"_target_": "dalle_lightning.models.dvae.DiscreteVAE", "image_size": 64, "n_hid": 8, "n_blk_per_group": 1,
        "vocab_size": 32, "codebook_dim": 16}


def _tar_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.tar"))


def _error_lines(capsys: pytest.CaptureFixture) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def _save_dvae(path: Path, seed: int) -> dict:
    from hydra.utils import instantiate

    torch.manual_seed(seed)
    dvae = instantiate(DVAE)
    blob = save_model(path, DVAE, dvae, meta={"stage": "dvae", "vocab_size": 32, "grid_size": 8})
    return torch.load(blob, weights_only=False)["meta"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json, two dVAEs of the same shape (dvae.pt, other_dvae.pt) and a prior that records dvae.pt."""
    from hydra.utils import instantiate

    from dalle_lightning.lineage import dvae_record, tokenizer_record

    work = tmp_path_factory.mktemp("artifacts")
    tok = CaptionTokenizer.train(sample_captions(0, "train", 200), vocab_size=300, text_len=20)
    tok.save(work / "tokenizer.json")
    dvae_meta = _save_dvae(work / "dvae.pt", seed=0)
    _save_dvae(work / "other_dvae.pt", seed=1)
    prior_cfg = {"_target_": "dalle_lightning.models.prior.DallePrior", "text_vocab_size": tok.vocab_size,
                 "text_len": 20, "image_vocab_size": 32, "image_grid": 8, "n_layer": 2, "n_head": 2, "d_head": 8}
    prior = instantiate(prior_cfg)
    trained_with = {"dvae": dvae_record(dvae_meta),
                    "tokenizer": tokenizer_record(work / "tokenizer.json", tok.vocab_size)}
    save_model(work / "prior.pt", prior_cfg, prior, meta={"stage": "prior", "trained_with": trained_with})
    save_model(work / "legacy_prior.pt", prior_cfg, prior, meta={"stage": "prior"})  # written before records
    return work


def test_encode_into_the_image_world_refuses_and_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode

    write_world(tmp_path / "world", 20, 10, 0, shard_size=10)
    before = {s: _tar_names(tmp_path / "world" / s) for s in ("train", "val")}
    with pytest.raises(SystemExit) as exit_info:
        run_app(encode.main, f"paths.work_dir={tmp_path}", f"out_dir={tmp_path / 'world'}", "force=true")
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


def test_generate_rerun_clears_only_its_own_files(artifacts: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import generate

    out = tmp_path / "samples"
    common = [f"paths.work_dir={artifacts}", f"out_dir={out}", "clip=null", "num_candidates=2"]
    run_app(generate.main, *common, "save_candidates=true", "prompts=[a red square,a blue circle,a green square]")
    assert (out / "2.png").is_file() and (out / "candidates" / "2_1.png").is_file()
    (out / "notes.txt").write_text("mine")
    run_app(generate.main, *common, "prompts=[a red square]")
    assert sorted(p.name for p in out.iterdir()) == [".dalle-lightning.json", "0.png", "grid.png", "notes.txt"]


def test_generate_into_a_folder_of_other_files_refuses(artifacts: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    (tmp_path / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(SystemExit):
        run_app(generate.main, f"paths.work_dir={artifacts}", f"out_dir={tmp_path}", "clip=null")
    (line,) = _error_lines(capsys)
    assert "holiday.jpg" in line and (tmp_path / "holiday.jpg").exists()


def test_prior_sampled_with_another_dvae_is_a_one_line_error(artifacts: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import generate

    common = [f"paths.work_dir={artifacts}", f"out_dir={tmp_path / 's'}", "clip=null", "num_candidates=1",
              "prompts=[a red square]"]
    with pytest.raises(SystemExit) as exit_info:
        run_app(generate.main, *common, f"dvae={artifacts / 'other_dvae.pt'}")
    assert exit_info.value.code == 2
    (line,) = _error_lines(capsys)
    assert "dVAE" in line and "other_dvae.pt" in line and not (tmp_path / "s").exists()
    # A prior saved before artifacts recorded their dVAE is unknown, not a mismatch: it still samples.
    run_app(generate.main, *common, f"dvae={artifacts / 'other_dvae.pt'}", f"prior={artifacts / 'legacy_prior.pt'}")
    assert (tmp_path / "s" / "grid.png").is_file()


def test_prior_training_refuses_token_shards_of_another_dvae(artifacts: Path, tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from dalle_lightning.lineage import stage_record
    from dalle_lightning.outputs import write_marker
    from tests.conftest import CONF

    (tmp_path / "tokens" / "train").mkdir(parents=True)
    (tmp_path / "tokens" / "train" / "000000.tar").write_bytes(b"")
    other = torch.load(artifacts / "other_dvae.pt", weights_only=False)["meta"]
    write_marker(tmp_path / "tokens" / "train", "tokens", dvae={"sha256": other["sha256"], "vocab_size": 32})
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["stage=prior", f"paths.work_dir={artifacts}",
                                          f"paths.tokens={tmp_path / 'tokens'}"])
    with pytest.raises(ValueError, match="token shards.*dVAE.*module.dvae"):
        stage_record(cfg)
