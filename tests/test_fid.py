"""FIDCallback and ContrastiveScore: values against an independent FID (numpy/scipy Frechet distance of the
same features), reset between evaluations, the step/epoch schedule, two ranks, and the CLIP feature path.
"""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn
from torch.utils.data import DataLoader

from dalle_lightning_callbacks.contrastive import ContrastiveScore
from dalle_lightning_callbacks.fid import ClipImageFeatures, FIDCallback, build_fid
from tests.helpers.distributed import run_distributed

N_VAL, BATCH, SIZE = 24, 6, 16


def features(images: torch.Tensor) -> torch.Tensor:
    """A fixed feature extractor: 2x2 average colour per quadrant, 12 features."""
    return nn.functional.adaptive_avg_pool2d(images, 2).flatten(1)


def frechet(real: np.ndarray, fake: np.ndarray) -> float:
    """The Frechet distance of two feature sets, written from its definition (scipy's sqrtm)."""
    mu1, mu2 = real.mean(0), fake.mean(0)
    s1, s2 = np.cov(real, rowvar=False), np.cov(fake, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def val_images() -> torch.Tensor:
    return torch.rand(N_VAL, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def generated(images: torch.Tensor, epoch: int) -> torch.Tensor:
    """What the test module 'generates' for a batch: a darker, epoch-dependent version of the real images."""
    return images * (0.5 + 0.1 * epoch)


def collate(items: list[tuple[torch.Tensor, str]]) -> dict:
    return {"image": torch.stack([i for i, _ in items]), "text": [t for _, t in items]}


class Captioned(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:
        return self.images[i], f"caption {i}"


class Generating(pl.LightningModule):
    """A real LightningModule implementing the FID protocol; its 'generator' is a known image transform."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def fid_generate(self, batch: dict) -> torch.Tensor:
        return generated(batch["image"], self.current_epoch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return (self.w - 1).pow(2).sum()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Captioned(val_images()), batch_size=BATCH, collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Captioned(val_images()), batch_size=BATCH, collate_fn=collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """Keeps every FID the callback computed, with the epoch and step it was computed at."""

    def __init__(self, fid: FIDCallback) -> None:
        self.fid = fid
        self.seen: list[tuple[int, int, float]] = []
        self._last: dict | None = None

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fid.last and self.fid.last is not self._last:  # a new evaluation happened in this validation
            self._last = self.fid.last
            self.seen.append((trainer.current_epoch, trainer.global_step, self.fid.last[self.fid.metric_name]))


def fit(callback: FIDCallback, epochs: int, **trainer_kwargs) -> list[tuple[int, int, float]]:
    recorder = Recorder(callback)  # after the FID callback, so it sees this validation's value
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback, recorder], **trainer_kwargs)
    trainer.fit(Generating())
    if recorder.seen:  # the value was logged, not only computed, under the name of its feature space
        assert callback.metric_name == "val/fid_custom"
        assert float(trainer.callback_metrics["val/fid_custom"]) == pytest.approx(recorder.seen[-1][2], rel=1e-5)
    return recorder.seen


def expected(num_images: int, epoch: int) -> float:
    real = val_images()[:num_images]
    return frechet(features(real).double().numpy(), features(generated(real, epoch)).double().numpy())


def test_fid_matches_the_frechet_distance_of_the_same_features() -> None:
    real, fake = val_images(), generated(val_images(), 3)
    metric = build_fid(features, feature_dim=12)
    for chunk in range(0, N_VAL, BATCH):
        metric.update(real[chunk : chunk + BATCH], real=True)
        metric.update(fake[chunk : chunk + BATCH], real=False)
    ref = frechet(features(real).double().numpy(), features(fake).double().numpy())
    assert float(metric.compute()) == pytest.approx(ref, rel=1e-4)
    assert ref > 1e-3  # the two sets really differ


def test_callback_logs_each_epoch_from_fresh_states() -> None:
    # 20 images: three full batches and 2 of the fourth (truncation); the generator changes every epoch, so a
    # missing reset would mix two epochs' images and the second value would differ from its own reference.
    cb = FIDCallback(every_n_epochs=1, num_images=20, feature_extractor=features, feature_dim=12)
    seen = fit(cb, epochs=2, limit_train_batches=1)
    assert [epoch for epoch, _, _ in seen] == [0, 1]
    for epoch, _, value in seen:
        assert value == pytest.approx(expected(20, epoch), rel=1e-4)
    assert cb.fid.real_features_num_samples == 0 and cb.fid.fake_features_num_samples == 0  # reset after compute


def test_reference_is_the_fid_of_the_real_images_against_the_next_real_images() -> None:
    # 24 validation images in batches of 6, num_images=12: batches 1-2 are generated for, batches 3-4 are the
    # reference's second real set; the reference is logged beside the FID under its own name.
    cb = FIDCallback(every_n_epochs=1, num_images=12, feature_extractor=features, feature_dim=12)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(Generating())
    real = val_images()
    want = frechet(features(real[:12]).double().numpy(), features(real[12:24]).double().numpy())
    assert cb.reference_name == "val/fid_custom_reference"
    assert float(trainer.callback_metrics["val/fid_custom_reference"]) == pytest.approx(want, rel=1e-4)
    assert float(trainer.callback_metrics["val/fid_custom"]) == pytest.approx(expected(12, 0), rel=1e-4)
    without = FIDCallback(num_images=12, feature_extractor=features, feature_dim=12, reference=False)
    assert without.reference is None


def test_reference_without_a_second_set_compares_the_halves_of_the_first(caplog: pytest.LogCaptureFixture) -> None:
    # Validation holds only the num_images evaluated: the reference is the FID of their two halves, with a warning.
    cb = FIDCallback(num_images=N_VAL, feature_extractor=features, feature_dim=12)
    cb.update(Generating(), {"image": val_images(), "text": [f"c{i}" for i in range(N_VAL)]})
    with caplog.at_level("WARNING", logger="dalle_lightning_callbacks.fid"):
        out = cb.compute()
    real = features(val_images()).double().numpy()
    assert out["val/fid_custom_reference"] == pytest.approx(frechet(real[:12], real[12:]), rel=1e-4)
    assert "measured on 12 real images against 12" in caplog.text


def test_every_n_steps_waits_for_the_first_validation_after_each_multiple() -> None:
    # Validation after every update; FID only at steps 3 and 6 (not 1, 2, 4, 5).
    cb = FIDCallback(every_n_steps=3, num_images=12, feature_extractor=features, feature_dim=12)
    seen = fit(cb, epochs=6, limit_train_batches=1)
    assert [step for _, step, _ in seen] == [3, 6]


def test_every_n_epochs_skips_other_epochs() -> None:
    cb = FIDCallback(every_n_epochs=2, num_images=12, feature_extractor=features, feature_dim=12)
    assert [epoch for epoch, _, _ in fit(cb, epochs=4, limit_train_batches=1)] == [1, 3]


def test_contrastive_score_is_the_mean_cosine_of_the_scorer() -> None:
    def scorer(images: torch.Tensor, captions: list[str]) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3)) * torch.tensor([len(c) for c in captions], dtype=torch.float32)

    images = val_images()
    captions = [f"caption {i}" for i in range(N_VAL)]
    metric = ContrastiveScore(scorer)
    metric.update(images[:10], captions[:10])
    metric.update(images[10:], captions[10:])
    assert float(metric.compute()) == pytest.approx(float(scorer(images, captions).mean()), rel=1e-6)
    with pytest.raises(ValueError, match="3 images but 2 captions"):
        metric.update(images[:3], captions[:2])


def _two_rank_worker(rank: int, world_size: int) -> tuple[float, float, float]:
    cb = FIDCallback(num_images=N_VAL, feature_extractor=features, feature_dim=12,
                     clip_scorer=lambda images, captions: images.mean(dim=(1, 2, 3)))
    module = Generating()
    images = val_images()[rank::world_size]  # each rank sees its own half, as a distributed sampler gives it
    cb.update(module, {"image": images, "text": [f"c{i}" for i in range(len(images))]})
    out = cb.compute()
    return out["val/fid_custom"], out["val/clip_score"], out["val/fid_custom_reference"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_compute_the_fid_of_all_images() -> None:
    results = run_distributed(_two_rank_worker, 2, timeout=120)
    real = val_images()
    ref_fid = expected(N_VAL, 0)
    ref_clip = float(generated(real, 0).mean(dim=(1, 2, 3)).mean())
    # The reference gathers every rank's real images (rank 0's, then rank 1's) and, with no second set, compares halves.
    ref_reference = frechet(features(real[0::2]).double().numpy(), features(real[1::2]).double().numpy())
    for fid, clip, reference in results:
        assert fid == pytest.approx(ref_fid, rel=1e-4)
        assert clip == pytest.approx(ref_clip, rel=1e-5)
        assert reference == pytest.approx(ref_reference, rel=1e-4)


def test_clip_image_features_are_the_reranker_embeddings() -> None:
    from dalle_lightning.models import clip as clip_models
    from dalle_lightning.generation.rerank import Reranker

    torch.manual_seed(0)
    model = clip_models.create()
    reranker = Reranker.from_model(model)
    ours = ClipImageFeatures(model)
    assert ours.num_features == 64
    for size in (64, 32, 128):  # native, enlarged and shrunk to the model's 64x64 by both paths
        images = torch.rand(4, 3, size, size)
        torch.testing.assert_close(ours(images), reranker.embed_images(images), rtol=1e-5, atol=1e-6)
    # The metric built from a Reranker uses its embed_images (the default of the shapes pipeline).
    metric = build_fid(reranker)
    assert metric.inception.num_features == 64


def test_bad_inputs_are_clear_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        FIDCallback(inception_weights=str(tmp_path / "nope.pth"))
    with pytest.raises(ValueError, match="features='clip' but no feature_extractor"):
        FIDCallback(features="clip")
    with pytest.raises(ValueError, match="every_n_steps=0"):
        FIDCallback(every_n_steps=0, feature_extractor=features, feature_dim=12)
    cb = FIDCallback(num_images=4, feature_extractor=features, feature_dim=12)

    class Bad(Generating):
        def fid_generate(self, batch: dict) -> torch.Tensor:
            return batch["image"] * 2 - 1  # [-1, 1]: a common mistake

    with pytest.raises(ValueError, match=r"fid_generate\(\) output range"):
        cb.update(Bad(), {"image": torch.full((4, 3, SIZE, SIZE), 0.1), "text": ["a"] * 4})


def test_callback_config_with_the_project_clip_instantiates(tmp_path) -> None:
    """The configuration the pipeline uses: features and contrastive score from a saved shapes-CLIP artifact."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from dalle_lightning.artifacts import load_model, save_model
    from dalle_lightning.models import clip as clip_models
    from dalle_lightning.generation.rerank import Reranker

    clip_cfg = {"_target_": "dalle_lightning.models.clip.create", "name": clip_models.SHAPES_CLIP}
    save_model(tmp_path / "clip.pt", clip_cfg, instantiate(clip_cfg))
    cfg = OmegaConf.create(f"""
    _target_: dalle_lightning_callbacks.fid.FIDCallback
    every_n_epochs: 1
    num_images: 8
    features: clip
    feature_extractor:
      _target_: dalle_lightning.generation.rerank.Reranker.from_model
      model: {{_target_: dalle_lightning.artifacts.load_model, path: {tmp_path / 'clip.pt'}}}
    clip_scorer: ${{.feature_extractor}}
    """)
    cb = instantiate(cfg)
    images = val_images()[:8]
    images = nn.functional.interpolate(images, size=64)
    captions = [f"a red square {i}" for i in range(8)]
    cb.update(Generating(), {"image": images, "text": captions})
    out = cb.compute()
    reference = Reranker.from_model(load_model(tmp_path / "clip.pt"))
    fake = generated(images, 0)
    want = frechet(reference.embed_images(images).double().numpy(), reference.embed_images(fake).double().numpy())
    assert out["val/fid_clip"] == pytest.approx(want, rel=1e-3, abs=1e-6)
    assert out["val/clip_score"] == pytest.approx(float(reference.score(fake, captions).mean()), abs=1e-5)
