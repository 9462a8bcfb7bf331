"""Model files are safetensors with typed values (issue 69, deliverable 2): what ``save_model`` writes opens in any
safetensors reader (``safetensors.torch.load_file``) with the same tensors, its config and metadata are JSON in the
header, a value of the wrong type is refused naming the key, a file written before (``torch.save``) still opens as
data with the same digest, and ``convert_artifact`` rewrites such a file as safetensors without unpickling it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import TINY_DVAE_CONFIG

META = {"stage": "dvae", "vocab_size": 32, "grid_size": 8, "image_size": 64}


def _tiny_dvae() -> torch.nn.Module:
    from hydra.utils import instantiate

    torch.manual_seed(0)
    return instantiate(TINY_DVAE_CONFIG)


def test_a_saved_model_is_safetensors_with_equal_tensors_and_typed_meta(tmp_path: Path) -> None:
    from dalle_lightning.artifacts import load_artifact, read_meta, save_model, weights_digest

    model = _tiny_dvae()
    path = save_model(tmp_path / "dvae.pt", TINY_DVAE_CONFIG, model, meta=META)
    assert path.read_bytes()[:2] != b"PK"  # not a torch zip
    tensors = load_file(path)  # the ecosystem's reader, alone
    want = model.state_dict()
    assert sorted(tensors) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(tensors[name], tensor) and tensors[name].dtype == tensor.dtype, name
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
    assert json.loads(header["config"]) == TINY_DVAE_CONFIG
    assert json.loads(header["meta"]) == {**META, "sha256": weights_digest(want)}
    loaded, meta = load_artifact(path, stage="dvae")
    for name, tensor in want.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert meta["sha256"] == weights_digest(want) and meta["vocab_size"] == 32
    for key, value in (("vocab_size", 32), ("grid_size", 8), ("image_size", 64)):
        got = read_meta(path, key)
        assert type(got) is int and got == value


def test_a_file_written_before_still_opens_as_data_with_the_same_digest(tmp_path: Path) -> None:
    from dalle_lightning.artifacts import load_artifact, read_meta, save_model, weights_digest

    model = _tiny_dvae()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    old = tmp_path / "old.pt"  # the layout save_model wrote before: a torch.save zip of plain values
    torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": state, "meta": dict(META)}, old)
    assert old.read_bytes()[:2] == b"PK"
    loaded, meta = load_artifact(old, stage="dvae")
    new, new_meta = load_artifact(save_model(tmp_path / "new.pt", TINY_DVAE_CONFIG, model, meta=META), stage="dvae")
    assert meta["sha256"] == new_meta["sha256"] == weights_digest(state)
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor) and torch.equal(new.state_dict()[name], tensor)
    assert read_meta(old, "grid_size") == 8


def test_tied_weights_are_written_once_each_and_load_back(tmp_path: Path) -> None:
    """safetensors refuses tensors sharing memory; a tied or viewed weight is written as its own copy. (Tensors
    the model does not have make a file no reader accepts: ``read_file`` checks them against the model's.)"""
    from dalle_lightning import model_file_format
    from dalle_lightning.artifacts import read_file, save_model

    model = _tiny_dvae()
    state = dict(model.state_dict())
    first = next(k for k, v in state.items() if v.dim() == 4)
    state["tied"] = state[first]  # the same tensor under two names
    state["view"] = state[first][0]  # part of another tensor's storage
    read = model_file_format.read_tensors(save_model(tmp_path / "m.pt", TINY_DVAE_CONFIG, model, meta=META,
                                                     state_dict=state))
    assert torch.equal(read["tied"], state[first])
    assert torch.equal(read["view"], state[first][0])
    with pytest.raises(ValueError, match=r"its tensors are not those of .* \(2 unexpected, first 'tied'\)"):
        read_file(tmp_path / "m.pt")


@pytest.mark.parametrize("meta,key,expected", [
    ({"vocab_size": "32"}, "meta.vocab_size", "expected a positive int"),
    ({"grid_size": True}, "meta.grid_size", "expected a positive int"),
    ({"image_size": 64.0}, "meta.image_size", "expected a positive int"),
    ({"stage": "tokenizer"}, "meta.stage", "expected one of"),
    ({"sha256": "x"}, "meta.sha256", "expected a SHA-256 digest"),
    ({"trained_with": {"dvae": {"vocab_size": [32]}}}, "meta.trained_with.dvae.vocab_size", "positive int"),
])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(meta: dict, key: str, expected: str, fmt: str,
                                                            tmp_path: Path) -> None:
    from dalle_lightning.artifacts import read_meta, read_record
    from dalle_lightning.safe_files import UnsafeFile

    state = {k: v.contiguous() for k, v in _tiny_dvae().state_dict().items()}
    path = tmp_path / "dvae.pt"
    if fmt == "torch":
        torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": state, "meta": {**META, **meta}}, path)
    else:
        save_file(state, path, metadata={"dalle_lightning_model_file": "1", "config": json.dumps(TINY_DVAE_CONFIG),
                                         "meta": json.dumps({**META, **meta})})
    for read in (read_record, lambda p: read_meta(p, "grid_size")):
        with pytest.raises(UnsafeFile) as info:
            read(path)
        line = str(info.value)
        assert line.startswith(f"{str(path)!r}: {key}=") and expected in line and "\n" not in line, line


@pytest.mark.parametrize("change,key,expected", [
    ({"n_hid": "8"}, "config.n_hid", "expected int"),
    ({"eps": None}, "config.eps", "expected float"),
    ({"compile": ["x"]}, "config.compile", "expected"),
    ({"stranger": 1}, "config.stranger", "is not an argument of dalle_lightning.models.dvae.DiscreteVAE"),
])
def test_a_config_value_is_of_the_type_the_model_takes(change: dict, key: str, expected: str, tmp_path: Path) -> None:
    """The building config's types are the model class's own annotations: checked at the write and at the read."""
    from dalle_lightning.artifacts import read_record, save_model
    from dalle_lightning.safe_files import UnsafeFile

    model = _tiny_dvae()
    with pytest.raises(UnsafeFile, match=rf"^'.*w\.pt': {key}.*{expected}"):
        save_model(tmp_path / "w.pt", {**TINY_DVAE_CONFIG, **change}, model, meta=META)
    assert not (tmp_path / "w.pt").exists()
    torch.save({"config": {**TINY_DVAE_CONFIG, **change}, "state_dict": model.state_dict(), "meta": META},
               tmp_path / "r.pt")
    with pytest.raises(UnsafeFile, match=rf"^'.*r\.pt': {key}.*{expected}"):
        read_record(tmp_path / "r.pt")


def test_meta_resolver_and_tokenizer_give_ints(tiny_artifacts: Path) -> None:
    from omegaconf import OmegaConf

    from dalle_lightning.artifacts import read_meta, register_resolvers

    register_resolvers()
    cfg = OmegaConf.create({"d": str(tiny_artifacts / "dvae.pt"), "t": str(tiny_artifacts / "tokenizer.json"),
                            "v": "${meta:${d},vocab_size}", "g": "${meta:${d},grid_size}",
                            "tv": "${meta:${t},vocab_size}", "tl": "${meta:${t},text_len}"})
    values = OmegaConf.to_container(cfg, resolve=True)
    assert [values[k] for k in ("v", "g", "tl")] == [32, 8, 20]
    assert all(type(values[k]) is int for k in ("v", "g", "tv", "tl"))
    with pytest.raises(KeyError, match="reads the sizes"):
        read_meta(tiny_artifacts / "dvae.pt", "sha256")  # a str key is never served to a config


def test_convert_rewrites_an_old_file_as_safetensors(tmp_path: Path) -> None:
    from dalle_lightning import convert_artifact
    from dalle_lightning.artifacts import read_file, weights_digest

    model = _tiny_dvae()
    old = tmp_path / "old.pt"
    torch.save({"config": dict(TINY_DVAE_CONFIG), "state_dict": model.state_dict(), "meta": dict(META)}, old)
    assert convert_artifact.main([str(old), str(tmp_path / "new.pt")]) == 0
    assert convert_artifact.main([str(tmp_path / "new.pt"), str(tmp_path / "again.pt")]) == 0  # read as data
    for name in ("new.pt", "again.pt"):
        tensors = load_file(tmp_path / name)
        assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
    assert read_file(tmp_path / "again.pt")["meta"] == {**META, "sha256": weights_digest(model.state_dict())}


def test_a_foreign_or_broken_safetensors_file_is_one_line(tmp_path: Path) -> None:
    from dalle_lightning.artifacts import read_record

    save_file({"w": torch.zeros(2)}, tmp_path / "plain.safetensors")  # someone's weights, no dalle-lightning header
    with pytest.raises(ValueError, match=r"^'.*plain\.safetensors' is a safetensors file but not a dalle-lightning"):
        read_record(tmp_path / "plain.safetensors")
    whole = (tmp_path / "plain.safetensors").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) - 4])
    with pytest.raises(ValueError, match=r"^'.*cut\.pt' is not a readable safetensors file") as info:
        read_record(tmp_path / "cut.pt")
    assert "\n" not in str(info.value)
