"""The only things a model file may ask to have built: the project's own model classes.

A model file carries the config that rebuilds its model (``{"_target_": "dalle_lightning.models.dvae.DiscreteVAE",
"image_size": 64, ...}``). Handed to Hydra's ``instantiate``, such a config runs whatever importable callable its
``_target_`` names (``builtins.open``, ``os.system``), with arguments the file chose, and resolves ``${oc.env:...}``
interpolations in its values: a file that loads under ``weights_only=True`` could still run code. So a model file's
config is built here instead: its ``_target_`` must be one of :data:`MODEL_TARGETS`, every other key a plain
keyword argument (no nested ``_target_``, no Hydra ``_args_``/``_partial_``/... keys), every value a plain JSON value;
the class is then imported from this fixed list and called directly. Anything else is a one-line error naming the
file and the target, before anything is imported or built.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from dalle_lightning.safe_files import UnsafeFile, check_plain

# _target_ -> (module, attribute): every model class a stage saves (conf/model/*.yaml).
MODEL_TARGETS: dict[str, tuple[str, str]] = {
    "dalle_lightning.models.dvae.DiscreteVAE": ("dalle_lightning.models.dvae", "DiscreteVAE"),
    "dalle_lightning.models.dvae_vq.VQVAE": ("dalle_lightning.models.dvae_vq", "VQVAE"),
    "dalle_lightning.models.dvae_fsq.FSQVAE": ("dalle_lightning.models.dvae_fsq", "FSQVAE"),
    "dalle_lightning.models.prior.DallePrior": ("dalle_lightning.models.prior", "DallePrior"),
    "dalle_lightning.models.clip.create": ("dalle_lightning.models.clip", "create"),
}
CLIP_TARGET = "dalle_lightning.models.clip.create"


def checked_config(config: Any, path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """``(target, kwargs)`` of a model file's building config, or a one-line :class:`UnsafeFile` naming ``path``."""
    where = os.fspath(path)
    if not isinstance(config, Mapping):
        raise UnsafeFile(f"{where!r}: its config is a {type(config).__name__}; expected a dict with _target_ "
                         "(a file written by dalle-train)")
    target = config.get("_target_")
    if target not in MODEL_TARGETS:
        raise UnsafeFile(f"{where!r} asks to build {target!r}, which is not one of the project's models, so nothing "
                         f"was built; expected _target_ one of {sorted(MODEL_TARGETS)}")
    kwargs = {k: v for k, v in config.items() if k != "_target_"}
    for key, value in kwargs.items():
        if not isinstance(key, str) or key.startswith("_"):
            raise UnsafeFile(f"{where!r}: config key {key!r} for {target}; expected plain keyword arguments (no "
                             "Hydra _args_, _partial_, ... keys)")
        check_plain(value, path, f"config.{key}")
        if "_target_" in repr(value):
            raise UnsafeFile(f"{where!r}: config.{key} holds a nested _target_; expected plain keyword arguments "
                             f"of {target}")
    if target == CLIP_TARGET:
        name = kwargs.get("name", "")
        if isinstance(name, str) and name.startswith("hf-hub:"):
            raise UnsafeFile(f"{where!r}: config.name={name!r} would download a model; expected an open_clip "
                             "architecture name (its weights are the file's own)")
        # The file's own weights replace any pretrained ones: never open another file the config names.
        kwargs["pretrained"] = None
    return target, kwargs


def build_model(config: Any, path: str | os.PathLike) -> nn.Module:
    """The model a model file's config describes, built from the allow-list (see the module docstring)."""
    target, kwargs = checked_config(config, path)
    module, attribute = MODEL_TARGETS[target]
    return getattr(importlib.import_module(module), attribute)(**kwargs)
