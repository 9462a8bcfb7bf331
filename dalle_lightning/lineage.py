"""What an artifact was made with, and the one-line error when a pipeline mixes artifacts that do not belong.

A prior learns the codes of one dVAE and the caption ids of one tokenizer; sampled with another dVAE of the
same grid it draws noise without a word. So every artifact carries a digest of its own weights (``meta.sha256``),
token shards record the dVAE and tokenizer that made them (their directory marker), and a trained prior or CLIP
records the same under ``meta.trained_with``. Commands that combine artifacts compare these records.

Records written before this existed are missing, not different: a missing record is unknown and never an error.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dalle_lightning.artifacts import read_record
from dalle_lightning.data.shards import is_remote
from dalle_lightning.outputs import read_marker
from dalle_lightning.data.tokenizer import CaptionTokenizer


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (a ``tokenizer.json``)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dvae_record(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a consumer of a dVAE's codes records about it (from the dVAE's metadata)."""
    return {k: meta[k] for k in ("sha256", "vocab_size", "grid_size") if k in meta}


def tokenizer_record(path: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
    """What a consumer of a tokenizer's ids records about it."""
    return {"sha256": file_digest(path), "vocab_size": vocab_size}


def check_same(what: str, recorded: Mapping[str, Any] | None, given: Mapping[str, Any], key: str, value: Any,
               user: str) -> None:
    """Raise a one-line ``ValueError`` when ``recorded`` (what ``user`` was made with) differs from ``given``.

    ``what`` names the kind of artifact (``dVAE``), ``key=value`` the config entry that supplied ``given``.
    Fields missing on either side are unknown and not compared.
    """
    if not recorded:
        return
    for field in ("sha256", "vocab_size", "grid_size"):
        if field in recorded and field in given and recorded[field] != given[field]:
            mine, theirs = recorded[field], given[field]
            if field == "sha256":
                mine, theirs = str(mine)[:12], str(theirs)[:12]
            raise ValueError(
                f"{user} was made with the {what} whose {field} is {mine}, but {key}={str(value)!r} has {theirs}; "
                f"expected the same {what} (or retrain/re-encode with this one)"
            )


def check_pipeline(prior: str | os.PathLike, dvae: str | os.PathLike, tokenizer: str | os.PathLike,
                   clip: str | os.PathLike | None = None) -> None:
    """Before any model is built: each file is the stage it is passed as, and the prior (and CLIP) were made with
    this dVAE and tokenizer, as far as their records tell."""
    prior_meta = read_record(prior, "prior", "prior")
    dvae_meta = read_record(dvae, "dvae", "dvae")
    clip_meta = read_record(clip, "clip", "clip") if clip is not None else {}
    given_dvae = dvae_record(dvae_meta)
    given_tokenizer = tokenizer_record(tokenizer, CaptionTokenizer.load(tokenizer).vocab_size)
    made = prior_meta.get("trained_with", {})
    check_same("dVAE", made.get("dvae"), given_dvae, "dvae", dvae, f"prior={str(prior)!r}")
    check_same("tokenizer", made.get("tokenizer"), given_tokenizer, "tokenizer", tokenizer, f"prior={str(prior)!r}")
    check_same("dVAE", clip_meta.get("trained_with", {}).get("dvae"), given_dvae, "dvae", dvae, f"clip={str(clip)!r}")


def token_shards_record(spec: Any, world: Any = None, world_key: str = "paths.tokens") -> dict[str, Any]:
    """The marker ``dalle-encode`` left beside the first local shard of ``spec`` ({} for unmarked shards);
    ``spec`` may be ``auto`` (the shards under ``world``, ``data.splits``)."""
    from dalle_lightning.data.splits import train_urls

    urls = [u for u in train_urls("data.train_shards", spec, world, world_key) if not is_remote(u)]
    marker = read_marker(Path(urls[0]).parent) if urls else None
    return marker if marker and marker.get("kind") == "tokens" else {}


def stage_record(cfg: DictConfig) -> dict[str, Any]:
    """What a training stage is made with (``meta.trained_with``), checked first against what its data records.

    A prior learns codes of the dVAE and ids of the tokenizer its token shards were encoded with; its vocabulary
    sizes come from ``paths.dvae`` and ``paths.tokenizer``, and its FID decodes with ``module.dvae``: all must be
    the same. A CLIP sees reconstructions of ``module.dvae``.
    """
    stage, module = cfg.stage.name, cfg.get("module") or {}
    dvae = module.get("dvae")
    dvae_given = dvae_record(read_record(dvae, "dvae", "module.dvae")) if dvae else {}
    if stage == "clip":
        return {"dvae": dvae_given} if dvae_given else {}
    if stage != "prior":
        return {}
    spec = cfg.data.train_shards
    marker = token_shards_record(spec, cfg.data.get("world"), cfg.data.get("world_key", "paths.tokens"))
    user = f"data.train_shards={str(spec)!r} (token shards)"
    from dalle_lightning.cli.sizes import check_token_shards

    shown = spec if spec != "auto" else f"auto ({cfg.data.get('world')})"
    check_token_shards(cfg.model.text_len, marker, "data.train_shards", shown)
    dvae_given = {"vocab_size": cfg.model.image_vocab_size, "grid_size": cfg.model.image_grid, **dvae_given}
    check_same("dVAE", marker.get("dvae"), dvae_given, "module.dvae", dvae, user)
    tokenizer = cfg.paths.tokenizer
    tokenizer_given = {"vocab_size": cfg.model.text_vocab_size}
    if Path(tokenizer).is_file():  # the file's own vocabulary (cli.sizes compares model.text_vocab_size with it)
        tokenizer_given = tokenizer_record(tokenizer, CaptionTokenizer.load(tokenizer).vocab_size)
    check_same("tokenizer", marker.get("tokenizer"), tokenizer_given, "paths.tokenizer", tokenizer, user)
    return {k: marker[k] for k in ("dvae", "tokenizer") if k in marker}
