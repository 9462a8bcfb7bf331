"""Whether every rank of a node reached the stage's teardown after an error, asked without a collective.

After a stage that failed or was interrupted the user's module should still hold whole weights, as under ``ddp``,
whose every rank keeps them whole throughout. Under the strategy a node's ranks hold one shard each, so whole
weights need one gather over the node. A collective is safe only if every rank of the node is there to take part:
an error on one rank leaves its peers blocked in a collective of the step (until the process group's timeout), and
a lost peer never comes. A gather begun then would hang until that timeout, or mix its buffers with the step's.

:class:`RollCall` asks the rendezvous store instead (``torch.distributed``'s key-value store, which every rank
reaches on its own): each rank counts itself in under the stage's key, waits a bounded time for the node's count,
and the first rank to decide writes the answer (``compare_set``) that every rank then follows, early or late. A
rank that comes after its peers gave up reads their "alone" and restores alone too; a gather starts only where
every rank of the node was counted in, and none of them had a collective fail (:meth:`RollCall.give_up`). An error
every rank raises at the same step (a bug in ``training_step``, Ctrl-C on the launcher's process group) then ends
with whole weights, as a stage that ends does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dalle_lightning_plugins import compat

# How long a rank waits at teardown after an error for the node's other ranks (seconds): peers that raised the same
# error arrive within milliseconds; one blocked in a collective until its timeout, or lost, is not waited for.
ROLL_CALL_WAIT_S = 10.0
_POLL_S = 0.02

# Stages this process has begun: every rank begins the same stages in the same order, so the n-th stage's keys are
# the same on every rank of a node and differ from any earlier stage's under the same store (a new Trainer's too).
_STAGES = itertools.count()

GATHER, ALONE = b"gather", b"alone"


class RollCall:
    """One stage's roll call over the ranks of a node (see the module); :meth:`begin` at the stage's
    ``setup_environment`` on every rank, :meth:`all_here` at most once, in its teardown after an error."""

    def __init__(self, wait_s: float = ROLL_CALL_WAIT_S) -> None:
        self.wait_s = wait_s
        self.key: str | None = None  # this stage's and node's key prefix in the store; None: no roll call
        self.size = 0  # ranks in the node (the store is looked up when asked: a pickled strategy holds none)

    def begin(self, ranks: Sequence[int]) -> None:
        """This stage's roll call over ``ranks`` (global ranks, the node's); none over no ranks."""
        ranks = [int(r) for r in ranks]
        stage = next(_STAGES)  # counted whatever the ranks: every process counts the same stages
        self.key = f"dalle_lightning_plugins/roll_call/{stage}/{min(ranks)}" if ranks else None
        self.size = len(ranks)

    def all_here(self, store: Any = None) -> bool:
        """Whether every rank of the node is at its teardown, the same answer on each of them (no collective; at
        most ``wait_s`` seconds), asked in ``store`` (default: the default process group's). False without a store
        that can decide (``compare_set``), or after a store error."""
        store = store if store is not None else compat.default_store()
        if self.key is None or store is None:
            return False
        try:
            count = store.add(f"{self.key}/here", 1)
            deadline = time.monotonic() + self.wait_s
            while count < self.size and time.monotonic() < deadline and not store.check([f"{self.key}/decision"]):
                time.sleep(_POLL_S)
                count = store.add(f"{self.key}/here", 0)
            wanted = GATHER if count >= self.size else ALONE
            decided = store.compare_set(f"{self.key}/decision", "", wanted)
        except (RuntimeError, NotImplementedError, dist.DistError):  # the store's server went with a lost rank 0
            return False
        finally:
            self.key = None  # once per stage
        return bytes(decided) == GATHER

    def give_up(self, store: Any = None) -> None:
        """This rank's own collective failed (a lost peer, a timeout): its process group cannot gather, so the node
        restores alone, and the peers stop waiting for it at once."""
        store = store if store is not None else compat.default_store()
        if self.key is not None and store is not None:
            try:
                store.compare_set(f"{self.key}/decision", "", ALONE)
            except (RuntimeError, NotImplementedError, dist.DistError):
                pass  # the store went too: the peers' wait is bounded anyway
        self.key = None
