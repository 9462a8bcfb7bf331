"""One source for each size: the caption length and the image size are facts of the artifacts that fix them.

The tokenizer records ``text_len`` (``tokenizer.json``), the dVAE ``image_size`` (its file's ``meta``), and token
shards the ``text_len`` they were encoded with (their marker). Later stages read them through ``${meta:...}`` by
default, so a pipeline run as typed agrees with itself; a value given on the command line that contradicts the
artifact is a one-line error naming both keys and both values, before anything loads or trains. A file written
before it recorded a size is unknown, never an error.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from dalle_lightning.artifacts import read_meta


def _recorded(path: Any, key: str) -> Any:
    """A size an artifact records, or None (no file, or a file from before the size was recorded)."""
    if not path:
        return None
    try:
        return read_meta(path, key)
    except (FileNotFoundError, KeyError):
        return None


def contradiction(key: str, value: Any, source_key: str, source: Any, size: str, recorded: Any, fix: str) -> None:
    """Raise the one-line error for ``key=value`` against what ``source_key=source`` records as ``size``."""
    if recorded is not None and value != recorded:
        raise ValueError(f"{key}={value!r} contradicts {source_key}={str(source)!r}, which records {size}={recorded!r}; "
                         f"expected {recorded!r}: {fix}")


def check_text_len(key: str, value: Any, tokenizer_key: str, tokenizer: Any) -> None:
    """``value`` (a caption length) is the one ``tokenizer`` was trained with."""
    contradiction(key, value, tokenizer_key, tokenizer, "text_len", _recorded(tokenizer, "text_len"),
                  f"drop {key} (it defaults to the tokenizer's), or retrain the tokenizer with "
                  f"`dalle-train stage=tokenizer model.text_len={value} stage.force=true`")


def check_image_size(key: str, value: Any, dvae_key: str, dvae: Any) -> None:
    """``value`` (an image size) is the one ``dvae`` was trained at."""
    contradiction(key, value, dvae_key, dvae, "image_size", _recorded(dvae, "image_size"),
                  f"drop {key} (it defaults to the dVAE's), or train a dVAE at that size "
                  f"(`dalle-train stage=dvae model.image_size={value} stage.force=true`)")


def check_training(cfg: DictConfig) -> None:
    """``dalle-train``'s sizes against each other and against the artifacts the stage reads."""
    stage = cfg.stage.name
    data, model, module = cfg.get("data") or {}, cfg.get("model") or {}, cfg.get("module") or {}
    if stage == "dvae" and "image_size" in model and data.get("image_size") != model.image_size:
        raise ValueError(f"data.image_size={data.get('image_size')!r} contradicts model.image_size={model.image_size!r}; "
                         f"expected {model.image_size!r}: drop data.image_size (it follows model.image_size), or set "
                         f"model.image_size={data.get('image_size')!r} to train the dVAE at that size")
    if stage == "clip" and module.get("dvae"):
        check_image_size("data.image_size", data.get("image_size"), "module.dvae", module.dvae)
    if stage == "prior":
        check_text_len("model.text_len", model.text_len, "paths.tokenizer", cfg.paths.tokenizer)
        contradiction("model.text_vocab_size", model.text_vocab_size, "paths.tokenizer", cfg.paths.tokenizer,
                      "vocab_size", _recorded(cfg.paths.tokenizer, "vocab_size"),
                      "drop model.text_vocab_size (it defaults to the tokenizer's), or train the prior with the "
                      "tokenizer of that vocabulary")
        if module.get("dvae"):
            grid = _recorded(module.dvae, "grid_size")
            contradiction("model.image_grid", model.image_grid, "module.dvae", module.dvae, "grid_size", grid,
                          "drop model.image_grid (it defaults to the dVAE's), or train the prior on that dVAE's codes")


def check_token_shards(text_len: int, marker: dict[str, Any], shards_key: str, shards: Any) -> None:
    """The prior's ``text_len`` is the one its token shards were encoded with (their marker records it)."""
    contradiction("model.text_len", text_len, shards_key, shards, "text_len", marker.get("text_len"),
                  "drop model.text_len (it defaults to the tokenizer's), or re-encode the shards with that "
                  "tokenizer (dalle-encode force=true)")


def check_encode(cfg: DictConfig) -> None:
    """``dalle-encode``'s ``text_len`` and ``image_size`` against the tokenizer's and the dVAE's."""
    check_text_len("text_len", cfg.text_len, "tokenizer", cfg.tokenizer)
    check_image_size("image_size", cfg.image_size, "dvae", cfg.dvae)
