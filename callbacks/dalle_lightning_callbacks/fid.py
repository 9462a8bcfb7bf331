"""FID (and the contrastive score) of generated images during training, on torchmetrics.

Protocol: the LightningModule has

- ``fid_generate(batch) -> FloatTensor[B, 3, H, W]`` in [0, 1]: images generated from the *captions* of a
  validation batch (so generated and real images describe the same captions);
- optionally ``fid_real(batch) -> FloatTensor[B, 3, H, W]``: the real images of that batch (default:
  ``batch[image_key]``, for image-text batches; a prior trained on token batches returns its dVAE decoding
  of the real codes);
- optionally ``fid_captions(batch) -> list[str]``: the captions, for the contrastive score (default:
  ``batch[caption_key]``).

FID is measured during validation, on the first ``num_images`` validation images (split evenly over ranks):
at every ``every_n_epochs``-th validation epoch, or, when ``every_n_steps`` is set, at the first validation
after each multiple of ``every_n_steps`` updates (match ``trainer.val_check_interval`` to it). Metric states
are reset at every evaluation and synchronised across ranks by torchmetrics when computed, so the logged value
is the FID of all ranks' images together.

An FID is only comparable with FIDs in the same feature space, so the metric is named after it:
``val/fid_<features>``. Nor is an FID readable alone: its scale is the spread of the features, and a small or
barely trained CLIP maps every image to nearly the same point (a randomly initialised shapes CLIP: mean cosine
0.99998 between the embeddings of different renders), where any two image sets are 1e-5 apart, noise and renders
alike. So beside it the callback logs ``val/fid_<features>_reference`` (``reference=True``): the FID between the
real images of the evaluation and the next ``num_images`` real validation images, at the same size, in the same
space: what a generator that drew real images would score. Read the FID against it, never against 0. The
reference costs a second feature pass over the real images and none of generation. It wants 2 x ``num_images``
validation images; with fewer it is measured on what there is, and with no second set at all (under 2 images
beyond the first ``num_images``) between the two halves of the first set; a warning says which, since a smaller
set's FID sits higher.

Feature spaces (no download ever happens):

- ``features="inception"``: the standard Inception-v3 of published FIDs (torchmetrics' ``NoTrainInceptionV3``,
  needs ``torch-fidelity``), read from ``inception_weights`` or from torch's hub cache (see
  :mod:`dalle_lightning_callbacks.inception`); any ``feature_extractor`` is then ignored;
- ``feature_extractor``: a module or callable ``images [B, 3, H, W] in [0, 1] -> features [B, D]``, named by
  ``features`` (``"custom"`` when unnamed); an open_clip model (anything with ``encode_image``) is wrapped by
  :class:`ClipImageFeatures`, and an object with ``embed_images`` (``dalle_lightning.generation.rerank.Reranker``) is used
  through that method. The project's default is the image tower of its own CLIP (``features="clip"``: the one
  ``dalle-train stage=clip`` trained on the pipeline's data, the shapes world or any other), so the configuration
  runs offline, and Inception, which has never seen the shapes world, is a choice. (Before, the metric was
  ``val/fid_shapes_clip`` whatever data the CLIP saw.)
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import Metric
from torchmetrics.image.fid import FrechetInceptionDistance
from typing_extensions import override

from dalle_lightning_callbacks.batches import take
from dalle_lightning_callbacks.contrastive import ContrastiveScore
from dalle_lightning_callbacks.inception import INCEPTION, inception_weights as find_inception_weights, weights_only_loads
from dalle_lightning_callbacks.sharding import full_parameters

INCEPTION_DIM = 2048

log = logging.getLogger(__name__)


def check_images(images: Any, name: str) -> torch.Tensor:
    """``images`` must be a float ``[B, 3, H, W]`` batch in [0, 1] (fail early on uint8 or [-1, 1] inputs)."""
    if not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"{name} has shape/type {shape}; expected a float tensor [B, 3, H, W] with values in [0, 1]")
    lo, hi = images.min().item(), images.max().item()
    if lo < -1e-4 or hi > 1 + 1e-4:
        raise ValueError(f"{name} range [{lo:.3g}, {hi:.3g}]; expected values in [0, 1]")
    return images.float().clamp(0, 1)


class ClipImageFeatures(nn.Module):
    """Image embeddings of an open_clip model: [0, 1] images are resized and standardised as the model expects,
    then ``encode_image`` runs; unit-norm by default, as reranking uses them."""

    def __init__(
        self,
        model: nn.Module,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        image_size: int | tuple[int, int] | None = None,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not callable(getattr(model, "encode_image", None)):
            raise TypeError(f"{type(model).__name__} has no encode_image(); expected an open_clip model")
        cfg = getattr(getattr(model, "visual", None), "preprocess_cfg", None) or {}
        mean = mean if mean is not None else cfg.get("mean")
        std = std if std is not None else cfg.get("std")
        size = image_size if image_size is not None else getattr(model.visual, "image_size", None)
        if mean is None or std is None or size is None:
            raise ValueError(f"{type(model).__name__} has no visual.preprocess_cfg/image_size; pass mean, std and image_size")
        self.model = model.eval().requires_grad_(False)
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.normalize = normalize
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        with torch.no_grad():
            self.num_features = int(self(torch.zeros(1, 3, *self.size)).shape[-1])

    @override
    def train(self, mode: bool = True) -> "ClipImageFeatures":
        return super().train(False)  # a frozen feature extractor never leaves eval mode (no dropout)

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.mean.device, torch.float32)
        if tuple(x.shape[-2:]) != self.size:  # as the reranker resizes: area to shrink, bicubic to enlarge
            shrink = x.shape[-2] >= self.size[0] and x.shape[-1] >= self.size[1]
            x = nn.functional.interpolate(x, size=self.size, mode="area" if shrink else "bicubic").clamp(0, 1)
        return self.model.encode_image((x - self.mean) / self.std, normalize=self.normalize).float()


class FunctionFeatures(nn.Module):
    """Any callable ``images -> [B, D]`` as a module with ``num_features`` (what torchmetrics' FID needs).
    ``owner`` (when a module) is registered so that moving the metric moves it."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], num_features: int | None = None,
                 owner: nn.Module | None = None, probe_size: int = 64) -> None:
        super().__init__()
        self.fn = fn
        self.owner = owner
        if num_features is None:
            with torch.no_grad():
                num_features = int(fn(torch.rand(2, 3, probe_size, probe_size)).shape[-1])
        self.num_features = int(num_features)

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.fn(images).float()
        if features.ndim != 2 or features.shape != (images.shape[0], self.num_features):
            raise ValueError(
                f"feature extractor returned shape {tuple(features.shape)}; expected [{images.shape[0]}, {self.num_features}]"
            )
        return features


def feature_module(feature_extractor: Any, feature_dim: int | None = None, probe_size: int = 64) -> nn.Module:
    """The FID feature module for ``feature_extractor`` (see the module docstring for what is accepted)."""
    if callable(getattr(feature_extractor, "encode_image", None)):
        return ClipImageFeatures(feature_extractor)
    if callable(getattr(feature_extractor, "embed_images", None)):
        owner = feature_extractor if isinstance(feature_extractor, nn.Module) else None
        return FunctionFeatures(feature_extractor.embed_images, feature_dim, owner, probe_size)
    if isinstance(feature_extractor, nn.Module):
        if feature_dim is None and hasattr(feature_extractor, "num_features"):
            return feature_extractor
        return FunctionFeatures(feature_extractor, feature_dim, feature_extractor, probe_size)
    if callable(feature_extractor):
        return FunctionFeatures(feature_extractor, feature_dim, None, probe_size)
    raise TypeError(
        f"feature_extractor of type {type(feature_extractor).__name__}; expected an nn.Module, an open_clip model, "
        "an object with embed_images(), or a callable images -> [B, D]"
    )


def build_fid(feature_extractor: Any = None, feature_dim: int | None = None, inception_weights: str | None = None,
              probe_size: int = 64, **kwargs: Any) -> FrechetInceptionDistance:
    """A FrechetInceptionDistance on [0, 1] float images with the chosen features (never downloads weights):
    ``feature_extractor``'s, or without one the standard Inception-v3 from ``inception_weights`` (default: torch's
    hub cache). ``kwargs`` go to torchmetrics (e.g. ``reset_real_features=False`` to keep a fixed reference set)."""
    if feature_extractor is None:
        weights = find_inception_weights(inception_weights)  # read as data first: one line if it is not
        with weights_only_loads():  # torch-fidelity's own read asks for weights_only=False
            return FrechetInceptionDistance(feature=feature_dim or INCEPTION_DIM, normalize=True,
                                            feature_extractor_weights_path=weights, **kwargs)
    if inception_weights is not None:
        raise ValueError("both feature_extractor and inception_weights given; expected one feature extractor")
    return FrechetInceptionDistance(feature=feature_module(feature_extractor, feature_dim, probe_size), normalize=True,
                                    **kwargs)


class Precomputed(nn.Module):
    """The identity on ``[B, D]`` features: lets torchmetrics' FID (and KID) take features instead of images."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.num_features = int(num_features)

    @override
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.ndim != 2 or features.shape[1] != self.num_features:
            raise ValueError(f"features of shape {tuple(features.shape)}; expected [B, {self.num_features}]")
        return features


def frechet_of_features(real: torch.Tensor, fake: torch.Tensor) -> float:
    """torchmetrics' FID between two feature sets ``[n, D]``, ``[m, D]`` (n, m >= 2), on this process alone."""
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1] or min(len(real), len(fake)) < 2:
        raise ValueError(f"feature sets of shapes {tuple(real.shape)} and {tuple(fake.shape)}; expected [n >= 2, D] "
                         "and [m >= 2, D]")
    metric = FrechetInceptionDistance(feature=Precomputed(real.shape[1]), normalize=True, sync_on_compute=False)
    metric.update(real.detach().double().cpu(), real=True)
    metric.update(fake.detach().double().cpu(), real=False)
    return float(metric.compute())


def fid_features(metric: FrechetInceptionDistance, images: torch.Tensor) -> torch.Tensor:
    """The features ``metric`` computes for ``images`` in its ``update`` (its network, its input convention)."""
    x = (images * 255).byte() if metric.normalize and not metric.used_custom_model else images
    features = metric.inception(x)
    return (features.unsqueeze(0) if features.dim() == 1 else features).double()


class RealReference(Metric):
    """The reference FID: real images against other real images, in the features of ``fid`` (whose network is
    shared, not copied: ``fid`` moves it). ``update(images, second=False)`` adds to the first set (the real images
    FID compares the samples with), ``second=True`` to the second; ``compute`` gives ``(value, first, second)``: the
    FID of the first set against the second and their sizes or, with under 2 images in the second, that of the
    first set's two halves and theirs."""

    full_state_update = False

    def __init__(self, fid: FrechetInceptionDistance, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._features = functools.partial(fid_features, fid)  # not a child module: one copy of the network
        self.add_state("first", [], dist_reduce_fx="cat")
        self.add_state("second", [], dist_reduce_fx="cat")

    def update(self, images: torch.Tensor, second: bool = False) -> None:
        with torch.no_grad():
            (self.second if second else self.first).append(self._features(images))

    def compute(self) -> tuple[float, int, int]:
        def stacked(state: Any) -> torch.Tensor:
            if isinstance(state, list):
                return torch.cat(state) if state else torch.zeros(0, 0, dtype=torch.float64)
            return state

        first, second = stacked(self.first), stacked(self.second)
        if len(second) >= 2 and len(first) >= 2:
            return frechet_of_features(first, second), len(first), len(second)
        if len(first) >= 4:
            half = len(first) // 2
            return frechet_of_features(first[:half], first[half:]), half, len(first) - half
        raise RuntimeError(f"{len(first)} real images; the reference needs at least 4")


class FIDCallback(pl.Callback):
    """Logs ``val/fid_<features>`` (and ``val/clip_score`` when ``clip_scorer`` is given) of generated vs real images,
    and with ``reference`` the real-vs-real ``val/fid_<features>_reference`` beside it.

    ``features`` names the feature space (see the module docstring): ``"inception"`` for the standard FID,
    otherwise the name of ``feature_extractor``'s space (default ``"custom"``; the project's is ``"clip"``).
    ``every_n_steps``, when set, takes precedence over ``every_n_epochs``; ``num_images`` counts all ranks.
    ``clip_scorer`` is an object with ``score(images, captions)`` (e.g. the project's ``Reranker``) or a callable.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        num_images: int = 256,
        feature_extractor: Any = None,
        features: str | None = None,
        feature_dim: int | None = None,
        inception_weights: str | None = None,
        clip_scorer: Any = None,
        image_key: str = "image",
        caption_key: str = "text",
        probe_size: int = 64,
        prefix: str = "val/",
        reference: bool = True,
    ) -> None:
        for name, value in dict(every_n_steps=every_n_steps, every_n_epochs=every_n_epochs).items():
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} is not positive; expected an integer >= 1 or null")
        if every_n_steps is None and every_n_epochs is None:
            raise ValueError("every_n_steps and every_n_epochs are both null; expected one evaluation interval")
        if num_images < 2:
            raise ValueError(f"num_images={num_images}; FID needs at least 2 images")
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.image_key = image_key
        self.caption_key = caption_key
        self.prefix = prefix
        self.features = features or (INCEPTION if feature_extractor is None else "custom")
        if self.features == INCEPTION:
            feature_extractor = None  # the standard network replaces a configured extractor
        elif feature_extractor is None:
            raise ValueError(f"features={self.features!r} but no feature_extractor; expected one for that feature "
                             f"space, or features={INCEPTION!r}")
        self.fid = build_fid(feature_extractor, feature_dim, inception_weights, probe_size)
        # The same features, for real images against other real images (see the module docstring).
        self.reference = RealReference(self.fid) if reference else None
        self.clip_score = ContrastiveScore(clip_scorer) if clip_scorer is not None else None
        self._next_step = every_n_steps or 0
        self._active = False
        self._held = 0
        self._reference_held = 0  # real images of the reference's second set, this rank
        self.last: dict[str, float] = {}  # the most recent values, e.g. {"val/fid_inception": 12.3}

    @property
    def metric_name(self) -> str:
        """The logged FID's name, e.g. ``val/fid_clip``: the value means nothing without its feature space."""
        return f"{self.prefix}fid_{self.features}"

    @property
    def reference_name(self) -> str:
        """The reference's name, e.g. ``val/fid_clip_reference``: the FID of real images against real images."""
        return f"{self.metric_name}_reference"

    def _metrics(self) -> list[Any]:
        return [m for m in (self.fid, self.reference, self.clip_score) if m is not None]

    def _due(self, trainer: pl.Trainer) -> bool:
        if trainer.sanity_checking:
            return False
        if self.every_n_steps is not None:
            return trainer.global_step >= self._next_step
        return (trainer.current_epoch + 1) % (self.every_n_epochs or 1) == 0

    def _quota(self, trainer: pl.Trainer) -> int:
        return math.ceil(self.num_images / max(trainer.world_size, 1))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module, "fid_generate", None)):
            raise TypeError(f"{type(pl_module).__name__} has no fid_generate(batch); FIDCallback needs it to generate images")

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._active = self._due(trainer)
        self._held = 0
        self._reference_held = 0
        for metric in self._metrics():
            metric.to(pl_module.device).reset()

    def _real(self, pl_module: pl.LightningModule, batch: Any) -> torch.Tensor:
        if callable(getattr(pl_module, "fid_real", None)):
            return pl_module.fid_real(batch)
        if not isinstance(batch, dict) or self.image_key not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise KeyError(f"validation batch has {keys}; FIDCallback expected real images under {self.image_key!r} "
                           "(or a fid_real(batch) method on the module)")
        return batch[self.image_key]

    def _captions(self, pl_module: pl.LightningModule, batch: Any) -> list[str]:
        if callable(getattr(pl_module, "fid_captions", None)):
            return list(pl_module.fid_captions(batch))
        captions = batch.get(self.caption_key) if isinstance(batch, dict) else None
        if not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
            raise KeyError(f"validation batch has no caption strings under {self.caption_key!r}; "
                           "the contrastive score needs them (or a fid_captions(batch) method on the module)")
        return list(captions)

    def update(self, pl_module: pl.LightningModule, batch: Any) -> int:
        """Generate for one (already truncated) batch and add real and generated images to the metrics."""
        real = check_images(self._real(pl_module, batch), "real images")
        fake = check_images(pl_module.fid_generate(batch), "fid_generate() output")
        if fake.shape[0] != real.shape[0]:
            raise ValueError(f"fid_generate() returned {fake.shape[0]} images for {real.shape[0]} real ones; expected one per caption")
        self.fid.update(real.to(pl_module.device), real=True)
        self.fid.update(fake.to(pl_module.device), real=False)
        if self.reference is not None:
            self.reference.update(real.to(pl_module.device))
        if self.clip_score is not None:
            self.clip_score.update(fake.to(pl_module.device), self._captions(pl_module, batch))
        return int(real.shape[0])

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._active or dataloader_idx != 0:
            return
        quota = self._quota(trainer)
        with torch.no_grad(), full_parameters(trainer):  # sampling reaches the model outside its forward
            if self._held < quota:
                self._held += self.update(pl_module, take(batch, quota - self._held))
            elif self.reference is not None and self._reference_held < quota:
                self._reference_held += self.update_reference(pl_module, take(batch, quota - self._reference_held))

    def update_reference(self, pl_module: pl.LightningModule, batch: Any) -> int:
        """Add one batch's real images to the reference's second set (after the first ``num_images``)."""
        if self.reference is None:
            raise RuntimeError("update_reference() with reference=False; expected FIDCallback(reference=True)")
        real = check_images(self._real(pl_module, batch), "real images")
        self.reference.update(real.to(pl_module.device), second=True)
        return int(real.shape[0])

    def compute(self) -> dict[str, float]:
        """Values of all ranks' images together (a collective call: every rank must make it), then reset."""
        try:
            out = {self.metric_name: float(self.fid.compute())}
        except RuntimeError as exc:
            raise RuntimeError(f"FIDCallback could not compute FID (num_images={self.num_images}; are there "
                               f"validation batches?): {exc}") from exc
        if self.reference is not None:
            try:
                out[self.reference_name], first, second = self.reference.compute()
            except RuntimeError as exc:  # under 4 real images: nothing to compare
                log.warning("%s not measured: %s", self.reference_name, exc)
            else:
                if second < first or first < self.num_images:
                    log.warning("%s measured on %d real images against %d: validation holds under 2 x num_images="
                                "%d images, so the reference sits higher than one at equal size would",
                                self.reference_name, first, second, self.num_images)
        if self.clip_score is not None:
            out[f"{self.prefix}clip_score"] = float(self.clip_score.compute())
        for metric in self._metrics():
            metric.reset()
        return out

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._active = False
        self.last = self.compute()
        for name, value in self.last.items():
            pl_module.log(name, value, sync_dist=False)  # already the value of all ranks
        if self.every_n_steps is not None:
            self._next_step = (trainer.global_step // self.every_n_steps + 1) * self.every_n_steps

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self._next_step}  # a resumed run keeps its step schedule

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next_step = int(state_dict.get("next_step", self._next_step))
