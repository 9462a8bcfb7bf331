"""A training loader whose passes are epochs of an epoch-seeded stream, and which can start a pass part-way.

Lightning calls ``set_epoch`` only on a loader's sampler, which a streamed (iterable) dataset does not have, so
the epoch would be whatever the dataset was built with: every epoch the same order. This loader asks its owner
for the position at the start of every pass, ``position() -> (epoch, batches already trained on)``, sets the
dataset's epoch, and skips the batches a resumed run has already trained on.

The skipped batches are read and dropped through the very same loader (its workers, their split of the stream,
the order in which their batches arrive), so the first batch after them is exactly the one the interrupted run
would have drawn next, whatever the number of loader workers and whatever samples were unusable. The cost is
reading (not training on) the part of the epoch already seen, once per resume.

The loader's own generator is reseeded per epoch: a DataLoader draws the base seed of its workers from it (from
torch's global generator otherwise, which would then shift the model's draws by one per epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from dalle_lightning.data.epoch_loader import NonEmptyLoader

EPOCH_SEED_STRIDE = 1_000_003  # a prime: (seed, epoch) pairs map to distinct generator seeds


class ResumableLoader(NonEmptyLoader):
    """``NonEmptyLoader`` over a dataset with ``set_epoch(epoch)``; see the module docstring.

    ``position`` is called once per pass (one pass is one epoch); without it every pass is epoch 0 from its start.
    ``seed`` seeds the per-epoch generator of the loader workers' base seed.
    """

    def __init__(self, *args: Any, position: Callable[[], tuple[int, int]] | None = None, seed: int = 0,
                 **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(*args, **kwargs)
        self.position, self.seed = position, seed

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch, skip = self.position() if self.position is not None else (0, 0)
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]
        if self.generator is not None:
            self.generator.manual_seed(self.seed * EPOCH_SEED_STRIDE + epoch)
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                yield batch
