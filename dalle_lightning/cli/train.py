"""``dalle-train``: train one stage (tokenizer, dvae, clip, prior) from the composed Hydra config.

Each stage writes one artifact (``output``) that later stages read; an existing artifact is reused unless
``stage.force=true`` or the run resumes (``resume=auto`` or ``resume=PATH``: continue a run from its checkpoint,
exactly where it stopped; ``docs/resume.md``). Returns the final metrics, which multirun sweeps summarise.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from hydra.utils import instantiate
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dalle_lightning_callbacks.epoch_end_resume import EpochEndResume
from dalle_lightning_callbacks.random_state import RandomState
from dalle_lightning.artifacts import save_model
from dalle_lightning.cli import checks, sizes
from dalle_lightning.cli.common import check_keys, hydra_app, instantiate_dict, process_rank, strategy_and_precision
from dalle_lightning.cli.held_logs import held_logs, release
from dalle_lightning.run.resume import check_data, resume_checkpoint
from dalle_lightning.run.start_decision import CONTINUE, decide_start
from dalle_lightning.run.stopped import stop_reported
from dalle_lightning_plugins.environments.elastic import init_default_group
from dalle_lightning_plugins.environments.launch_identity import this_launch
from dalle_lightning.lineage import stage_record
from dalle_lightning_plugins.io.atomic_files import write_json

log = logging.getLogger("dalle_lightning.train")

TOP_LEVEL_KEYS = {"paths", "model", "data", "trainer", "strategy", "precision", "callbacks", "logger", "stage",
                  "seed", "output", "module", "objective", "verbose", "resume", "float32_matmul_precision",
                  "shapes"}  # experiment/shapes.yaml: each stage's run length and batch size
STAGES = ("tokenizer", "dvae", "clip", "prior")
LENGTH_SAMPLE = 10_000  # training captions whose token lengths the tokenizer stage reports


def train_tokenizer(cfg: DictConfig) -> dict[str, Any]:
    """Train the BPE on the training captions (the txt members of the image shards, less a held-out validation
    slice); unreadable shards and unusable captions are skipped and counted, and no usable caption at all is a
    one-line error. The captions longer than ``model.text_len`` tokens are counted and reported in one line."""
    from dalle_lightning.data.datamodule import caption_text
    from dalle_lightning.data.epoch_loader import no_data_message
    from dalle_lightning.data.skips import SkipCounter, read_shards
    from dalle_lightning.data.tokenizer import CaptionTokenizer

    split = instantiate(cfg.data).splits()[0]
    urls = split.urls
    limit = cfg.stage.max_captions
    skipped = SkipCounter()
    used = 0
    kept: list[str] = []  # the first captions, to measure their lengths once the BPE exists

    def captions():
        nonlocal used
        for sample in read_shards(urls, skipped):
            if split.keep is not None and not split.keep(sample):
                continue
            text = caption_text(sample, skipped, f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}")
            if text is None:
                continue
            if len(kept) < LENGTH_SAMPLE:
                kept.append(text)
            yield text
            used += 1
            if limit is not None and used >= limit:
                return

    texts = captions()
    first = next(texts, None)  # no caption at all must fail, not train a BPE of the bare byte alphabet
    if first is None:
        raise ValueError(no_data_message("the tokenizer's training data", "caption", urls, skipped.summary))
    tok = CaptionTokenizer.train(itertools.chain([first], texts), vocab_size=cfg.model.vocab_size, text_len=cfg.model.text_len,
                                 min_frequency=cfg.model.min_frequency)
    tok.save(cfg.output)
    log.info("tokenizer with %d tokens and text_len=%d written to %s from %d captions", tok.vocab_size, tok.text_len,
             cfg.output, used)
    for text in kept:
        tok.encode(text)
    line = tok.truncation_line(f"training captions (the first {len(kept)})", len(kept),
                               cut="will be cut by dalle-encode")
    if line:
        log.warning("%s", line)
    counts = {f"data/skipped/{reason.replace(' ', '_')}": float(n) for reason, n in skipped.items() if n}
    for name, n in counts.items():
        log.info("%s=%d", name, n)
    return {"vocab_size": tok.vocab_size, "captions": float(used), "data/skipped_total": float(sum(skipped.values())),
            **counts}


def model_meta(cfg: DictConfig, model: torch.nn.Module) -> dict[str, Any]:
    """Facts later stages read from the artifact through ``${meta:...}``, and what it was trained with."""
    meta: dict[str, Any] = {"stage": cfg.stage.name, "parameters": sum(p.numel() for p in model.parameters())}
    for key in ("vocab_size", "grid_size", "image_size", "text_len", "image_grid", "text_vocab_size",
                "image_vocab_size"):
        value = getattr(model, key, None)
        if isinstance(value, int):
            meta[key] = value
    trained_with = stage_record(cfg)
    if trained_with:
        meta["trained_with"] = trained_with
    return meta


def fit(cfg: DictConfig, ckpt_path: str | None = None) -> dict[str, Any]:
    """Build data, model, LightningModule, callbacks and Trainer from config; fit (from ``ckpt_path`` when
    resuming); save the artifact."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    # TF32 for the fp32 products the paper keeps (the prior's heads, the dVAE's logits) where the user allows it,
    # as Lightning advises on GPUs with tensor cores. Not set without CUDA: the CPU keeps exact fp32 products.
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    inherited_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")  # a missing shard fails here, before a Trainer is built
    model = instantiate(cfg.model)
    module = instantiate(cfg.module, model=model)
    # Exact resume: every rank's random states travel in checkpoints, and a checkpoint that ended an epoch of the
    # (unsized) streamed data resumes at the next epoch's first batch.
    callbacks = [*instantiate_dict(cfg.callbacks), RandomState(), EpochEndResume()]
    if not cfg.trainer.enable_progress_bar:  # Lightning refuses a bar callback with the bar disabled
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    logger = instantiate(cfg.logger) if cfg.logger else False
    if this_launch().restarting_launcher:  # the launcher stops healthy workers with SIGTERM to restart them
        logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector").setLevel(logging.WARNING)
    with held_logs() as held:  # Lightning's start-up lines wait for the decision: a continued launch printed them
        trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger,
                                          **strategy_and_precision(cfg))
        if not inherited_group:  # torchrun, srun: the group now, so that the ranks agree on where to start
            init_default_group(trainer.strategy)
    decision = decide_start(cfg, ckpt_path, _run_dir(), _sweep(), _overrides())  # afresh, resume=, or continue
    if decision.kind == CONTINUE:
        quiet_restart(trainer)
    release(held, below=logging.WARNING if decision.kind == CONTINUE else None)
    log.info("%s", decision.reason)  # rank 0 (the other ranks' project logs are off): once per run
    ckpt_path = decision.checkpoint
    if ckpt_path is not None:  # resume=PATH, resume=auto and a launcher's restart alike: data only, one line if not
        check_data(ckpt_path, "resume", _run_dir())
    with stop_reported(cfg, trainer, ckpt_path, _sweep()):  # SIGTERM, SIGINT: one line naming the checkpoint
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    has_validation = getattr(datamodule, "has_validation", None)
    if callable(has_validation) and has_validation() and not cfg.trainer.fast_dev_run:
        # Fit may stop mid-epoch (max_steps) without validating: measure what is saved, the final (EMA) weights.
        with stop_reported(cfg, trainer, ckpt_path, _sweep()):
            trainer.validate(module, datamodule=datamodule, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    figures = getattr(trainer.strategy, "exchange_figures", None)  # ShardedPowerSGDStrategy: bytes, exchange time
    if callable(figures):
        metrics.update(figures())
    for callback in callbacks:  # e.g. dalle_lightning_callbacks.step_timer.StepTimer: training rate without validation
        rate = getattr(callback, "updates_per_s", None)
        if isinstance(rate, float):
            metrics["time/updates_per_s"] = rate
        # dalle_lightning_callbacks.skipped_samples: skipped and converted samples
        totals = getattr(callback, "totals", None)
        if isinstance(totals, dict):
            metrics.update(totals)
    divergence = getattr(trainer.strategy, "replica_divergence", None)
    if callable(divergence):  # a strategy that keeps copies of each shard on several nodes checks they agree
        metrics["replica_divergence"] = divergence()
    if not cfg.trainer.fast_dev_run:
        state = model_state_dict(trainer, module, model)  # collective under a sharding strategy: every rank calls
        if trainer.is_global_zero:
            save_model(cfg.output, cfg.model, model, meta=model_meta(cfg, model), state_dict=state)
            log.info("%s written to %s", cfg.stage.name, cfg.output)
    if not inherited_group:  # a process group the caller made is the caller's to end
        release_process_group()
    return metrics


def quiet_restart(trainer: pl.Trainer) -> None:
    """A continued launch prints what is new only: Lightning's start-up lines (accelerators, precision, the
    process group, the model summary) were printed by the launch's first attempt and have not changed, and its
    checkpoint directory is this launch's own (Lightning warns that it is not empty)."""
    for name in ("lightning.pytorch", "lightning.fabric", "dalle_lightning"):  # "precision=auto: ..." too
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    if process_rank() == 0:
        log.setLevel(logging.INFO)  # this module's lines stay
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelSummary)]
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def release_process_group() -> None:
    """End the run's process group once the artifact is written and no collective is left. Left to the
    interpreter's exit, gloo's threads are torn down in no set order and a rank can abort after a finished run
    ("terminate called without an active exception"), which torchrun reports as a failed job."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def model_state_dict(trainer: pl.Trainer, module: pl.LightningModule, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained model's full, unsharded state dict on CPU (complete on rank 0).

    A strategy that shards parameters offers ``full_state_dict()`` (a collective returning the LightningModule's
    state with whole tensors); the model's entries are those under its attribute name in the module. A model
    another strategy sharded itself (``fully_shard`` in ``configure_model`` under Lightning's
    ``ModelParallelStrategy``) holds DTensors: torch gathers them whole, every rank taking part."""
    export = getattr(trainer.strategy, "full_state_dict", None)
    if not callable(export):
        state = model.state_dict()
        if any(isinstance(v, DTensor) for v in state.values()):
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().cpu() for k, v in state.items()}
    prefix = next(name for name, child in module.named_children() if child is model) + "."
    return {k[len(prefix):]: v for k, v in export().items() if k.startswith(prefix)}


def _run_dir() -> Path | None:
    """This run's Hydra output directory (None outside a Hydra app)."""
    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def _overrides() -> list[str] | None:
    """This run's command-line overrides (None outside a Hydra app)."""
    return [str(o) for o in HydraConfig.get().overrides.task] if HydraConfig.initialized() else None


def _sweep() -> tuple[Path, list[str]] | None:
    """This job's sweep directory and overrides inside a multirun (None otherwise), where ``resume=auto`` looks."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir), [str(o) for o in hydra_cfg.overrides.task]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured stage; reuse its artifact when it exists (unless forced or resuming). Returns metrics."""
    check_keys(cfg, TOP_LEVEL_KEYS)
    stage = cfg.stage.name
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a stage; expected one of {list(STAGES)}")
    checks.training(cfg)  # bad values and an unwritable output fail now, not after loading or training
    sizes.check_training(cfg)  # sizes against each other and against the artifacts they come from
    checks.saved_models(cfg)  # the models callbacks load (after the artifacts the model's sizes come from)
    ckpt_path = resume_checkpoint(cfg, _run_dir(), _sweep())  # a checkpoint that is not there fails now too
    out = Path(cfg.output)
    fresh = cfg.stage.force or ckpt_path is not None or cfg.get("trainer", {}).get("fast_dev_run", False)
    if out.exists() and not fresh:
        log.info("%s exists; reusing it (stage.force=true retrains, resume=auto continues its last run)", out)
        return {"reused": 1.0}
    stage_record(cfg)  # artifacts and data that do not belong together fail now, not after training
    start = time.perf_counter()
    metrics = train_tokenizer(cfg) if stage == "tokenizer" else fit(cfg, ckpt_path)
    metrics["wall_time_s"] = time.perf_counter() - start
    return metrics


@hydra_app("train", every_rank=True)
def main(cfg: DictConfig) -> float | None:
    metrics = run(cfg)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # Every process of a run runs this app (torchrun, and Lightning's launcher, which starts the others with
    # LOCAL_RANK but no RANK): the global rank decides the one writer.
    if process_rank() == 0:
        write_json(run_dir / "metrics.json", {"overrides": list(hydra_cfg.overrides.task), "metrics": metrics})
        log.info("metrics written to %s by rank 0", run_dir / "metrics.json")
    if cfg.objective is None:
        return None
    if cfg.objective not in metrics:
        raise KeyError(f"objective={cfg.objective!r} was not logged; logged metrics: {sorted(metrics)}")
    return metrics[cfg.objective]


if __name__ == "__main__":
    main()
