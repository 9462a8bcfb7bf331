"""``dalle-data``: write the embedded shapes world as WebDataset shards (img2dataset layout)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, hydra_app

log = logging.getLogger("dalle_lightning.data")


def run(cfg: DictConfig) -> dict[str, str]:
    from dalle_lightning.outputs import check_split_folders, claim
    from dalle_lightning.world import write_world
    from dalle_lightning.world.scene import SPLITS

    check_keys(cfg, {"paths", "out_dir", "n_train", "n_val", "n_zeroshot", "seed", "shard_size", "image_size", "force",
                     "verbose"})
    for key in ("n_train", "n_val", "n_zeroshot"):
        checks.integer(cfg, key, minimum=0)
    checks.integer(cfg, "shard_size", minimum=1)
    checks.integer(cfg, "image_size", minimum=1)
    checks.integer(cfg, "seed")
    checks.boolean(cfg, "force")
    checks.output_dir(cfg, "out_dir")
    out = Path(cfg.out_dir)
    check_split_folders(out, SPLITS)
    if not cfg.force and all(claim(out / s, "images") and any((out / s).glob("*.tar")) for s in SPLITS):
        log.info("shapes world exists in %s; reusing it (force=true rewrites)", out)
        return {s: str(out / s) for s in SPLITS}
    splits = write_world(out, n_train=cfg.n_train, n_val=cfg.n_val, n_zeroshot=cfg.n_zeroshot, seed=cfg.seed,
                         shard_size=cfg.shard_size, image_size=cfg.image_size)
    for split, pattern in splits.items():
        log.info("%s: %s", split, pattern)
    return splits


@hydra_app("world")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
