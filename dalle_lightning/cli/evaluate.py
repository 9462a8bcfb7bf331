"""``dalle-eval``: how good a trained pipeline's images are against best-of-N reranking, as JSON and as a PNG of the
reranking curves (the paper's Figure 9), on whatever captioned data the pipeline was trained on.

Which captions (``captions=auto``): on the shapes world (its shards carry dalle-data's marker or shapes scenes),
fresh shapes captions, judged by the shapes detector: caption accuracy per N, and the waterfall (renders -> dVAE
reconstructions -> any of N -> each reranker's pick -> one sample, by split and object count) as a line per split
and a PNG: which stage loses the accuracy. On any other data, the val split's own captions and images (the split
training validates on, ``data.val_shards``); there is no judge of a caption there, so accuracy and the waterfall are
left out, with one log line saying why. On both, in every feature space (the project's CLIP, ``clip=``, and an
open_clip model with local weights, ``open_clip=``), FID, KID and the contrastive score per N, each beside its
reference: what real images score (``evaluation.best_of_n``; docs/fid.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dalle_lightning_plugins.io.atomic_files import write_json
from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, hydra_app
from dalle_lightning.data.splits import AUTO, Split, resolve_splits

log = logging.getLogger("dalle_lightning.eval")

KEYS = {"paths", "data", "captions", "prior", "dvae", "tokenizer", "clip", "open_clip", "n_seen", "n_zeroshot",
        "n_val", "candidates", "batch_size", "temperature", "top_k", "top_p", "cond_scale", "seed", "out", "plot",
        "waterfall_plot", "fid", "device", "rerank", "verbose"}
CAPTIONS = ("auto", "shapes", "val")
SPLITS = ("seen", "zeroshot", "val")
SCORE_PREFIXES = ("fid_", "kid_", "contrastive_")  # per-N scores named by feature space
SUMMARY = ("accuracy", "any_of_n", "accuracy_clip", "accuracy_prior", "accuracy_both")


def summary(report: dict) -> dict:
    """``{metric: {split: {N: value}}}`` rounded, for the console, with each split's references and waterfall."""
    out: dict = {}
    for split in SPLITS:
        per_n = {n: v for n, v in report.get(split, {}).items() if n.isdigit()}
        metrics = [m for m in SUMMARY if any(m in v for v in per_n.values())]
        metrics += sorted({k for v in per_n.values() for k in v if k.startswith(SCORE_PREFIXES)})
        for metric in metrics:
            values = {n: round(v[metric], 4) for n, v in per_n.items() if v.get(metric) is not None}
            if values:
                out.setdefault(metric, {})[split] = values
        references = {k: round(v, 4) for k, v in report.get(split, {}).items() if k.startswith("reference_")}
        if references:
            out.setdefault("reference", {})[split] = references
    waterfalls = {split: report[split]["waterfall"] for split in ("seen", "zeroshot") if "waterfall" in report.get(split, {})}
    if waterfalls:
        from dalle_lightning.evaluation.waterfall import waterfall_line

        out["waterfall"] = {split: waterfall_line(w) for split, w in waterfalls.items()}
    return out


def check_clip_file(cfg: DictConfig) -> None:
    """``clip`` is null or an existing file: one line with both fixes (train it, or go without)."""
    clip = checks.value(cfg, "clip")
    if clip is not None and (not isinstance(clip, str) or not Path(clip).is_file()):
        raise ValueError(f"clip={clip!r} does not exist; expected a trained CLIP file: train it (dalle-train "
                         "stage=clip), or set clip=null (then rerank=prior, and FID/KID only with open_clip=...)")


def check_input(cfg: DictConfig) -> tuple[str, str] | None:
    """Every value before any model loads (see ``cli.checks``); returns the ``open_clip`` (model, weights) or None."""
    from dalle_lightning.evaluation.feature_spaces import check_open_clip

    checks.integer(cfg, "n_seen", minimum=0)
    checks.integer(cfg, "n_zeroshot", minimum=0)
    checks.integer(cfg, "n_val", minimum=2)
    checks.choice(cfg, "captions", CAPTIONS)
    candidates = checks.value(cfg, "candidates")
    if not OmegaConf.is_list(candidates) or not candidates or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in candidates):
        raise ValueError(f"candidates={candidates!r}; expected a non-empty list of N >= 1, e.g. [1,2,4]")
    check_clip_file(cfg)
    checks.sampling(cfg)
    checks.boolean(cfg, "fid")
    open_clip = check_open_clip(OmegaConf.to_container(cfg.open_clip) if OmegaConf.is_config(cfg.open_clip)
                                else cfg.open_clip)
    if cfg.fid and cfg.clip is None and open_clip is None:
        raise ValueError("fid=true with clip=null and open_clip=null; expected a feature space for FID and KID: a clip "
                         "file, open_clip={model: ViT-B-32, pretrained: /path/weights.pt}, or fid=false")
    checks.integer(cfg, "data.image_size", minimum=1, optional=True)
    checks.output_file(cfg, "out")
    checks.output_file(cfg, "plot")
    checks.output_file(cfg, "waterfall_plot")
    return open_clip


def data_splits(cfg: DictConfig) -> tuple[Split, Split | None] | None:
    """The train and val splits exactly as training resolves them (``data.splits.resolve_splits`` on ``data``);
    None when there is no data at all: both splits ``auto`` and no ``data.world`` folder."""
    data = cfg.data
    if data.train_shards == AUTO and data.val_shards in (AUTO, None) and not Path(str(data.world)).is_dir():
        return None
    return resolve_splits(data.world, data.train_shards, data.val_shards, data.val_holdout, prefix="data.")


def choose_captions(cfg: DictConfig) -> tuple[str, tuple[Split, Split | None] | None]:
    """``shapes`` or ``val`` for ``captions`` (``auto``: by the data, see the module docstring), with the splits; a
    val evaluation says in one log line why accuracy and the waterfall are left out."""
    from dalle_lightning.evaluation.captioned_data import shapes_world

    if cfg.captions == "shapes":
        return "shapes", None
    splits = data_splits(cfg)
    if splits is None:
        if cfg.captions == "val":
            raise ValueError(f"captions=val but data.world={cfg.data.world!r} is not a folder; expected the folder of "
                             "your image shards (paths.world=<folder>) or data.val_shards=<shards>")
        log.warning("no image shards: data.world=%r is not a folder, so dalle-eval evaluates the embedded shapes "
                    "world's fresh captions; set paths.world=<folder of your shards> to evaluate on your data "
                    "(captions=shapes says the shapes world on purpose)", str(cfg.data.world))
        return "shapes", None
    train, val = splits
    shapes = shapes_world(val if val is not None else train)
    if cfg.captions == "auto" and shapes:
        return "shapes", splits
    if val is None:
        raise ValueError(f"data.val_shards={cfg.data.val_shards!r} (data.val_holdout={cfg.data.val_holdout}) leaves no "
                         "val split to evaluate on; expected data.val_shards=auto (the val/ folder, or a held-out slice "
                         "of the training samples with data.val_holdout > 0) or the val shards of your data")
    why = ("captions=val asks for the val split's own captions" if shapes else
           f"{val.describe()} is not the shapes world (no dalle-data marker, no shapes scene in its json)")
    log.info("caption accuracy and the waterfall are left out: %s, and only the shapes world's captions have a judge "
             "(the shapes detector); FID, KID and contrastive scores follow", why)
    return "val", splits


def check_mode(cfg: DictConfig, captions: str) -> None:
    """The values only one kind of evaluation reads."""
    if captions == "shapes" and cfg.n_seen + cfg.n_zeroshot == 0:
        raise ValueError("n_seen=0 and n_zeroshot=0; expected at least one caption to evaluate")


def image_size_of(cfg: DictConfig, dvae_size: int) -> int:
    """The size real images are read at: the dVAE's; ``data.image_size``, when set, must agree."""
    given = checks.value(cfg, "data.image_size")
    if given is not None and given != dvae_size:
        raise ValueError(f"data.image_size={given}; expected null or the dVAE's image_size {dvae_size} (dvae="
                         f"{cfg.dvae!r}): generated and real images are compared at the dVAE's size")
    return dvae_size


def run(cfg: DictConfig) -> dict:
    from dalle_lightning.artifacts import read_record
    from dalle_lightning.evaluation.evaluate import evaluate
    from dalle_lightning.evaluation.feature_spaces import feature_spaces
    from dalle_lightning.evaluation.plot import plot_report
    from dalle_lightning.evaluation.plot_waterfall import plot_waterfall
    from dalle_lightning.evaluation.val_captions import evaluate_on_val
    from dalle_lightning.generation.generate import Generator

    check_keys(cfg, KEYS)
    open_clip = check_input(cfg)
    captions, splits = choose_captions(cfg)
    check_mode(cfg, captions)
    dvae_size = read_record(cfg.dvae, "dvae", "dvae").get("image_size")
    if dvae_size is not None:
        image_size_of(cfg, int(dvae_size))
    gen = Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)
    spaces = feature_spaces(gen.reranker, open_clip, device=gen.device)
    sampling: dict[str, Any] = dict(batch_size=cfg.batch_size, temperature=cfg.temperature, top_k=cfg.top_k,
                                    top_p=cfg.top_p, cond_scale=cfg.cond_scale)
    if captions == "shapes":
        report = evaluate(gen, cfg.n_seen, cfg.n_zeroshot, list(cfg.candidates), seed=cfg.seed, fid=cfg.fid,
                          rerank=cfg.rerank, spaces=spaces, **sampling)
    else:
        assert splits is not None  # choose_captions picks val only with the splits
        train, val = splits
        assert val is not None  # and with a val split
        size = image_size_of(cfg, int(dvae_size if dvae_size is not None else getattr(gen.dvae, "image_size")))
        report = evaluate_on_val(gen, val, train, cfg.n_val, list(cfg.candidates), spaces, size,
                                 background=list(cfg.data.background), seed=cfg.seed, fid=cfg.fid, rerank=cfg.rerank,
                                 **sampling)
        report["left_out"] = "caption accuracy and the waterfall: these captions have no judge (shapes world only)"
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json(cfg.out, report)
    if cfg.plot:
        plot_report(report, cfg.plot)
    waterfall_plot = cfg.waterfall_plot if captions == "shapes" else None
    if waterfall_plot:
        plot_waterfall(report, waterfall_plot)
    print(json.dumps({"captions": captions, **summary(report), "report": cfg.out, "plot": cfg.plot,
                      "waterfall_plot": waterfall_plot}))
    return report


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
