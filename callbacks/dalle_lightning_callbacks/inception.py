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

torch-fidelity reads the file with ``torch.load(weights_only=False)``, which would run any code a crafted file
carries. So the file is first read here as data (``weights_only=True``; a file that asks for a global is one line
naming it), and torch-fidelity's own read runs inside :func:`weights_only_loads`, torch's documented switch
(``TORCH_FORCE_WEIGHTS_ONLY_LOAD``) that makes every ``torch.load`` in it restricted, whatever the caller passed:
a file swapped between the two reads is refused too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch

from dalle_lightning_plugins.environments.elastic import environment

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
        return check_weights(path)
    default = default_weights_path()
    if not default.is_file():
        raise FileNotFoundError(f"Inception-v3 weights not found at {default}; download {url} to that path "
                                "(or set inception_weights to a local copy)")
    return check_weights(default)


FORCE_ENV, NO_FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def check_weights(path: str | os.PathLike) -> str:
    """``path`` when it holds tensors and plain values only; else one ``ValueError`` line naming it and the global
    its pickle asked for (nothing of it runs: torch's restricted unpickler refuses before calling anything)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        asked = text.split("GLOBAL ", 1)[1].split()[0] if "GLOBAL " in text else "more than tensors"
        raise ValueError(f"Inception weights file {str(path)!r} asks for the global {asked}, which could run code "
                         "when opened, so it was not opened; expected a state dict of tensors (torch-fidelity's "
                         f"{os.path.basename(_weights_url())})") from None
    except RuntimeError as exc:
        raise ValueError(f"Inception weights file {str(path)!r} is not a torch save ({str(exc).splitlines()[0][:120]}); "
                         f"expected a local copy of {_weights_url()}") from None
    return str(path)


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` inside reads as data (``weights_only=True``), even one that asks for ``False``
    (torch-fidelity's): torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, read at each call; the environment is put back
    after. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, which torch refuses beside it, is lifted for the duration."""
    with environment({FORCE_ENV: "1", NO_FORCE_ENV: None}):
        yield
