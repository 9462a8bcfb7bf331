"""A model file names a model, never a place (issue 69): open_clip reads a ``local-dir:<dir>`` name from that folder
(its config and weights) and downloads an ``hf-hub:`` one. A CLIP file whose ``config.name`` is such a name (or a path,
a URL) is refused in one line naming the file and the key, exit code 2, before open_clip is called; so is a
checkpoint's ``open_clip_spec.name``, and ``dalle-eval``'s ``open_clip.model``.

The crafted file is first shown to be potent: handed to open_clip, its name builds the other folder's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dalle_lightning.models import clip as clip_models
from dalle_lightning.safe_files import UnsafeFile
from tests.conftest import run_app
from tests.test_eval_report import work  # noqa: F401  (the tiny saved pipeline, with clip.pt)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

PLACES = ["local-dir:{elsewhere}", "hf-hub:someone/model", "{elsewhere}", "https://example.com/model"]


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder in open_clip's local-dir layout holding a model of its own weights (a stranger's choice)."""
    torch.manual_seed(1)
    return clip_models.save(clip_models.create(), tmp_path_factory.mktemp("elsewhere"))


def crafted_clip(path: Path, name: str) -> Path:
    """A CLIP model file in the layout files were written in before (it still opens as data): tensors and plain
    values, the project's own target, and ``name`` for its model."""
    torch.manual_seed(0)
    state = clip_models.create().state_dict()
    torch.save({"config": {"_target_": "dalle_lightning.models.clip.create", "name": name}, "state_dict": state,
                "meta": {"stage": "clip"}}, path)
    return path


def test_a_local_dir_name_makes_open_clip_read_the_other_folder(elsewhere: Path) -> None:
    """The threat is real: the name alone builds the other folder's model, with its weights."""
    theirs = torch.load(elsewhere / clip_models.WEIGHTS_FILE, weights_only=True)
    built = clip_models.open_clip.create_model(f"local-dir:{elsewhere}")
    assert all(torch.equal(v, theirs[k]) for k, v in built.state_dict().items())


@pytest.mark.parametrize("app", ["generate", "eval"])
@pytest.mark.parametrize("place", PLACES)
def test_a_clip_file_naming_a_place_is_refused_at_the_command(app: str, place: str, elsewhere: Path,
                                                             work: Path, tmp_path: Path,  # noqa: F811
                                                             capsys: pytest.CaptureFixture) -> None:
    from dalle_lightning.cli import evaluate, generate

    name = place.format(elsewhere=elsewhere)
    crafted = crafted_clip(tmp_path / "clip.pt", name)
    args = {"generate": [f"out_dir={tmp_path / 'samples'}", "num_candidates=1", "prompts=[a red square]"],
            "eval": [f"out={tmp_path / 'eval.json'}", "plot=null", "fid=false", "n_seen=1", "n_zeroshot=1",
                     "candidates=[1]"]}[app]
    main = {"generate": generate.main, "eval": evaluate.main}[app]
    with pytest.raises(SystemExit) as exit_info:
        run_app(main, f"paths.work_dir={work}", f"hydra.run.dir={tmp_path / 'run'}", *args, f"clip={crafted}")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0] == (f"error: {str(crafted)!r}: config.name={name!r} names a place to read a model from (a "
                         "local-dir: or hf-hub: name, a path or a URL), not a model, so nothing was opened; expected "
                         "an open_clip model name such as 'shapes-clip' or 'ViT-B-32' (the file's own weights are the "
                         "model's)"), errors[0]
    assert not (tmp_path / "samples").exists() and not (tmp_path / "eval.json").exists()


def test_a_name_open_clip_does_not_know_is_refused(tmp_path: Path) -> None:
    from dalle_lightning.artifacts import load_model

    crafted = crafted_clip(tmp_path / "clip.pt", "no-such-net")
    with pytest.raises(UnsafeFile, match=r"config.name='no-such-net' is not an open_clip model known here; expected "
                                         r"one of open_clip.list_models\(\)"):
        load_model(crafted)
    assert isinstance(load_model(crafted_clip(tmp_path / "ok.pt", clip_models.SHAPES_CLIP)),
                      clip_models.open_clip.model.CLIP)  # a model's name loads


@pytest.mark.parametrize("place", PLACES)
def test_a_checkpoint_spec_naming_a_place_is_refused(place: str, elsewhere: Path, tmp_path: Path) -> None:
    """A ClipModule checkpoint carries its architecture (``open_clip_spec``); its name must be a name."""
    from dalle_lightning.generation.rerank import Reranker

    model = clip_models.create()
    name = place.format(elsewhere=elsewhere)
    spec = {**clip_models.spec_of(model), "name": name}
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"open_clip_spec": spec, "state_dict": state}, tmp_path / "clip.ckpt")
    with pytest.raises(UnsafeFile) as refused:
        Reranker.from_checkpoint(tmp_path / "clip.ckpt")
    assert str(refused.value).startswith(f"{str(tmp_path / 'clip.ckpt')!r}: open_clip_spec.name={name!r} names a "
                                         "place to read a model from")
    torch.save({"open_clip_spec": {**spec, "name": "my-clip"}, "state_dict": state}, tmp_path / "own.ckpt")
    rebuilt = Reranker.from_checkpoint(tmp_path / "own.ckpt").model  # a name unknown here: the spec's own config
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in rebuilt.state_dict().items())


@pytest.mark.parametrize("place", PLACES)
def test_open_clip_model_setting_is_a_name(place: str, elsewhere: Path) -> None:
    from dalle_lightning.evaluation.feature_spaces import check_open_clip

    name = place.format(elsewhere=elsewhere)
    weights = elsewhere / clip_models.WEIGHTS_FILE
    with pytest.raises(ValueError) as refused:
        check_open_clip({"model": name, "pretrained": str(weights)})
    assert str(refused.value) == (f"open_clip.model={name!r}; expected an open_clip architecture name (one of "
                                  "open_clip.list_models(), e.g. ViT-B-32)")
    assert check_open_clip({"model": clip_models.SHAPES_CLIP, "pretrained": str(weights)}) == (
        clip_models.SHAPES_CLIP, str(weights))
