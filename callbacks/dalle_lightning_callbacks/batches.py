"""The first ``n`` samples of a validation batch, whatever its container: callbacks that evaluate a fixed number
of samples (FID, sample grids) cut the last batch they need to size before generating for it."""

from __future__ import annotations

from typing import Any

import torch


def take(batch: Any, n: int) -> Any:
    """The first ``n`` samples of a batch (dict, tuple/list or tensor of per-sample entries)."""
    if torch.is_tensor(batch):
        return batch[:n]
    if isinstance(batch, dict):
        return {k: take(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(x, str) for x in batch):
            return list(batch[:n])
        return type(batch)(take(v, n) for v in batch)
    return batch
