"""Stage artifacts: a trained model saved with the config that builds it, so later stages and tools load it
without knowing its hyper-parameters.

An artifact is a ``torch.save``d dict ``{"config": <Hydra _target_ dict>, "state_dict": ..., "meta": {...}}`` of
tensors and plain JSON values only: it is read with ``torch.load(weights_only=True)``, its config and metadata are
checked to be plain values, and its ``_target_`` must be one of the project's models (:mod:`dalle_lightning.model_targets`),
so opening a model file someone else made never runs code from it (:mod:`dalle_lightning.safe_files`).
``meta`` holds facts other stages read through config resolvers (a dVAE's vocabulary and grid size, a
tokenizer's vocabulary) and ``sha256``, the digest of the weights that later artifacts record (``lineage``).
Only finite weights are written: a diverged run must not leave a file that later stages take for a trained
model. Writes go through ``dalle_lightning_plugins.io.atomic_files`` (a temporary file renamed into place), so an interrupted save never leaves a half-written
artifact behind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dalle_lightning.model_targets import build_model, checked_config
from dalle_lightning.safe_files import check_plain, read_data
from dalle_lightning_plugins.io.atomic_files import torch_save

# Which model class each stage saves (for files whose metadata predates the ``stage`` field).
STAGE_TARGETS = {"dvae": ".models.dvae.", "prior": ".models.prior.", "clip": ".models.clip."}


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the weights (names, dtypes, shapes, values): the same for every save of the same model."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
    check_finite(state, path)
    meta = dict(meta or {})
    check_plain({"config": cfg, "meta": meta}, path, "artifact")  # what is written loads as data
    return torch_save({"config": cfg, "state_dict": state, "meta": {**(meta or {}), "sha256": weights_digest(state)}}, path)


def check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Raise a one-line ``FloatingPointError`` naming the tensors with NaN or Inf values: nothing is written."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise FloatingPointError(
            f"not writing {str(path)!r}: {len(bad)} of {len(state)} weight tensors hold NaN or Inf "
            f"(first: {bad[0]}); expected finite weights (the run diverged: lower the learning rate)"
        )


CONVERT = "convert a file you trust once: python -m dalle_lightning.convert_artifact OLD NEW"


def _read(path: str | Path) -> dict:
    """A model file's contents, read as data: tensors under ``state_dict``, plain values under ``config`` and
    ``meta``; anything that asks for more is a one-line :class:`~dalle_lightning.safe_files.UnsafeFile`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist; train that stage first (dalle-train stage=...)")
    blob = read_data(path, "dalle-lightning model file", CONVERT, "a file written by dalle-train")
    if not isinstance(blob, dict) or "config" not in blob or "state_dict" not in blob:
        raise ValueError(f"{str(path)!r} is not a dalle-lightning model file; expected keys config, state_dict")
    state = blob["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"{str(path)!r}: state_dict is not a dict of named tensors; expected a file written by "
                         "dalle-train")
    check_plain({"config": blob["config"], "meta": blob.get("meta") or {}}, path, "artifact")
    checked_config(blob["config"], path)  # a stranger's _target_ is refused at the first read, not at the build
    return blob


def _meta(blob: dict) -> dict[str, Any]:
    """An artifact's metadata, completed for files written before a field existed (digest, stage)."""
    meta = dict(blob.get("meta") or {})
    meta.setdefault("sha256", weights_digest(blob["state_dict"]))
    target = str(blob["config"].get("_target_", ""))
    stage = next((name for name, part in STAGE_TARGETS.items() if part in target), None)
    if stage is not None:
        meta.setdefault("stage", stage)
    for key in ("image_size", "text_len"):  # sizes later stages read: the building config has them too
        value = blob["config"].get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            meta.setdefault(key, value)
    return meta


def _check_stage(meta: dict[str, Any], path: str | Path, stage: str | None, key: str | None) -> dict[str, Any]:
    if stage is not None and meta.get("stage", stage) != stage:
        raise ValueError(f"{key or 'model'}={str(path)!r} is a {meta['stage']} model; expected a {stage} model "
                         f"(written by dalle-train stage={stage})")
    return meta


def read_record(path: str | Path, stage: str | None = None, key: str | None = None) -> dict[str, Any]:
    """The metadata of a saved model; with ``stage``, a one-line error (naming ``key``) unless it is that stage's."""
    return _check_stage(_meta(_read(path)), path, stage, key)


def load_artifact(path: str | Path, map_location: str | torch.device = "cpu", stage: str | None = None,
                  key: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild and load a saved model (in eval mode) and its metadata, with ``sha256`` even for older files.

    With ``stage``, a file of another stage is a one-line error naming ``key`` before anything is built.
    """
    blob = _read(path)
    meta = _check_stage(_meta(blob), path, stage, key)
    model = build_model(blob["config"], path)  # the project's model classes only
    model.load_state_dict(blob["state_dict"])
    return model.to(map_location).eval(), meta


def load_model(path: str | Path, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild and load a saved model (in eval mode)."""
    return load_artifact(path, map_location)[0]


def load_frozen(model: nn.Module | str | Path) -> nn.Module:
    """A model (or the saved artifact at a path) in eval mode without gradients: a fixed helper of another stage's
    training, such as the dVAE that decodes images for the prior's FID or the CLIP's reconstructions."""
    module = load_model(model) if isinstance(model, (str, Path)) else model
    return module.eval().requires_grad_(False)


def read_meta(path: str | Path, key: str) -> Any:
    """One metadata value of a saved model, or of a ``tokenizer.json`` (``vocab_size``, ``text_len``)."""
    path = Path(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist; run `dalle-train stage=tokenizer` first")
        from tokenizers import Tokenizer

        from dalle_lightning.data.tokenizer import recorded_text_len

        tokenizer = Tokenizer.from_file(str(path))
        if key == "vocab_size":
            return tokenizer.get_vocab_size()
        if key == "text_len":
            length = recorded_text_len(tokenizer)
            if length is None:
                raise KeyError(f"tokenizer {str(path)!r} records no text_len (written before tokenizers recorded it); "
                               "expected one: retrain it (dalle-train stage=tokenizer stage.force=true) or set the "
                               "caption length explicitly (model.text_len=N for the prior, text_len=N for dalle-encode)")
            return length
        raise KeyError(f"tokenizer files provide vocab_size and text_len, not {key!r}")
    meta = _meta(_read(path))
    if key not in meta:
        raise KeyError(f"{str(path)!r} has no metadata {key!r}; it has {sorted(meta)}")
    return meta[key]


def register_resolvers() -> None:
    """``${meta:PATH,KEY}`` in configs reads a value from an earlier stage's artifact."""
    if not OmegaConf.has_resolver("meta"):
        OmegaConf.register_new_resolver("meta", lambda path, key: read_meta(path, key))
