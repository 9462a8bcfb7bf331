"""The paper-scale experiments compose and build: models on the meta device, the strategy, the precision plugin.

``experiment=paper_dvae`` and ``experiment=paper_prior`` carry only what differs from the defaults; this test
checks the numbers the paper gives (sizes, batch, schedules, mesh, PowerSGD rank) and that every part
instantiates, without allocating the 12B parameters (``torch.device("meta")``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ProgressBar
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import CONF


def _compose(stage: str, experiment: str, tmp_path: Path) -> OmegaConf:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # The prior's sizes are the tokenizer's and the dVAE's (read from their files): the paper's, given here.
        text = ["model.text_vocab_size=16384", "model.text_len=256", "model.image_vocab_size=8192",
                "model.image_grid=32"] if stage == "prior" else []
        return compose("train", overrides=[f"stage={stage}", f"experiment={experiment}", f"paths.work_dir={tmp_path}",
                                           "data.train_shards='/data/shards/{00000..00099}.tar'", *text])


def _build(cfg) -> tuple[torch.nn.Module, object, object, list]:  # noqa: ANN001
    from dalle_lightning.cli.common import instantiate_dict

    with torch.device("meta"):
        model = instantiate(cfg.model)
    strategy = instantiate(cfg.strategy)
    precision = instantiate(cfg.precision)
    callbacks = instantiate_dict(OmegaConf.masked_copy(cfg.callbacks, [k for k in cfg.callbacks if k != "checkpoint"]))
    return model, strategy, precision, callbacks


def test_paper_dvae_experiment(tmp_path: Path) -> None:
    cfg = _compose("dvae", "paper_dvae", tmp_path)
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.num_nodes * cfg.trainer.devices == 64
    assert cfg.data.batch_size * cfg.trainer.num_nodes * cfg.trainer.devices == 512
    assert cfg.trainer.max_steps == 3_000_000 and cfg.module.optimizer.lr == 1e-4
    model, strategy, precision, callbacks = _build(cfg)
    assert sum(p.numel() for p in model.encoder.parameters()) == 53_786_240  # the released paper model
    assert sum(p.numel() for p in model.decoder.parameters()) == 43_829_766
    assert strategy.devices_per_node == 8 and strategy.inter_node.powersgd_kwargs["rank"] == 112
    assert precision.dtype == torch.float16
    precision.convert_module(model)  # finds the resblocks on the meta model: one scale each
    assert len(precision.scales) == 16
    names = {type(c).__name__: c for c in callbacks}
    assert names["TemperatureAnnealing"].steps == 150_000 and names["TemperatureAnnealing"].end == 1 / 16
    assert names["KLWeightAnnealing"].steps == 5_000 and names["KLWeightAnnealing"].end == 6.6
    assert names["EMA"].decay == 0.999


def test_paper_prior_experiment(tmp_path: Path) -> None:
    cfg = _compose("prior", "paper_prior", tmp_path)
    assert cfg.trainer.num_nodes * cfg.trainer.devices == 1024
    assert cfg.data.batch_size * cfg.trainer.num_nodes * cfg.trainer.devices == 1024
    assert cfg.trainer.max_steps == 430_000 and cfg.trainer.gradient_clip_val == 4.0
    assert cfg.module.optimizer.lr == 4.5e-4 and list(cfg.module.optimizer.betas) == [0.9, 0.96]
    assert cfg.module.scheduler.warmup_steps == 5_000
    model, strategy, precision, callbacks = _build(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 11.5e9 < n < 12.5e9, n  # "about 12 billion parameters"
    assert model.d_model == 3968 and len(model.layers) == 64
    kinds = model.attention_types()
    assert kinds.count("row") == 47 and kinds.count("column") == 16 and kinds[-1] == "conv"
    assert strategy.devices_per_node == 8 and strategy.inter_node.powersgd_kwargs["rank"] == 112
    precision.convert_module(model)
    assert len(precision.scales) == 128  # attention and MLP of 64 layers
    bars = {type(c).__name__ for c in callbacks if isinstance(c, ProgressBar)}
    assert bars in ({"IntervalRichProgressBar"}, {"IntervalTQDMProgressBar"})  # the kind Lightning would pick
    assert {type(c).__name__ for c in callbacks} - bars == {"LearningRateMonitor", "NonFiniteGuard",
                                                            "SkippedSampleMetrics", "EMA", "CompiledGraphs"}

    # The paper's compression at d_model 3968: 1 - 5 r / (8 d) = 86% for r = 896 in all.
    from dalle_lightning_plugins.compression.compression_report import compression_report

    report = compression_report(model, nodes=128, devices_per_node=8, rank=0, powersgd_rank=112)
    assert report["compression"] == pytest.approx(1 - 5 * 896 / (8 * 3968), abs=0.02)
