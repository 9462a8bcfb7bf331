"""A model file's values stay values (issue 69, way 1): a dVAE file that loads as data, whose ``_target_`` is the
project's own ``DiscreteVAE``, but whose ``meta.vocab_size`` (or ``image_size``) is an OmegaConf expression, is
refused at every command that reads it through ``${meta:...}``: exit code 2, one line naming the file and the key,
no marker file from the expression's pickle, no environment variable printed. Both file formats: the ``torch.save``
zip written before, and safetensors with a crafted header. The expressions are first shown to be potent: resolved
and built the way a config would, one creates its marker and the other reads the variable.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from tests.conftest import TINY_DVAE_CONFIG, run_app
from tests.test_files_are_data import Payload, work  # noqa: F401 - work: the pipeline the commands run on

SECRET = "DALLE_TEST_SECRET_69"
SECRET_VALUE = "s3cret-value-never-printed"


def create_payload(marker: Path) -> str:
    """The issue's string: ``oc.create`` of a config that, once built, unpickles a payload creating ``marker``."""
    hexed = pickle.dumps(Payload(marker)).hex()
    return ("${oc.create:{_target_: torch.load, weights_only: false, f: {_target_: io.BytesIO, initial_bytes: "
            "{_target_: builtins.bytes.fromhex, _args_: ['" + hexed + "']}}}}")


EXPRESSIONS = {"create": create_payload, "env": lambda marker: f"${{oc.env:{SECRET}}}"}


def test_the_expressions_are_potent_when_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved by OmegaConf and built by Hydra, as ``conf/data/tokens.yaml`` did with a copied size, the first
    expression runs the pickle and the second reads the variable: the refusals below are of real threats."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    marker = tmp_path / "ran"
    cfg = OmegaConf.create({"data": {"size": create_payload(marker)}})
    with pytest.raises(InstantiationException, match="Invalid magic number"):  # torch.load ran the pickle first
        instantiate(cfg.data)
    assert marker.exists()
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    assert OmegaConf.create({"size": EXPRESSIONS["env"](marker)}).size == SECRET_VALUE


def _dvae_blob(key: str, value: str) -> dict[str, Any]:
    from hydra.utils import instantiate

    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in instantiate(TINY_DVAE_CONFIG).state_dict().items()}
    meta = {"stage": "dvae", "vocab_size": 32, "grid_size": 8, "image_size": 64, key: value}
    return {"config": dict(TINY_DVAE_CONFIG), "state_dict": state, "meta": meta}


def crafted_dvae(path: Path, key: str, value: str, fmt: str) -> Path:
    """A dVAE file of plain values and real weights (it loads under weights_only=True, or in any safetensors
    reader), whose ``meta[key]`` is ``value``."""
    blob = _dvae_blob(key, value)
    if fmt == "torch":
        torch.save(blob, path)
    else:
        header = {"format": "pt", "dalle_lightning_model_file": "1", "config": json.dumps(blob["config"]),
                  "meta": json.dumps(blob["meta"])}
        save_file(blob["state_dict"], path, metadata=header)
    return path


# app | the key the crafted file is passed as | the meta key the command's config reads | other overrides
SITES = [
    ("train", "paths.dvae", "vocab_size", ["stage=prior"]),  # conf/model/prior_*.yaml, copied by conf/data/tokens.yaml
    ("train", "paths.dvae", "image_size", ["stage=clip"]),  # conf/data/clip.yaml
    ("encode", "dvae", "image_size", ["force=true"]),  # conf/encode.yaml
]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("expression", sorted(EXPRESSIONS))
@pytest.mark.parametrize("app,key,meta_key,extra", SITES, ids=[f"{a}:{x[0]}:{m}" for a, _, m, x in SITES])
def test_a_stored_expression_is_refused_in_one_line(app: str, key: str, meta_key: str, extra: list[str],
                                                    expression: str, fmt: str, work: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from dalle_lightning.cli import encode, train

    monkeypatch.setenv(SECRET, SECRET_VALUE)
    marker = tmp_path / "ran"
    crafted = crafted_dvae(tmp_path / "dvae.pt", meta_key, EXPRESSIONS[expression](marker), fmt)
    outputs = {"encode": [f"out_dir={tmp_path / 'tokens'}"], "train": [f"output={tmp_path / 'out.pt'}"]}
    args = [f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", *outputs[app], *extra, f"{key}={crafted}"]
    with pytest.raises(SystemExit) as exit_info:
        run_app({"train": train.main, "encode": encode.main}[app], *args)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1, err
    assert repr(str(crafted)) in errors[0] and f"meta.{meta_key}" in errors[0] and "'${'" in errors[0], errors[0]
    assert "raised while resolving" not in errors[0]  # the file's own line, not OmegaConf's wrapping
    assert "Traceback" not in err and SECRET_VALUE not in out + err
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "tokens").exists()


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_expression_anywhere_in_config_or_meta_is_refused_at_the_read(fmt: str, tmp_path: Path) -> None:
    """Not only the sizes: a string holding ``${`` in any key of ``meta`` (nested too) or ``config`` is refused
    by every reader, naming the key; nothing is resolved."""
    from dalle_lightning.artifacts import load_artifact, read_record
    from dalle_lightning.safe_files import UnsafeFile

    path = crafted_dvae(tmp_path / "a.pt", "trained_with", {"dvae": {"note": "x ${oc.env:HOME} y"}}, fmt)
    for read in (read_record, load_artifact):
        with pytest.raises(UnsafeFile, match=r"^'.*a\.pt': meta\.trained_with\.dvae\.note is a string holding "):
            read(path)
    blob = _dvae_blob("stage", "dvae")
    torch.save({**blob, "config": {**blob["config"], "n_hid": "${oc.env:HOME}"}}, tmp_path / "c.pt")
    with pytest.raises(UnsafeFile, match=r"^'.*c\.pt': config\.n_hid is a string holding '\$\{' \('\$\{oc\.env:HOME"):
        read_record(tmp_path / "c.pt")
