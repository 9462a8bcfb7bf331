"""``dalle-encode``: run a trained dVAE over image shards and write token shards for the prior.

Each output sample keeps the input's key and caption and adds ``codes.npy`` (uint16 argmax codes in raster
order: the paper encodes images for the prior without Gumbel noise) and ``ids.npy`` (caption ids, unpadded).
Shards are written under a temporary directory name and renamed when complete. Each split's directory is
marked as token shards with the dVAE and tokenizer that made them (``outputs``, ``lineage``): a rerun replaces
only token shards, never a directory of other files, and a prior trained on them records what they came from.
"""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.artifacts import load_artifact, read_record
from dalle_lightning.cli import checks, sizes
from dalle_lightning.cli.common import check_keys, hydra_app
from dalle_lightning.data.datamodule import ImageTextDataModule, ShardStream
from dalle_lightning.data.epoch_loader import no_data_message
from dalle_lightning.data.shards import resolve_shards
from dalle_lightning.data.splits import AUTO, Split, resolve_splits
from dalle_lightning.hardware import AUTO, native_bf16, resolve_device
from dalle_lightning.lineage import check_same, dvae_record, tokenizer_record
from dalle_lightning.outputs import check_split_folders, claim, read_marker, replace_dir, write_marker
from dalle_lightning.data.tokenizer import CaptionTokenizer
from dalle_lightning_plugins.io.atomic_files import temporary_name

log = logging.getLogger("dalle_lightning.encode")


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def image_reader(image_size: int, num_workers: int, background: Any) -> ImageTextDataModule:
    """The decoder of training's validation path (centre crop, no augmentation), its skips counted per sample."""
    return ImageTextDataModule(image_size=image_size, num_workers=num_workers, background=background)


@torch.no_grad()
def encode_split(dvae: torch.nn.Module, tokenizer: CaptionTokenizer, shards: str | Split, out_dir: Path,
                 image_size: int, batch_size: int, shard_size: int, bf16: bool = False, num_workers: int = 0,
                 record: dict[str, Any] | None = None, background: Any = (255, 255, 255),
                 device: str = "cpu") -> int:
    """Encode one split (shards, or a ``data.splits.Split`` with its held-out filter) into ``out_dir`` (new, or
    token shards of an earlier run); returns the samples written.

    ``record`` (the dVAE and tokenizer that made the codes) goes into the directory's marker. Captions longer
    than the tokenizer's ``text_len`` are cut, counted and reported in one line for the split.

    With ``num_workers`` loader processes, PNG decoding overlaps the dVAE's forward passes; the skipped and
    converted images are counted in shared memory over the workers and logged at the end as ``key=value`` lines.
    """
    split = shards if isinstance(shards, Split) else Split("splits", shards, resolve_shards(shards))
    reader = image_reader(image_size, num_workers, background)
    keyed = lambda s: None if (d := reader.decode(s, train=False)) is None else {**d, "key": s["__key__"]}  # noqa: E731
    stream = ShardStream(split.urls, keyed, rank=0, world_size=1, shuffle=0, seed=0, skipped=reader.skipped,
                         keep=split.keep)
    loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, num_workers=num_workers,
                                         pin_memory=device.startswith("cuda"))
    claim(out_dir, "tokens")
    tmp = temporary_name(out_dir)  # this run's own name: a second run never writes into or removes it
    tmp.mkdir(parents=True)
    tokenizer.truncated = tokenizer.longest = 0
    try:
        n = _write_tokens(dvae, tokenizer, loader, tmp, shard_size, bf16, record, torch.device(device))
        report_counts(out_dir.name, reader)
        line = tokenizer.truncation_line(out_dir.name, n)
        if line:
            log.warning("%s", line)
        if n == 0:  # an empty split must not replace one, nor pass as encoded
            raise ValueError(no_data_message(f"split {out_dir.name!r} ({split.describe()})", "readable sample",
                                             stream.urls, reader.skipped.summary))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(out_dir, "tokens")
    tmp.rename(out_dir)
    return n


def report_counts(split: str, reader: ImageTextDataModule) -> None:
    """The split's skipped and converted images as ``key=value`` lines (``skipped/corrupt_image=3``)."""
    for group, counts in (("skipped", reader.skip_counts()), ("converted", reader.conversion_counts())):
        for name, n in counts.items():
            if n:
                log.info("%s: %s/%s=%d", split, group, name.replace(" ", "_"), n)


def _write_tokens(dvae: torch.nn.Module, tokenizer: CaptionTokenizer, loader: torch.utils.data.DataLoader,
                  tmp: Path, shard_size: int, bf16: bool, record: dict | None, device: torch.device) -> int:
    """Encode every batch of ``loader`` into token shards in ``tmp``; the number of samples written."""
    write_marker(tmp, "tokens", **(record or {}))
    n = 0
    # mtime=0 (an int): reproducible bytes, and no per-member PAX header, which the prior's loader would parse
    # on every sample (docs/results.md).
    with wds.ShardWriter(str(tmp / "%06d.tar"), maxcount=shard_size, verbose=0, mtime=0) as sink:
        for batch in loader:
            images = batch["image"].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                codes = dvae.get_codebook_indices(images).flatten(1).to(torch.int32).cpu().numpy()
            for key, text, code in zip(batch["key"], batch["text"], codes):
                ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
                sink.write({"__key__": key, "codes.npy": _npy(code.astype(np.uint16)), "ids.npy": _npy(ids),
                            "txt": text.encode("utf-8")})
                n += 1
    return n


def input_splits(cfg: DictConfig) -> dict[str, Split]:
    """Output split name -> what it reads: ``auto`` splits found under ``world`` as training finds them (a held-out
    validation slice where the download has no ``val/``), other values as shards; null splits are left out."""
    wanted = {name: spec for name, spec in cfg.splits.items() if spec is not None}
    if not wanted:
        raise ValueError(f"splits={OmegaConf.to_container(cfg.splits)!r} names no split; expected at least "
                         "splits.train (auto, or shards)")
    out: dict[str, Split | None] = {}
    for name, spec in wanted.items():
        key = f"splits.{name}"
        if spec == AUTO and name not in ("train", "val"):
            raise ValueError(f"{key}=auto; expected shards (auto finds the train and val splits only)")
        out[name] = None if spec == AUTO else Split(key, spec, resolve_shards(spec, key=key))
    if wanted.get("train") == AUTO or wanted.get("val") == AUTO:
        # As training finds them: a held-out validation slice is left out of the encoded train split too.
        train, val = resolve_splits(cfg.world, wanted.get("train", AUTO), AUTO if wanted.get("val") == AUTO else None,
                                    cfg.val_holdout, prefix="", world_key="paths.world",
                                    keys=("splits.train", "splits.val"))
        if wanted.get("train") == AUTO:
            out["train"] = Split("splits.train", AUTO, train.urls, train.keep if wanted.get("val") == AUTO else None)
        if wanted.get("val") == AUTO:
            out["val"] = Split("splits.val", AUTO, val.urls, val.keep) if val is not None else None
    return {name: split for name, split in out.items() if split is not None}


def run(cfg: DictConfig) -> dict[str, int]:
    check_keys(cfg, {"paths", "dvae", "tokenizer", "text_len", "image_size", "background", "splits", "out_dir", "shard_size",
                     "batch_size", "bf16", "num_workers", "force", "verbose", "device", "world", "val_holdout"})
    checks.input_file(cfg, "dvae", "a trained dVAE (dalle-train stage=dvae)")
    checks.input_file(cfg, "tokenizer", "a tokenizer.json (dalle-train stage=tokenizer)")
    read_record(cfg.dvae, "dvae", "dvae")  # a file of another stage, before its sizes are read from it
    for key in ("text_len", "image_size", "shard_size", "batch_size"):
        checks.integer(cfg, key, minimum=1)
    checks.integer(cfg, "num_workers", minimum=0)
    checks.boolean_or_auto(cfg, "bf16")
    checks.device(cfg)
    checks.boolean(cfg, "force")
    checks.output_dir(cfg, "out_dir")
    sizes.check_encode(cfg)
    out = Path(cfg.out_dir)
    splits = input_splits(cfg)
    check_split_folders(out, splits)
    if not cfg.force and all(claim(out / s, "tokens") and any((out / s).glob("*.tar")) for s in splits):
        check_reused(out, cfg, splits)
        log.info("token shards exist in %s; reusing them (force=true rewrites)", out)
        return {}
    for split in splits:  # refuse before encoding anything, not after the first split
        claim(out / split, "tokens")
    reader = image_reader(cfg.image_size, 0, list(cfg.background))
    for split in splits.values():  # an unreadable split fails now, not after the others are encoded
        reader.probe_split(split)
    tokenizer = CaptionTokenizer.load(cfg.tokenizer, text_len=cfg.text_len)
    dvae, meta = load_artifact(cfg.dvae, stage="dvae", key="dvae")
    device = resolve_device(cfg.device)
    dvae = dvae.to(device, memory_format=torch.channels_last)  # NHWC convolutions: faster on CPU (docs/results.md)
    record = {"dvae": dvae_record(meta),
              "tokenizer": tokenizer_record(cfg.tokenizer, tokenizer.vocab_size), "text_len": cfg.text_len}
    bf16 = native_bf16("cuda" if device.startswith("cuda") else "cpu") if cfg.bf16 == AUTO else cfg.bf16
    counts = {}
    for split, shards in splits.items():
        counts[split] = encode_split(dvae, tokenizer, shards, out / split, cfg.image_size, cfg.batch_size,
                                     cfg.shard_size, bf16=bf16, num_workers=cfg.num_workers, record=record,
                                     background=list(cfg.background), device=device)
        log.info("%s: %d samples -> %s", split, counts[split], out / split)
    return counts


def check_reused(out: Path, cfg: DictConfig, splits: dict[str, Split]) -> None:
    """Token shards kept from an earlier run must come from this dVAE and tokenizer (unknown for older shards)."""
    meta = read_record(cfg.dvae, "dvae", "dvae")
    tokenizer = CaptionTokenizer.load(cfg.tokenizer)
    for split in splits:
        marker = read_marker(out / split) or {}
        user = f"the token shards in {str(out / split)!r} (force=true re-encodes)"
        check_same("dVAE", marker.get("dvae"), dvae_record(meta), "dvae", cfg.dvae, user)
        check_same("tokenizer", marker.get("tokenizer"), tokenizer_record(cfg.tokenizer, tokenizer.vocab_size),
                   "tokenizer", cfg.tokenizer, user)


@hydra_app("encode")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
