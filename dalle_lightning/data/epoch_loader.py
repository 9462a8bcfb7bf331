"""A DataLoader whose pass over the data must yield at least one batch (training and validation alike).

Shards are streamed, so nothing knows an epoch's length in advance. If every shard is unreadable (or every sample
skipped), each epoch ends at once with no batch, and ``max_steps`` is never reached: with ``max_epochs: -1`` the
run loops on empty epochs forever. This loader ends such a pass with a one-line ``ValueError`` naming the shards
and what was skipped, within the time it takes to read them once. A validation split with no readable sample is
the same error (``split="validation"``): a run must not report a validation loss it never measured.
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
                 split: str = "training", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shards, self.skipped, self.split = list(shards), skipped, split

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = 0
        for batch in super().__iter__():
            batches += 1
            yield batch
        if not batches:
            raise ValueError(no_data_message(f"the {self.split} data", "batch", self.shards, self.skipped))


def no_data_message(what: str, unit: str, shards: Sequence[str], skipped: Callable[[], str] | None) -> str:
    """One line: ``<what> yielded no <unit> from its N shard(s) (first three); skipped: ...; expected ...``."""
    shown = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
    summary = skipped() if skipped is not None else "unknown"
    return (f"{what} yielded no {unit} from its {len(shards)} shard(s) ({shown}); skipped: {summary}; "
            "expected readable WebDataset shards with usable samples")
