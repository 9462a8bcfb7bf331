"""``dalle-eval``: caption accuracy, FID and contrastive score of a trained pipeline against best-of-N, as JSON
and as a PNG of the reranking curves (the paper's Figure 9 on the shapes world)."""

from __future__ import annotations

import json
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.artifacts import write_json
from dalle_lightning.cli.common import CONF_DIR, check_keys, one_line_errors

log = logging.getLogger("dalle_lightning.eval")

KEYS = {"paths", "prior", "dvae", "tokenizer", "clip", "n_seen", "n_zeroshot", "candidates", "batch_size",
        "temperature", "top_k", "top_p", "cond_scale", "seed", "out", "plot", "fid", "device"}
SUMMARY = ("accuracy", "any_of_n", "fid_shapes_clip", "contrastive_score")


def summary(report: dict) -> dict:
    """``{metric: {split: {N: value}}}`` rounded, for the console."""
    out: dict = {}
    for metric in SUMMARY:
        for split in ("seen", "zeroshot"):
            values = {n: round(v[metric], 3) for n, v in report.get(split, {}).items()
                      if n.isdigit() and v.get(metric) is not None}
            if values:
                out.setdefault(metric, {})[split] = values
    return out


def run(cfg: DictConfig) -> dict:
    from dalle_lightning.evaluate import evaluate
    from dalle_lightning.generate import Generator
    from dalle_lightning.plot import plot_report

    check_keys(cfg, KEYS)
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)
    report = evaluate(gen, cfg.n_seen, cfg.n_zeroshot, list(cfg.candidates), seed=cfg.seed, fid=cfg.fid,
                      batch_size=cfg.batch_size, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                      cond_scale=cfg.cond_scale)
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json(report, cfg.out)
    if cfg.plot:
        plot_report(report, cfg.plot)
    print(json.dumps({**summary(report), "report": cfg.out, "plot": cfg.plot}))
    return report


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
