"""A training DataLoader whose pass over the data must yield at least one batch.

Shards are streamed, so nothing knows an epoch's length in advance. If every shard is unreadable (or every sample
skipped), each epoch ends at once with no batch, and ``max_steps`` is never reached: with ``max_epochs: -1`` the
run loops on empty epochs forever. This loader ends such a pass with a one-line ``ValueError`` naming the shards
and what was skipped, within the time it takes to read them once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader


class NonEmptyLoader(DataLoader):
    """``DataLoader`` that raises ``ValueError`` when a full pass yields no batch.

    ``shards`` (the pass's shard URLs) and ``skipped`` (a callable returning a summary of what was skipped) only
    feed the message; they are constructor arguments so Lightning can re-create the loader like any other.
    """

    def __init__(self, *args: Any, shards: Sequence[str] = (), skipped: Callable[[], str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shards, self.skipped = list(shards), skipped

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = 0
        for batch in super().__iter__():
            batches += 1
            yield batch
        if not batches:
            shown = ", ".join(self.shards[:3]) + (f" and {len(self.shards) - 3} more" if len(self.shards) > 3 else "")
            what = self.skipped() if self.skipped is not None else "unknown"
            raise ValueError(f"the training data yielded no batch from its {len(self.shards)} shard(s) ({shown}); "
                             f"skipped: {what}; expected readable WebDataset shards with usable samples")
