"""The EMA vector-quantised dVAE: nearest-code assignment, decoding from indices, dead-code restarts, artifact."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from dalle_lightning_callbacks.schedules import KLWeightAnnealing, TemperatureAnnealing
from dalle_lightning.artifacts import load_model, save_model
from dalle_lightning.lit.dvae import DVAEModule
from dalle_lightning.models.dvae_vq import VQVAE
from tests.test_dvae import images, loader

TINY = dict(image_size=32, vocab_size=16, latent_dim=4, n_hid=8, n_blk_per_group=1, group_count=4, codebook_dim=8)


def tiny(seed: int = 0, **overrides) -> VQVAE:
    torch.manual_seed(seed)
    return VQVAE(**{**TINY, **overrides})


def test_indices_are_the_nearest_codes_and_decode_like_the_codes() -> None:
    model = tiny()
    model.train()
    model(images())  # k-means initialisation on the first batch
    model.eval()
    x = images(seed=1)
    latents = model.encode(x)
    codebook = model.quantizer.codebook  # [K, d]
    flat = latents.permute(0, 2, 3, 1).reshape(-1, 4)
    nearest = torch.cdist(flat, codebook).argmin(dim=1).view(4, 4, 4)
    idx = model.get_codebook_indices(x)
    assert idx.dtype == torch.long and torch.equal(idx, nearest)
    codes, _, _ = model.quantize(latents)
    torch.testing.assert_close(codes, codebook[idx].permute(0, 3, 1, 2))
    torch.testing.assert_close(model.decode_stats(idx), model.decoder(codes), atol=1e-5, rtol=1e-5)
    assert torch.equal(model.reconstruct(x), model.decode_indices(idx))


def codes_in_use_after_training(threshold: float) -> int:
    model = tiny(threshold_ema_dead_code=threshold)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(20):
        out = model(images(8, seed=step))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    model.eval()
    return model.get_codebook_indices(torch.cat([images(8, seed=100 + s) for s in range(4)])).unique().numel()


def test_dead_codes_are_reseeded_from_the_batch() -> None:
    """A code nobody picks has its EMA count decay below the threshold and is replaced by an encoder output of the
    batch. Same model, data and steps: without restarts the k-means codebook collapses onto a few codes, with them
    every code is the nearest of some cell."""
    without, with_restarts = codes_in_use_after_training(0.0), codes_in_use_after_training(0.5)
    assert without <= 8 and with_restarts >= 14, (without, with_restarts)


def test_module_trains_with_the_schedules_doing_nothing_and_the_artifact_round_trips(tmp_path) -> None:
    lit = DVAEModule(tiny(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    trainer = pl.Trainer(
        max_steps=2, limit_val_batches=1, accelerator="cpu", default_root_dir=str(tmp_path),
        callbacks=[TemperatureAnnealing(steps=10), KLWeightAnnealing(steps=5)], enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, enable_checkpointing=False,
    )
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader())
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    assert not any(key.startswith("schedule/") for key in trainer.logged_metrics)
    model = lit.model.eval()
    save_model(tmp_path / "dvae.pt", {"_target_": "dalle_lightning.models.dvae_vq.VQVAE", **TINY}, model)
    loaded = load_model(tmp_path / "dvae.pt").eval()
    x = images()
    assert loaded.vocab_size == 16
    assert torch.equal(loaded.get_codebook_indices(x), model.get_codebook_indices(x))
    assert torch.equal(loaded.reconstruct(x), model.reconstruct(x))


def test_a_dead_code_threshold_at_the_mean_count_per_code_is_refused_before_any_update() -> None:
    """4 images x 16 cells / 16 codes = 4 latents per code per batch: a threshold of 4 would re-seed nearly every
    code every step, so the first training batch refuses it with the figures; 0 (no restarts) and values below the
    mean train."""
    model = tiny(threshold_ema_dead_code=4.0)
    before = model.quantizer.codebook.clone()
    with pytest.raises(ValueError, match=r"threshold_ema_dead_code=4 .*64 latents / 16 codes = 4\)"):
        model(images())
    assert torch.equal(model.quantizer.codebook, before)  # refused before k-means or any EMA update
    model.eval()
    model(images())  # evaluation never re-seeds codes: not checked
    for ok in (0.0, 0.04):
        assert torch.isfinite(tiny(threshold_ema_dead_code=ok).train()(images())["loss"])


def _codebook_after_steps(rank: int, world_size: int, kmeans: bool) -> tuple[torch.Tensor, int]:
    """In a worker: rank r trains on its half of each batch after share_codebook; its codebook afterwards."""
    model = tiny(kmeans_init=kmeans, threshold_ema_dead_code=0.5 if kmeans else 0.0)
    model.share_codebook()
    model.train()
    with torch.no_grad():
        for step in range(4):
            model(images(seed=10 + step)[rank * 2 : rank * 2 + 2])
    return model.quantizer.codebook.clone(), model._processes


@pytest.mark.distributed
def test_two_processes_update_one_codebook_as_one_process_on_the_global_batch() -> None:
    from tests.helpers.distributed import run_distributed

    # Without k-means and restarts the update is deterministic: each rank's codebook is the one a single process
    # builds from both halves of every batch.
    reference = tiny(kmeans_init=False, threshold_ema_dead_code=0.0)
    reference.train()
    with torch.no_grad():
        for step in range(4):
            reference(images(seed=10 + step))
    (a, world_a), (b, world_b) = run_distributed(_codebook_after_steps, 2, False)
    assert world_a == world_b == 2
    torch.testing.assert_close(a, reference.quantizer.codebook)
    torch.testing.assert_close(b, reference.quantizer.codebook)
    assert not torch.allclose(a, tiny(kmeans_init=False).quantizer.codebook)  # it did move
    # With k-means and dead-code restarts (random draws on each rank) the ranks still hold one codebook.
    (a, _), (b, _) = run_distributed(_codebook_after_steps, 2, True)
    assert torch.equal(a, b)
    # One process without a group: nothing changes.
    model = tiny()
    before = model.quantizer
    model.share_codebook()
    assert model.quantizer is before and model._processes == 1


def test_a_batch_with_nan_images_updates_the_codebook_from_its_finite_images_only() -> None:
    """The codebook learns in the forward pass, before the non-finite guard can skip the update: a NaN image must
    not reach it. Reference: the same model shown only the batch's finite images."""
    batch = images(seed=3)
    poisoned = batch.clone()
    poisoned[1] = float("nan")
    model, reference = tiny(kmeans_init=False, threshold_ema_dead_code=0.0), tiny(kmeans_init=False,
                                                                                 threshold_ema_dead_code=0.0)
    model.train(), reference.train()
    out = model(poisoned)
    reference(batch[[0, 2, 3]])
    assert not torch.isfinite(out["loss"])  # the guard still sees a bad step
    torch.testing.assert_close(model.quantizer.codebook, reference.quantizer.codebook)
    # A batch with nothing finite leaves the codebook as it was, and the model still reconstructs.
    before = model.quantizer.codebook.clone()
    model(torch.full_like(batch, float("inf")))
    torch.testing.assert_close(model.quantizer.codebook, before)
    assert torch.isfinite(model.eval().reconstruct(batch)).all()
