"""Lightning's own collectives under the strategies fail in one line too, naming the nodes they waited for.

The strategies turn a failed exchange between nodes into one line (``InterNodeReduction.failure``). But Lightning
also talks over every rank outside the exchange: ``ModelCheckpoint`` agrees on whether a file exists
(``reduce_boolean_decision``: an all-reduce and a barrier), metrics logged with ``sync_dist`` are reduced, the
loops broadcast and wait at barriers. When the link goes down while a sync is on the wire (local steps with
``sync_delay``), the first collective to notice is often one of these, and it surfaced as gloo's bare
``Application timeout caused pair closure``. :class:`CollectiveFailures` wraps them: same message shape,
naming the collective. Only a lost peer (``peer_loss.lost_peer``: by the error's type) becomes that line, a
:class:`~dalle_lightning_plugins.environments.peer_loss.PeerLost`; any other error is a bug and passes through as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
import torch.distributed as dist

from dalle_lightning_plugins.compression.exchange import ExchangeError
from dalle_lightning_plugins.environments.peer_loss import PeerLost, lost_peer


def lost_peer_line(error: ExchangeError, seconds: float) -> str:
    """The line for a strategy that does not know its nodes: the collective, how long it waited, the reason."""
    return f"{error.waiting_on} failed after {seconds:.1f} s: {error.reason}; a peer is down"


class CollectiveFailures:
    """Wraps a collective so that a lost peer ends the run in one line naming it (see the module). The strategy
    holds one and enters :meth:`named` around Lightning's ``barrier``, ``reduce``, ``broadcast`` and its own writes.

    ``failure`` words the line from the failed collective and the seconds it waited (the strategy's
    ``InterNodeReduction.failure``, which names the nodes)."""

    def __init__(self, failure: Callable[[ExchangeError, float], str]) -> None:
        self.failure = failure

    @contextmanager
    def named(self, what: str) -> Generator[None, None, None]:
        start = time.perf_counter()
        try:
            yield
        except (RuntimeError, dist.DistError) as error:
            if isinstance(error, PeerLost) or not lost_peer(error):
                raise  # already one of ours, or a bug (which keeps its type and traceback)
            failed = ExchangeError(what, error)
            raise PeerLost(self.failure(failed, time.perf_counter() - start)) from error
