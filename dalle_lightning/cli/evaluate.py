"""``dalle-eval``: caption accuracy of a trained pipeline on the shapes world, as JSON."""

from __future__ import annotations

import json
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.artifacts import write_json
from dalle_lightning.cli.common import CONF_DIR, check_keys, one_line_errors

log = logging.getLogger("dalle_lightning.eval")

KEYS = {"paths", "prior", "dvae", "tokenizer", "clip", "n_seen", "n_zeroshot", "candidates", "batch_size",
        "temperature", "top_k", "top_p", "cond_scale", "seed", "out", "device"}


def run(cfg: DictConfig) -> dict:
    from dalle_lightning.evaluate import evaluate
    from dalle_lightning.generate import Generator

    check_keys(cfg, KEYS)
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)
    report = evaluate(gen, cfg.n_seen, cfg.n_zeroshot, list(cfg.candidates), seed=cfg.seed,
                      batch_size=cfg.batch_size, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                      cond_scale=cfg.cond_scale)
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json(report, cfg.out)
    summary = {split: {n: round(report[split][n]["accuracy"], 3) for n in report[split] if n.isdigit()}
               for split in ("seen", "zeroshot") if split in report}
    print(json.dumps({"accuracy": summary, "report": cfg.out}))
    return report


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
