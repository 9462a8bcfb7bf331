"""Opening a file never runs code from it (issue 65): at every place a user hands the project a file, two crafted
files, one whose pickle would create a marker file when unpickled, one plain file whose config ``_target_`` names
a stranger's callable (``builtins.open``, which would create the marker when built), each end the command with one
line naming the file and exit code 2, and the marker never appears. Both files are first shown to be potent: read
the old way (``torch.load(weights_only=False)``, Hydra's ``instantiate``) they do create their marker.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_app


class Payload:
    """Unpickled, calls ``open(marker, "w")``: creates the marker file (what a pickled payload does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.marker, "w")


def stranger_config(marker: Path) -> dict[str, Any]:
    """A building config whose target, built by Hydra's instantiate, creates ``marker``."""
    return {"_target_": "builtins.open", "file": str(marker), "mode": "w"}


def pickled_model_file(path: Path, marker: Path, stage: str) -> Path:
    """A model file in the artifact layout, with a payload in its metadata."""
    torch.save({"config": {"_target_": "dalle_lightning.models.dvae.DiscreteVAE"}, "state_dict": {},
                "meta": {"stage": stage, "note": Payload(marker)}}, path)
    return path


def target_model_file(path: Path, marker: Path, stage: str) -> Path:
    """A model file of tensors and plain values only (it loads under weights_only=True) whose config builds
    ``builtins.open``."""
    torch.save({"config": stranger_config(marker), "state_dict": {"w": torch.zeros(2)}, "meta": {"stage": stage}},
               path)
    return path


def pickled_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {}, "global_step": 3, "pytorch-lightning_version": "2.6.6",
                "callbacks": {"x": Payload(marker)}}, path)
    return path


def target_checkpoint(path: Path, marker: Path) -> Path:
    """A checkpoint of plain values whose hyper-parameters name a callable to build (Lightning's
    ``load_from_checkpoint`` calls ``_instantiator``; Hydra would build ``_target_``)."""
    torch.save({"state_dict": {}, "global_step": 3, "pytorch-lightning_version": "2.6.6",
                "hyper_parameters": {**stranger_config(marker), "_instantiator": "builtins.open"}}, path)
    return path


def test_the_crafted_files_run_code_when_opened_the_old_way(tmp_path: Path) -> None:
    """The crafted files are real threats: without this project's checks each creates its marker."""
    from hydra.utils import instantiate

    marker = tmp_path / "pickle_ran"
    torch.load(pickled_model_file(tmp_path / "p.pt", marker, "prior"), weights_only=False)
    assert marker.exists()
    marker = tmp_path / "target_ran"
    blob = torch.load(target_model_file(tmp_path / "t.pt", marker, "prior"), weights_only=True)  # data only...
    assert not marker.exists()
    instantiate(blob["config"]).close()  # ...until its config is built
    assert marker.exists()


@pytest.fixture(scope="module")
def work(tiny_artifacts: Path, tiny_world: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("files_are_data")
    for name in ("tokenizer.json", "dvae.pt", "prior.pt"):
        shutil.copy(tiny_artifacts / name, work / name)
    (work / "world").symlink_to(tiny_world / "world")
    return work


# app | the key the crafted file is passed as | the stage it poses as | the other overrides
SITES = [
    ("generate", "prior", "prior", ["clip=null", "num_candidates=1"]),
    ("generate", "dvae", "dvae", ["clip=null", "num_candidates=1"]),
    ("generate", "clip", "clip", ["num_candidates=1"]),
    ("encode", "dvae", "dvae", ["force=true"]),
    ("eval", "prior", "prior", ["clip=null", "fid=false", "n_seen=1", "n_zeroshot=1", "candidates=[1]"]),
    ("train", "paths.dvae", "dvae", ["stage=prior"]),
    # the FID callback's feature extractor and contrastive scorer: the project's CLIP, read before training
    ("train", "paths.clip", "clip", ["stage=prior", "stage.force=true"]),
]


@pytest.mark.parametrize("kind", ["pickle", "target"])
@pytest.mark.parametrize("app,key,stage,extra", SITES, ids=[f"{a}:{k}" for a, k, _, _ in SITES])
def test_a_crafted_model_file_is_refused_in_one_line(app: str, key: str, stage: str, extra: list[str], kind: str,
                                                     work: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    make = pickled_model_file if kind == "pickle" else target_model_file
    crafted = make(tmp_path / f"{stage}.pt", marker, stage)
    outputs = {"encode": [f"out_dir={tmp_path / 'tokens'}"], "generate": [f"out_dir={tmp_path / 'samples'}"],
               "eval": [f"out={tmp_path / 'eval.json'}", "plot=null"], "train": [f"output={tmp_path / 'out.pt'}"]}
    args = [f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", *outputs[app], *extra, f"{key}={crafted}"]
    _assert_refused(app, args, crafted, "builtins.open" if kind == "target" else "the global io.open", capsys)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["pickle", "target"])
def test_a_crafted_resume_checkpoint_is_refused_in_one_line(kind: str, work: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "ran"
    make = pickled_checkpoint if kind == "pickle" else target_checkpoint
    crafted = make(tmp_path / "last.ckpt", marker)
    args = [f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", "stage=dvae", f"output={tmp_path / 'o.pt'}",
            f"resume={crafted}"]
    _assert_refused("train", args, crafted, "builtins.open" if kind == "target" else "the global io.open", capsys)
    assert not marker.exists()


def _assert_refused(app: str, args: list[str], crafted: Path, names: str, capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import encode, evaluate, generate, train

    main = {"train": train.main, "encode": encode.main, "generate": generate.main, "eval": evaluate.main}[app]
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, *args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, err
    assert repr(str(crafted)) in errors[0] and names in errors[0], errors[0]
    assert "Traceback" not in err


def test_the_inception_weights_are_read_as_data(tmp_path: Path) -> None:
    """The FID callback's Inception weights (torch-fidelity reads them with weights_only=False): a payload is one
    line naming the file and the global; torch-fidelity's own read is forced to weights_only=True."""
    pytest.importorskip("torch_fidelity")
    from dalle_lightning_callbacks.fid import build_fid
    from dalle_lightning_callbacks.inception import weights_only_loads

    marker = tmp_path / "ran"
    crafted = tmp_path / "weights-inception.pth"
    torch.save({"conv.weight": torch.zeros(1), "x": Payload(marker)}, crafted)
    with pytest.raises(ValueError, match=r"^Inception weights file '.*weights-inception.pth' asks for the global "
                                         r"io\.open,") as info:
        build_fid(inception_weights=str(crafted))
    assert len(str(info.value).splitlines()) == 1
    with weights_only_loads(), pytest.raises(Exception, match="Weights only load failed"):
        torch.load(crafted, weights_only=False)  # what torch-fidelity asks for, refused inside
    assert not marker.exists()


def _openai_files(tmp_path: Path) -> tuple[Path, Path]:
    from tests.test_dvae_convert import openai_small

    enc, dec = openai_small()
    torch.save(enc, tmp_path / "encoder.pkl")  # OpenAI's layout: whole pickled dall_e modules
    torch.save(dec, tmp_path / "decoder.pkl")
    return tmp_path / "encoder.pkl", tmp_path / "decoder.pkl"


def test_openai_dvae_in_its_released_layout_loads_through_the_allow_list(tmp_path: Path) -> None:
    pytest.importorskip("dall_e")
    from dalle_lightning.models.dvae_convert import load_openai_files
    from tests.test_dvae_convert import openai_small, ours_small

    enc, dec = openai_small()
    encoder, decoder = _openai_files(tmp_path)
    model = load_openai_files(ours_small(), encoder, decoder)
    torch.testing.assert_close(model.encoder.blocks.output.conv.bias, enc.blocks.output.conv.b, rtol=0, atol=0)
    torch.testing.assert_close(model.decoder.blocks.input.weight, dec.blocks.input.w, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["pickle", "pickle-inside-a-dall_e-module", "target"])
def test_a_crafted_openai_dvae_file_is_refused_in_one_line(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("dall_e")
    from dalle_lightning.models.dvae_convert import load_openai_files
    from tests.test_dvae_convert import openai_small, ours_small

    marker = tmp_path / "ran"
    encoder, decoder = _openai_files(tmp_path)
    crafted = tmp_path / "crafted.pkl"
    if kind == "pickle":
        torch.save({"blocks.input.w": torch.zeros(1), "x": Payload(marker)}, crafted)
    elif kind == "pickle-inside-a-dall_e-module":  # an allowed class may carry only allowed things
        enc = openai_small()[0]
        enc.blocks.extra = Payload(marker)
        torch.save(enc, crafted)
    else:
        torch.save(stranger_config(marker), crafted)
    for paths in ((crafted, decoder), (encoder, crafted)):
        with pytest.raises(ValueError) as info:
            load_openai_files(ours_small(), *paths)
        line = str(info.value)
        assert len(line.splitlines()) == 1 and repr(str(crafted)) in line, line
        assert ("asks for the global io.open" in line) if kind != "target" else ("holds a dict" in line), line
    assert not marker.exists()


def test_every_checkpoint_and_artifact_a_run_writes_loads_as_data(resume_work: Path, tmp_path: Path) -> None:
    """``last.ckpt``, the periodic checkpoints and the artifact of a training run load under
    ``torch.load(weights_only=True)``, and the artifact rebuilds through the allow-list."""
    from dalle_lightning.artifacts import load_artifact
    from dalle_lightning.cli import train
    from tests.resume_utils import train_args

    run_app(train.main, *train_args(resume_work, "dvae", "data_only", "callbacks.checkpoint.every_n_train_steps=4",
                                    "callbacks.checkpoint.save_top_k=-1"))
    checkpoints = sorted((resume_work / "runs" / "dvae" / "data_only" / "checkpoints").glob("*.ckpt"))
    assert len(checkpoints) >= 3 and any(p.name == "last.ckpt" for p in checkpoints), checkpoints
    for path in checkpoints:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        assert saved["global_step"] > 0
    model, meta = load_artifact(resume_work / "data_only.pt", stage="dvae")
    assert meta["stage"] == "dvae" and sum(p.numel() for p in model.parameters()) > 0


def test_an_old_file_holding_more_than_data_is_refused_then_converted_once(tiny_artifacts: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """A model file whose config is a DictConfig and whose metadata holds a Path (a hand-made file, say) is refused
    naming the global; ``python -m dalle_lightning.convert_artifact`` rewrites it as data with the same weights."""
    from omegaconf import OmegaConf

    from dalle_lightning import convert_artifact
    from dalle_lightning.artifacts import load_artifact, load_model, read_file
    from dalle_lightning.safe_files import UnsafeFile

    blob = read_file(tiny_artifacts / "dvae.pt")
    old = tmp_path / "old.pt"
    torch.save({**blob, "config": OmegaConf.create(blob["config"]), "meta": {**blob["meta"], "src": tmp_path}}, old)
    with pytest.raises(UnsafeFile, match=r"^dalle-lightning model file '.*old.pt' asks for the global omegaconf\.") as info:
        load_model(old)
    assert "python -m dalle_lightning.convert_artifact OLD NEW" in str(info.value)
    assert convert_artifact.main([str(old), str(tmp_path / "new.pt")]) == 0
    model, meta = load_artifact(tmp_path / "new.pt", stage="dvae")
    assert meta["src"] == str(tmp_path) and meta["sha256"] == blob["meta"]["sha256"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, blob["state_dict"][name]), name
    stranger = tmp_path / "stranger.pt"
    torch.save({**blob, "config": stranger_config(tmp_path / "ran")}, stranger)
    assert convert_artifact.main([str(stranger), str(tmp_path / "s.pt")]) == 2  # a target outside the allow-list
    assert "asks to build 'builtins.open'" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "s.pt").exists()
