"""Dynamo's recompile limit as an error, not a silent slowdown, for the functions this project compiles.

When a compiled function's guards have missed ``recompile_limit`` times, dynamo stops compiling it and runs it
eagerly for the rest of the process, with one warning: the fused kernel a compiled function exists for is then
gone without a failure. Inside :func:`strict_recompiles` a hit raises instead, and the limit may be raised for the
call (a function legitimately specialised on many shapes); both settings are restored on exit, so the rest of the
process keeps dynamo's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def strict_recompiles(at_least: int | None = None) -> Iterator[None]:
    """Make hitting dynamo's recompile limit raise; with ``at_least``, raise the limit to that for the call."""
    config = torch._dynamo.config
    limit, fail = config.recompile_limit, config.fail_on_recompile_limit_hit
    config.fail_on_recompile_limit_hit = True
    if at_least is not None:
        config.recompile_limit = max(limit, at_least)
    try:
        yield
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = limit, fail
