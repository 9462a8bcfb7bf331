"""FID and KID between two sets of features computed beforehand, on torchmetrics.

``dalle-eval`` embeds every image once per feature space (all max(N) candidates of every caption, the real images,
the reference set) and then compares many subsets of them: the best of N for each N against the real images, and
the real images against the reference set. Handing torchmetrics the features (through
``dalle_lightning_callbacks.fid.Precomputed``, an identity "network") keeps its FID and KID arithmetic while each image goes through the feature network only once.

KID is reported beside FID because FID is biased upwards at small sample sizes (the bias falls as 1/n), so an FID
over a hundred images is mostly bias; KID's estimator is unbiased. torchmetrics' KID averages over ``subsets``
random subsets of ``subset_size`` samples (default 1000), which a sample of a few hundred cannot fill: here the
subset is the whole sample when it is smaller than 1000 (one subset; the estimate is then exact and repeatable),
otherwise 100 seeded subsets of 1000, as the KID paper does.
"""

from __future__ import annotations

import warnings

import torch
from torchmetrics.image.kid import KernelInceptionDistance

from dalle_lightning_callbacks.fid import Precomputed, frechet_of_features

KID_SUBSET_SIZE = 1000  # the KID paper's subset size
KID_SUBSETS = 100  # subsets averaged when the sample is larger than one subset


def _check(real: torch.Tensor, fake: torch.Tensor) -> None:
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature sets of shapes {tuple(real.shape)} and {tuple(fake.shape)}; expected [n, D] and [m, D]")
    if min(len(real), len(fake)) < 2:
        raise ValueError(f"{len(real)} and {len(fake)} feature vectors; FID and KID need at least 2 in each set")


def fid(real: torch.Tensor, fake: torch.Tensor) -> float:
    """torchmetrics' Frechet distance between feature sets ``real [n, D]`` and ``fake [m, D]`` (n, m >= 2)."""
    _check(real, fake)
    return frechet_of_features(real, fake)


def kid_subsets(n_real: int, n_fake: int) -> tuple[int, int]:
    """``(subset_size, subsets)`` for KID on samples of these sizes: the whole sample (one subset) below
    ``KID_SUBSET_SIZE``, else ``KID_SUBSETS`` subsets of that size."""
    smallest = min(n_real, n_fake)
    return (smallest, 1) if smallest <= KID_SUBSET_SIZE else (KID_SUBSET_SIZE, KID_SUBSETS)


def kid(real: torch.Tensor, fake: torch.Tensor, seed: int = 0) -> float:
    """torchmetrics' kernel inception distance (mean over subsets; see the module docstring for their size) between
    feature sets ``real [n, D]`` and ``fake [m, D]``; subsets are drawn with ``seed``, so a rerun gives the same value."""
    _check(real, fake)
    subset_size, subsets = kid_subsets(len(real), len(fake))
    with warnings.catch_warnings():  # "will save all extracted features in buffer": these are the features
        warnings.simplefilter("ignore", UserWarning)
        metric = KernelInceptionDistance(feature=Precomputed(real.shape[1]), subsets=subsets, subset_size=subset_size,
                                         normalize=True, sync_on_compute=False)
    metric.update(real.detach().double().cpu(), real=True)
    metric.update(fake.detach().double().cpu(), real=False)
    with torch.random.fork_rng(devices=[]):  # the subsets' draws leave the caller's random state alone
        torch.manual_seed(seed)
        mean, _ = metric.compute()
    return float(mean)


def spread(features: torch.Tensor) -> float:
    """Total variance of a feature set (the trace of its covariance). For unit-norm features it is
    1 - |mean|^2, at most 1; near 0 the features have collapsed to one point and every distance in them is near 0."""
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"features of shape {tuple(features.shape)}; expected [n >= 2, D]")
    return float(features.double().var(dim=0, unbiased=True).sum())
