"""``dalle-encode``: run a trained dVAE over image shards and write token shards for the prior.

Each output sample keeps the input's key and caption and adds ``codes.npy`` (uint16 argmax codes in raster
order: the paper encodes images for the prior without Gumbel noise) and ``ids.npy`` (caption ids, unpadded).
Shards are written under a temporary directory name and renamed when complete.
"""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path

import hydra
import numpy as np
import torch
import webdataset as wds
from omegaconf import DictConfig

from dalle_lightning.artifacts import load_model
from dalle_lightning.cli.common import CONF_DIR, check_keys, one_line_errors
from dalle_lightning.data.datamodule import ImageTextDataModule, ShardStream
from dalle_lightning.data.shards import resolve_shards
from dalle_lightning.tokenizer import CaptionTokenizer

log = logging.getLogger("dalle_lightning.encode")


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@torch.no_grad()
def encode_split(dvae: torch.nn.Module, tokenizer: CaptionTokenizer, shards: str, out_dir: Path, image_size: int,
                 batch_size: int, shard_size: int, bf16: bool = False, num_workers: int = 0) -> int:
    """Encode one split; returns the number of samples written.

    With ``num_workers`` loader processes, PNG decoding overlaps the dVAE's forward passes; each worker then
    logs the samples it skips (with their keys), but only a single-process run can total them at the end.
    """
    reader = ImageTextDataModule(image_size=image_size)
    keyed = lambda s: None if (d := reader.decode(s, train=False)) is None else {**d, "key": s["__key__"]}  # noqa: E731
    stream = ShardStream(resolve_shards(shards), keyed, rank=0, world_size=1, shuffle=0, seed=0)
    loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, num_workers=num_workers)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = 0
    # mtime=0 (an int): reproducible bytes, and no per-member PAX header, which the prior's loader would parse
    # on every sample (docs/results.md).
    with wds.ShardWriter(str(tmp / "%06d.tar"), maxcount=shard_size, verbose=0, mtime=0) as sink:
        for batch in loader:
            images = batch["image"].contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                codes = dvae.get_codebook_indices(images).flatten(1).to(torch.int32).numpy()
            for key, text, code in zip(batch["key"], batch["text"], codes):
                ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
                sink.write({"__key__": key, "codes.npy": _npy(code.astype(np.uint16)), "ids.npy": _npy(ids),
                            "txt": text.encode("utf-8")})
                n += 1
    if reader.skipped:
        log.warning("skipped %d input samples: %s", sum(reader.skipped.values()), dict(reader.skipped))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return n


def run(cfg: DictConfig) -> dict[str, int]:
    check_keys(cfg, {"paths", "dvae", "tokenizer", "text_len", "image_size", "splits", "out_dir", "shard_size",
                     "batch_size", "bf16", "num_workers", "force"})
    out = Path(cfg.out_dir)
    if not cfg.force and all(any((out / s).glob("*.tar")) for s in cfg.splits):
        log.info("token shards exist in %s; reusing them (force=true rewrites)", out)
        return {}
    dvae = load_model(cfg.dvae).to(memory_format=torch.channels_last)  # NHWC convolutions: faster on CPU
    tokenizer = CaptionTokenizer.load(cfg.tokenizer, text_len=cfg.text_len)
    counts = {}
    for split, shards in cfg.splits.items():
        counts[split] = encode_split(dvae, tokenizer, shards, out / split, cfg.image_size, cfg.batch_size,
                                     cfg.shard_size, bf16=cfg.bf16, num_workers=cfg.num_workers)
        log.info("%s: %d samples -> %s", split, counts[split], out / split)
    if tokenizer.truncated:
        log.warning("%d captions were longer than text_len=%d and truncated", tokenizer.truncated, cfg.text_len)
    return counts


@hydra.main(config_path=CONF_DIR, config_name="encode", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
