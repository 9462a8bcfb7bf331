"""Stage artifacts: a trained model saved with the config that builds it, so later stages and tools load it
without knowing its hyper-parameters.

An artifact is a ``torch.save``d dict ``{"config": <Hydra _target_ dict>, "state_dict": ..., "meta": {...}}``.
``meta`` holds facts other stages read through config resolvers (a dVAE's vocabulary and grid size, a
tokenizer's vocabulary). Writes go to a temporary file renamed into place, so an interrupted save never
leaves a half-written artifact behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn


def atomic_save(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_model(
    path: str | Path,
    config: DictConfig | dict,
    model: nn.Module,
    meta: dict | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``model``'s weights (or ``state_dict``, e.g. gathered from shards) with the config that rebuilds it."""
    cfg = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else dict(config)
    source = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().cpu().contiguous() for k, v in source.items()}
    return atomic_save({"config": cfg, "state_dict": state, "meta": meta or {}}, path)


def _read(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist; train that stage first (dalle-train stage=...)")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(blob, dict) or "config" not in blob or "state_dict" not in blob:
        raise ValueError(f"{str(path)!r} is not a dalle-lightning model file; expected keys config, state_dict")
    return blob


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild and load a saved model (in eval mode)."""
    blob = _read(path)
    model = instantiate(blob["config"])
    model.load_state_dict(blob["state_dict"])
    return model.to(map_location).eval()


def load_frozen(model: nn.Module | str | Path) -> nn.Module:
    """A model (or the saved artifact at a path) in eval mode without gradients: a fixed helper of another stage's
    training, such as the dVAE that decodes images for the prior's FID or the CLIP's reconstructions."""
    module = load_model(model) if isinstance(model, (str, Path)) else model
    return module.eval().requires_grad_(False)


def read_meta(path: str | Path, key: str) -> Any:
    """One metadata value of a saved model, or of a ``tokenizer.json`` (``vocab_size``)."""
    path = Path(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist; run `dalle-train stage=tokenizer` first")
        if key != "vocab_size":
            raise KeyError(f"tokenizer files only provide vocab_size, not {key!r}")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab_size()
    meta = _read(path)["meta"]
    if key not in meta:
        raise KeyError(f"{str(path)!r} has no metadata {key!r}; it has {sorted(meta)}")
    return meta[key]


def register_resolvers() -> None:
    """``${meta:PATH,KEY}`` in configs reads a value from an earlier stage's artifact."""
    if not OmegaConf.has_resolver("meta"):
        OmegaConf.register_new_resolver("meta", lambda path, key: read_meta(path, key))


def write_json(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
