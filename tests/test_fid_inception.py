"""The standard Inception FID (``features="inception"``, the ``fid`` extra) without any download: the network is
torch-fidelity's Inception-v3 architecture with random weights written to a local file, read through
torchmetrics' ``NoTrainInceptionV3`` from torch's hub cache or an explicit path; a missing file is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dalle_lightning_callbacks.fid import FIDCallback
from dalle_lightning_callbacks.inception import default_weights_path
from tests.test_fid import Generating, val_images

WEIGHTS = "weights-inception-2015-12-05-6726825d.pth"  # the file name torch-fidelity's release download has


def random_inception_weights(path: Path) -> dict[str, torch.Tensor]:
    """Inception-v3 as torch-fidelity builds it, randomly initialised, saved as a state dict at ``path``.
    Convolutions get variance-preserving weights so 2048-d features neither vanish nor blow up over 90 layers."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class Untrained(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # keep the random initialisation
            return None

    path.parent.mkdir(parents=True, exist_ok=True)
    placeholder = path.with_name("placeholder.pth")
    torch.save({}, placeholder)
    torch.manual_seed(0)
    net = Untrained("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(placeholder))
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(state, path)
    placeholder.unlink()
    return state


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TORCH_HOME whose hub cache holds the (random) Inception weights where torch-fidelity would put them."""
    home = tmp_path_factory.mktemp("torch_home")
    random_inception_weights(home / "hub" / "checkpoints" / WEIGHTS)
    return home


class Copying(Generating):
    """'Generates' exactly the real images: FID against itself."""

    def fid_generate(self, batch: dict) -> torch.Tensor:
        return batch["image"].clone()


@pytest.mark.parametrize("dim", [192, pytest.param(2048, marks=pytest.mark.slow)])  # 2048: torchmetrics' 2048-d
def test_inception_fid_is_zero_on_the_same_set_and_larger_on_a_shifted_one(  # eigen-solve alone takes ~8 s on CPU
        dim: int, torch_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchmetrics.image.fid import NoTrainInceptionV3

    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    cb = FIDCallback(num_images=6, features="inception", feature_dim=dim,
                     feature_extractor=lambda x: x.mean(dim=(2, 3)))  # ignored: features=inception replaces it
    assert cb.metric_name == "val/fid_inception"
    assert isinstance(cb.fid.inception, NoTrainInceptionV3) and cb.fid.inception.features_list == [str(dim)]
    saved = torch.load(torch_home / "hub" / "checkpoints" / WEIGHTS)
    for key in ("Conv2d_1a_3x3.conv.weight", "Mixed_7c.branch_pool.conv.weight"):  # read from the hub cache
        torch.testing.assert_close(cb.fid.inception.state_dict()[key], saved[key], rtol=0, atol=0)

    images = val_images()[:6]
    batch = {"image": images, "text": [f"c{i}" for i in range(6)]}
    cb.update(Copying(), batch)
    same = cb.compute()["val/fid_inception"]
    cb.update(Generating(), batch)  # the darkened images: a shifted set
    shifted = cb.compute()["val/fid_inception"]
    assert shifted > 0 and abs(same) < 1e-6 * shifted, (same, shifted)


def test_explicit_weights_path_and_one_line_errors(torch_home: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    empty_home = tmp_path / "empty_home"
    monkeypatch.setenv("TORCH_HOME", str(empty_home))
    expected = empty_home / "hub" / "checkpoints" / WEIGHTS
    assert default_weights_path() == expected
    with pytest.raises(FileNotFoundError) as missing:
        FIDCallback(features="inception")
    message = str(missing.value)
    assert "\n" not in message and str(expected) in message and WEIGHTS in message and "inception_weights" in message
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        FIDCallback(features="inception", inception_weights=str(tmp_path / "nope.pth"))
    # An explicit file is used as it is, wherever it lies.
    cb = FIDCallback(features="inception", inception_weights=str(torch_home / "hub" / "checkpoints" / WEIGHTS))
    assert cb.fid.inception.Conv2d_1a_3x3.conv.weight.abs().sum() > 0
