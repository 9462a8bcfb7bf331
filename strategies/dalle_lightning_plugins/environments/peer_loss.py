"""A lost peer told from a bug by the error's type, so that only a lost peer is reported (and retried) as one.

A launcher that restarts workers (``torchrun --max-restarts``) helps when a node or the link went: the restarted
workers continue from the last checkpoint. It does not help a bug, which fails the same way every time; a bug must
keep its traceback and exit as a bug. Message words ("timeout", "nccl", "gloo") cannot tell the two apart: a
DataLoader timeout or an NCCL error after an out-of-memory mentions them too. What can:

- ``torch.distributed.DistNetworkError`` and ``DistStoreError``: a socket or the rendezvous store went;
- :class:`PeerLost`: this package's strategies raise it for a collective between nodes that failed for one of
  the reasons listed here (``InterNodeReduction.failure``'s one line: which collective, which nodes, how long);
- NCCL's remote error, ``ncclRemoteError`` (a ``DistBackendError`` carrying that code: "a remote process exiting
  prematurely or a network error"); NCCL's other codes (an unhandled CUDA error after an illegal memory access,
  invalid usage, ...) are bugs;
- gloo's transport errors (its ``IoException``): gloo has no Python exception types and raises a plain
  ``RuntimeError``, whose message starts with the transport's source location (``[.../gloo/transport/tcp/
  pair.cc:561] Connection closed by peer``, ``[.../unbound_buffer.cc:78] Timed out waiting ...``), except the one
  it signals to every pair of a group once an operation timed out, which is exactly ``Application timeout caused
  pair closure`` (what a rank sees when the link is cut: measured). gloo's assertions (``[enforce fail at ...]``:
  mismatched collectives, a bug) carry neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch.distributed as dist

GLOO_TRANSPORT = re.compile(r"\[[^\]\s]*gloo/transport/[^\]\s]+\.cc:\d+\]")  # gloo's IoException, TimeoutException
GLOO_PAIR_CLOSURE = "Application timeout caused pair closure"  # gloo's signalException after a timeout, whole
NCCL_REMOTE = "ncclRemoteError"  # NCCL's code for a remote process that exited or a network error
LOST_PEER_EXIT = 75  # EX_TEMPFAIL (sysexits.h): "try again later"; a bug exits 1, as Python's uncaught errors do


class PeerLost(RuntimeError):
    """A collective failed because a peer or the link went (never for a bug: see the module docstring)."""


def chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what caused it, as Python prints them (``__cause__``, else an unsuppressed ``__context__``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def is_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` itself (not its causes) says that a peer or the link went, by its type or error code."""
    if isinstance(exc, (PeerLost, dist.DistNetworkError, dist.DistStoreError)):
        return True
    text = str(exc)
    first = text.strip().split("\n", 1)[0]  # searched: "Gloo connectFullMesh failed with [.../pair.cc:144] ..."
    gloo = first == GLOO_PAIR_CLOSURE or GLOO_TRANSPORT.search(first) is not None
    if isinstance(exc, dist.DistBackendError):
        return NCCL_REMOTE in text or gloo
    return type(exc) is RuntimeError and gloo


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` or anything that caused it says that a peer or the link went."""
    return any(is_peer_error(link) for link in chain(exc))
