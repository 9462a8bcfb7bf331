"""Stage artifacts: a trained model saved with the config that builds it, so later stages and tools load it
without knowing its hyper-parameters.

An artifact is a safetensors file (:mod:`dalle_lightning.model_file_format`) of the model's named tensors, with
``config`` (a Hydra ``_target_`` dict) and ``meta`` stored as JSON in its header; files written before, a
``torch.save``d dict ``{"config", "state_dict", "meta"}``, still open, with ``torch.load(weights_only=True)``
(:mod:`dalle_lightning.safe_files`). Either way its values are checked as typed data before anything uses them: no
string anywhere holds ``${`` (an OmegaConf expression a config would resolve), each metadata key has its type
(:mod:`dalle_lightning.artifact_schema`), and the config's ``_target_`` is one of the project's models with
arguments of the types its signature names (:mod:`dalle_lightning.model_targets`), so opening a model file someone
else made never runs code from it nor reads the environment for it.
``meta`` holds facts other stages read through the ``${meta:PATH,KEY}`` resolver (a dVAE's vocabulary and grid
size, a tokenizer's vocabulary: ints only) and ``sha256``, the digest of the weights that later artifacts record
(``lineage``). Only finite weights are written: a diverged run must not leave a file that later stages take for a
trained model. Writes go through ``dalle_lightning_plugins.io.atomic_files`` (a temporary file renamed into place),
so an interrupted save never leaves a half-written artifact behind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dalle_lightning import model_file_format
from dalle_lightning.artifact_schema import SIZE_KEYS, checked_meta, shown, size_value
from dalle_lightning.model_targets import build_model, checked_config, planned_model
from dalle_lightning.safe_files import UnsafeFile, check_plain, read_data

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
    check_plain({"config": cfg, "meta": dict(meta or {})}, path, "artifact")
    meta = checked_meta({**(meta or {}), "sha256": weights_digest(state)}, path)  # what is written reads back
    checked_config(cfg, path)
    return model_file_format.write(path, state, cfg, meta)


def check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Raise a one-line ``FloatingPointError`` naming the tensors with NaN or Inf values: nothing is written."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise FloatingPointError(
            f"not writing {str(path)!r}: {len(bad)} of {len(state)} weight tensors hold NaN or Inf "
            f"(first: {bad[0]}); expected finite weights (the run diverged: lower the learning rate)"
        )


CONVERT = "convert a file you trust once: python -m dalle_lightning.convert_artifact OLD NEW"


def read_file(path: str | Path, tensors: bool = True) -> dict:
    """A model file's contents, read as data and checked: ``{"config", "meta", "state_dict"}`` with named tensors
    under ``state_dict`` (``None`` with ``tensors=False`` for a safetensors file whose ``meta`` has its digest: the
    header alone is read) and typed plain values under ``config`` and ``meta``; anything that asks for more is a
    one-line :class:`~dalle_lightning.safe_files.UnsafeFile` naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist; train that stage first (dalle-train stage=...)")
    if model_file_format.is_safetensors(path):
        config, meta = model_file_format.read_values(path)
        blob = {"config": config, "meta": meta, "state_dict": None}
    else:  # a file written before safetensors: torch.save's zip, read with weights_only=True
        blob = read_data(path, "dalle-lightning model file", CONVERT, "a file written by dalle-train")
        if not isinstance(blob, dict) or "config" not in blob or "state_dict" not in blob:
            raise ValueError(f"{str(path)!r} is not a dalle-lightning model file; expected keys config, state_dict")
        blob = {"config": blob["config"], "meta": blob.get("meta") or {}, "state_dict": blob["state_dict"]}
    # Values first, before any tensor is read: a stored expression or a stranger's _target_ is refused at once.
    checked_config(blob["config"], path)
    blob["meta"] = checked_meta(blob["meta"], path)
    state = blob["state_dict"]
    if state is not None and not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                                                  for k, v in state.items())):
        raise ValueError(f"{str(path)!r}: state_dict is not a dict of named tensors; expected a file written by "
                         "dalle-train")
    # Sizes next, before a tensor is read or a model built: the config's model (built on the meta device) has the
    # file's tensors, and the sizes the meta records are that model's.
    shapes = model_file_format.read_shapes(path) if state is None else {k: tuple(v.shape) for k, v in state.items()}
    check_sizes(blob["meta"], planned_model(blob["config"], path, shapes), path)
    if blob["state_dict"] is None and (tensors or "sha256" not in blob["meta"]):
        blob["state_dict"] = model_file_format.read_tensors(path)
    return blob


def check_sizes(meta: Mapping[str, Any], model: nn.Module, path: str | Path) -> None:
    """Each size ``meta`` records (``vocab_size``, ...) that the model has too is the model's: a size a later
    stage reads through ``${meta:...}`` is backed by the file's tensors (its bound: :data:`SIZE_BOUNDS`)."""
    for key in SIZE_KEYS:
        has = getattr(model, key, None)
        if key in meta and type(has) is int and meta[key] != has:
            raise UnsafeFile(f"{str(path)!r}: meta.{key}={shown(meta[key])}, but the model its config builds has "
                             f"{key}={has}; expected a file written by dalle-train")


def _meta(blob: dict) -> dict[str, Any]:
    """An artifact's metadata, completed for files written before a field existed (digest, stage)."""
    meta = dict(blob.get("meta") or {})
    if "sha256" not in meta:
        meta["sha256"] = weights_digest(blob["state_dict"])
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
    return _check_stage(_meta(read_file(path, tensors=False)), path, stage, key)


def load_artifact(path: str | Path, map_location: str | torch.device = "cpu", stage: str | None = None,
                  key: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild and load a saved model (in eval mode) and its metadata, with ``sha256`` even for older files.

    With ``stage``, a file of another stage is a one-line error naming ``key`` before anything is built.
    """
    blob = read_file(path)
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


def read_meta(path: str | Path, key: str) -> int:
    """One size a saved model records (``vocab_size``, ``grid_size``, ``image_size``, ``text_len``, ...), or a
    ``tokenizer.json``'s (``vocab_size``, ``text_len``): always an int, so the ``${meta:...}`` resolver never hands
    OmegaConf a string, which it would parse again as an expression."""
    path = Path(path)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist; run `dalle-train stage=tokenizer` first")
        from dalle_lightning.data.tokenizer import read_tokenizer, recorded_text_len

        tokenizer = read_tokenizer(path)  # bounded: an absurdly large file is refused before it is read
        if key == "vocab_size":
            return _tokenizer_int(tokenizer.get_vocab_size(), path, key)
        if key == "text_len":
            length = recorded_text_len(tokenizer)
            if length is None:
                raise KeyError(f"tokenizer {str(path)!r} records no text_len (written before tokenizers recorded it); "
                               "expected one: retrain it (dalle-train stage=tokenizer stage.force=true) or set the "
                               "caption length explicitly (model.text_len=N for the prior, text_len=N for dalle-encode)")
            return _tokenizer_int(length, path, key)
        raise KeyError(f"tokenizer files provide vocab_size and text_len, not {key!r}")
    return size_value(_meta(read_file(path, tensors=False)), key, path)


def _tokenizer_int(value: object, path: Path, key: str) -> int:
    if type(value) is not int or value <= 0:
        raise ValueError(f"tokenizer {str(path)!r} records {key} as a {type(value).__name__}; expected a positive int")
    return value


def register_resolvers() -> None:
    """``${meta:PATH,KEY}`` in configs reads a size from an earlier stage's artifact (an int, see :func:`read_meta`)."""
    if not OmegaConf.has_resolver("meta"):
        OmegaConf.register_new_resolver("meta", lambda path, key: read_meta(path, key))
