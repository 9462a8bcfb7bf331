"""``dalle-eval``: caption accuracy, FID and contrastive score of a trained pipeline against best-of-N, as JSON
and as a PNG of the reranking curves (the paper's Figure 9 on the shapes world); and the waterfall (renders ->
dVAE reconstructions -> any of N -> each reranker's pick -> one sample, by split and object count) as a line per
split and a PNG: which stage loses the accuracy."""

from __future__ import annotations

import json
import logging

from omegaconf import DictConfig, OmegaConf

from dalle_lightning_plugins.atomic_files import write_json
from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, hydra_app

log = logging.getLogger("dalle_lightning.eval")

KEYS = {"paths", "prior", "dvae", "tokenizer", "clip", "n_seen", "n_zeroshot", "candidates", "batch_size",
        "temperature", "top_k", "top_p", "cond_scale", "seed", "out", "plot", "waterfall_plot", "fid", "device",
        "rerank", "verbose"}
SUMMARY = ("accuracy", "any_of_n", "accuracy_clip", "accuracy_prior", "accuracy_both", "fid_shapes_clip",
           "contrastive_score")


def summary(report: dict) -> dict:
    """``{metric: {split: {N: value}}}`` rounded, for the console."""
    out: dict = {}
    for metric in SUMMARY:
        for split in ("seen", "zeroshot"):
            values = {n: round(v[metric], 3) for n, v in report.get(split, {}).items()
                      if n.isdigit() and v.get(metric) is not None}
            if values:
                out.setdefault(metric, {})[split] = values
    waterfalls = {split: report[split]["waterfall"] for split in ("seen", "zeroshot") if "waterfall" in report.get(split, {})}
    if waterfalls:
        from dalle_lightning.evaluation.waterfall import waterfall_line

        out["waterfall"] = {split: waterfall_line(w) for split, w in waterfalls.items()}
    return out


def check_input(cfg: DictConfig) -> None:
    """Every value before any model loads (see ``cli.checks``)."""
    checks.integer(cfg, "n_seen", minimum=0)
    checks.integer(cfg, "n_zeroshot", minimum=0)
    if cfg.n_seen + cfg.n_zeroshot == 0:
        raise ValueError("n_seen=0 and n_zeroshot=0; expected at least one caption to evaluate")
    candidates = checks.value(cfg, "candidates")
    if not OmegaConf.is_list(candidates) or not candidates or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in candidates):
        raise ValueError(f"candidates={candidates!r}; expected a non-empty list of N >= 1, e.g. [1,2,4]")
    checks.sampling(cfg)
    checks.boolean(cfg, "fid")
    if cfg.fid and cfg.clip is None:
        raise ValueError("fid=true with clip=null; expected a clip file (FID uses its image features) or fid=false")
    checks.output_file(cfg, "out")
    checks.output_file(cfg, "plot")
    checks.output_file(cfg, "waterfall_plot")


def run(cfg: DictConfig) -> dict:
    from dalle_lightning.evaluation.evaluate import evaluate
    from dalle_lightning.generation.generate import Generator
    from dalle_lightning.evaluation.plot import plot_report
    from dalle_lightning.evaluation.plot_waterfall import plot_waterfall

    check_keys(cfg, KEYS)
    check_input(cfg)
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)
    report = evaluate(gen, cfg.n_seen, cfg.n_zeroshot, list(cfg.candidates), seed=cfg.seed, fid=cfg.fid,
                      batch_size=cfg.batch_size, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                      cond_scale=cfg.cond_scale, rerank=cfg.rerank)
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json(cfg.out, report)
    if cfg.plot:
        plot_report(report, cfg.plot)
    if cfg.waterfall_plot:
        plot_waterfall(report, cfg.waterfall_plot)
    print(json.dumps({**summary(report), "report": cfg.out, "plot": cfg.plot, "waterfall_plot": cfg.waterfall_plot}))
    return report


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
