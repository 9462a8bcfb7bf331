"""Log lines held back until it is known whether they are worth printing.

Lightning prints its start-up lines (accelerators, precision, the process group) while the Trainer is built, and
the Trainer must exist before the ranks can agree on where a run starts (the process group comes from its
strategy). A launch's restarted attempt has printed them already, once: :func:`held_logs` keeps the records its
block emits, and :func:`release` then prints them, or only those at or above a level.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

HELD_LOGGERS = ("", "lightning.pytorch", "lightning.fabric")  # the root and Lightning's own (it may not propagate)


class _Hold(logging.Filter):
    """A handler's filter that keeps every record for later instead of letting the handler emit it."""

    def __init__(self, handler: logging.Handler, held: list[tuple[logging.Handler, logging.LogRecord]]) -> None:
        super().__init__()
        self.handler, self.held = handler, held

    def filter(self, record: logging.LogRecord) -> bool:
        self.held.append((self.handler, record))
        return False


@contextlib.contextmanager
def held_logs() -> Iterator[list[tuple[logging.Handler, logging.LogRecord]]]:
    """Inside the block, the records that the handlers of the root and Lightning's loggers would emit are kept
    (in order, with their handler) instead; the block's caller gets the list to :func:`release`."""
    held: list[tuple[logging.Handler, logging.LogRecord]] = []
    handlers = {h for name in HELD_LOGGERS for h in logging.getLogger(name).handlers}
    holds = [(h, _Hold(h, held)) for h in handlers]
    for handler, hold in holds:
        handler.addFilter(hold)
    try:
        yield held
    except BaseException:
        _remove(holds)
        release(held)  # what led up to a failure is printed
        raise
    finally:
        _remove(holds)


def _remove(holds: list[tuple[logging.Handler, _Hold]]) -> None:
    for handler, hold in holds:
        handler.removeFilter(hold)


def release(held: list[tuple[logging.Handler, logging.LogRecord]], below: int | None = None) -> None:
    """Emit the held records through their handlers, except those below level ``below`` (None: all)."""
    for handler, record in held:
        if below is None or record.levelno >= below:
            handler.handle(record)
    held.clear()
