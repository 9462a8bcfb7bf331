"""Where the standard FID's Inception-v3 weights are read from, without ever downloading them.

FID as papers report it uses the TensorFlow Inception-v3 of 2015 that torch-fidelity ships converted to PyTorch;
torchmetrics' ``FrechetInceptionDistance`` builds that network (``NoTrainInceptionV3``) and, given no file,
downloads the weights. Training jobs often run without network access, and a download in the middle of a
validation is a poor way to find that out, so the weights are always read from a local file:

- ``path`` when given;
- otherwise the file torch-fidelity's own download leaves in torch's hub cache,
  ``$TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth`` (``TORCH_HOME`` defaults to
  ``~/.cache/torch``), so a machine that ever computed FID with torch-fidelity already has it.

A missing file or a missing torch-fidelity is one line saying what to install or which file to put where.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

INCEPTION = "inception"  # the name of this feature space in metric names (``val/fid_inception``)


def _weights_url() -> str:
    """The release file torch-fidelity downloads (its name is what the hub cache holds)."""
    if importlib.util.find_spec("torch_fidelity") is None:
        raise ModuleNotFoundError("features='inception' needs torch-fidelity; install it (pip install torch-fidelity, "
                                  "or this project's fid extra: pip install -e '.[fid]')")
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    return URL_INCEPTION_V3


def default_weights_path() -> Path:
    """The hub-cache file that torch-fidelity's download writes and later runs read."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(_weights_url())


def inception_weights(path: str | os.PathLike | None = None) -> str:
    """The local Inception-v3 weights file to use: ``path``, or the hub-cache file; one-line error when absent."""
    url = _weights_url()
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Inception weights file {str(path)!r} does not exist; expected a local copy of {url}")
        return str(path)
    default = default_weights_path()
    if not default.is_file():
        raise FileNotFoundError(f"Inception-v3 weights not found at {default}; download {url} to that path "
                                "(or set inception_weights to a local copy)")
    return str(default)
