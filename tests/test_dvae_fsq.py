"""The FSQ dVAE: its codes, its loss, training, the schedules it has no use for, and its artifact."""

from __future__ import annotations

import functools
import itertools
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from dalle_lightning_callbacks.schedules import KLWeightAnnealing, TemperatureAnnealing
from dalle_lightning.artifacts import load_model, save_model
from dalle_lightning.lit.dvae import DVAEModule
from dalle_lightning.models.dvae_fsq import FSQVAE
from tests.test_dvae import images, loader, squares

TINY = dict(image_size=32, levels=[5, 4, 3], n_hid=8, n_blk_per_group=1, group_count=4, codebook_dim=8)


def tiny(seed: int = 0) -> FSQVAE:
    torch.manual_seed(seed)
    return FSQVAE(**TINY)


def reference_indices(latents: torch.Tensor, levels: list[int]) -> torch.Tensor:
    """FSQ written out from the paper (arXiv 2309.15505, appendix A.1): bound each channel with tanh to
    (L - 1) / 2 (shifted by half a step for even L), round, and read the digits as a mixed-radix number (the
    first channel is the lowest digit)."""
    idx = torch.zeros(latents.shape[0], *latents.shape[2:], dtype=torch.long)
    radix = 1
    for c, level in enumerate(levels):
        half = (level - 1) * (1 + 1e-3) / 2
        offset = 0.5 if level % 2 == 0 else 0.0
        digit = (torch.tanh(latents[:, c].double() + math.atanh(offset / half)) * half - offset).round()
        idx += (digit.long() + level // 2) * radix
        radix *= level
    return idx


def test_vocabulary_is_the_product_of_the_levels_and_the_codes_are_fsq() -> None:
    model = tiny()
    assert model.vocab_size == 60 and model.grid_size == 4
    x = images()
    idx = model.get_codebook_indices(x)
    assert idx.shape == (4, 4, 4) and idx.dtype == torch.long
    assert torch.equal(idx, reference_indices(model.encode(x), TINY["levels"]))


def test_every_index_decodes_to_its_own_code() -> None:
    """The implicit codebook is a bijection: 60 indices, 60 distinct grid points, each read back as its index."""
    model = tiny()
    codes = model.quantizer.indices_to_codes(torch.arange(60))
    grid = {tuple(round(v, 4) for v in row) for row in codes.tolist()}
    assert len(grid) == 60
    expected = set(itertools.product(*[[round((d - L // 2) / (L // 2), 4) for d in range(L)] for L in TINY["levels"]]))
    assert grid == expected
    assert torch.equal(model.quantizer.codes_to_indices(codes).long(), torch.arange(60))


def test_decoding_indices_equals_decoding_the_quantized_latents() -> None:
    model = tiny()
    x = images()
    codes, idx = model.quantize(model.encode(x))
    torch.testing.assert_close(model.decode_stats(idx), model.decoder(codes), atol=1e-5, rtol=1e-5)
    assert torch.equal(model.reconstruct(x), model.decode_indices(idx))
    out = model(x)
    assert torch.equal(out["indices"], idx)
    torch.testing.assert_close(out["loss"], model.logit_laplace_nll(model.decoder(codes), x))


def test_bad_levels_and_codes_raise_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"levels=\[8, 2\]"):
        FSQVAE(image_size=32, levels=[8, 2])
    with pytest.raises(ValueError, match=r"levels=\[\]"):
        FSQVAE(image_size=32, levels=[])
    with pytest.raises(ValueError, match="59"):
        tiny().decode_indices(torch.full((1, 4, 4), 60))


def test_straight_through_rounding_carries_gradients_into_the_encoder() -> None:
    model = tiny()
    model(images())["loss"].backward()
    grad = model.encoder.blocks.input.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_codes_stay_fp32_under_bf16_autocast() -> None:
    model = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes, _ = model.quantize(model.encode(images()))
        out = model(images())
    assert codes.dtype == torch.float32 and torch.isfinite(out["loss"])


@pytest.mark.parametrize("seed", [0, 1])
def test_training_decreases_the_loss(seed: int) -> None:
    model = tiny(seed)
    x = squares(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(x)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_module_trains_and_the_gumbel_schedules_do_nothing(tmp_path: str) -> None:
    lit = DVAEModule(tiny(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), temperature=5.0, kl_weight=1.0)
    assert lit.temperature is None and lit.kl_weight is None
    schedules = [TemperatureAnnealing(start=5.0, steps=10), KLWeightAnnealing(beta=6.6, steps=5)]
    trainer = pl.Trainer(
        max_steps=2, limit_val_batches=1, accelerator="cpu", callbacks=schedules, default_root_dir=str(tmp_path),
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, enable_checkpointing=False,
    )
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader())
    metrics = trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/mse", "val/perplexity"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert not any(key.startswith("schedule/") or key == "train/kl" for key in trainer.logged_metrics)
    assert lit.temperature is None and lit.kl_weight is None


def test_artifact_round_trip(tmp_path) -> None:
    model = tiny().eval()
    cfg = {"_target_": "dalle_lightning.models.dvae_fsq.FSQVAE", **TINY}
    save_model(tmp_path / "dvae.pt", cfg, model, meta={"stage": "dvae", "vocab_size": model.vocab_size})
    loaded = load_model(tmp_path / "dvae.pt").eval()
    x = images()
    assert loaded.vocab_size == 60
    assert torch.equal(loaded.get_codebook_indices(x), model.get_codebook_indices(x))
    assert torch.equal(loaded.reconstruct(x), model.reconstruct(x))
