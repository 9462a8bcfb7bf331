"""One policy for the optional fast paths: compiled regions, fused kernels, CUDA graph capture.

A fast path is on by default wherever it can run, including on hardware and torch releases where it has never
run. So its first failure must not end a user's run: the caller goes on with the plain (eager) path and
:func:`fall_back` prints one line naming what failed, the option that turns the path off, and the file holding the
full error. In strict mode (the tests and ``benchmarks/gpu.py``, or ``DALLE_LIGHTNING_STRICT_FAST_PATHS=1``) the
error is raised instead, so a regression cannot hide behind the fallback.

:class:`FastPath` is the policy at one place in the code: the fast callable until it fails once, the plain one for
the rest of the process (a compile or a capture that failed would fail again, at a cost, at every call). When the
plain path fails too, the error is the input's, not the fast path's: the plain path's error is raised, and the fast
path stays on.

The line goes through :mod:`logging` at WARNING, as the project's other user-facing warnings do: the command-line
apps print it (Hydra's console handler, and the run's log file), and a script that configured no logging still
gets it on stderr (Python's last-resort handler).

Both distributions use this module, so it lives in the plugins' one (which never imports ``dalle_lightning``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from dalle_lightning_plugins import compat

log = logging.getLogger(__name__)

STRICT_ENV = "DALLE_LIGHTNING_STRICT_FAST_PATHS"
ERRORS_ENV = "DALLE_LIGHTNING_FAST_PATH_ERRORS"

T = TypeVar("T")

_strict_override: list[bool] = []
_reported: set[str] = set()
_paths: weakref.WeakSet[FastPath] = weakref.WeakSet()

# Exceptions torch raises through a fast path as control flow, never a failure of it: non-reentrant activation
# checkpointing stops a recomputed forward early by raising from its saved-tensor hook, which fires inside a
# compiled region; taken for a failure, the plain path would run in a recomputation torch had already stopped.
_CONTROL_FLOW: tuple[type[BaseException], ...] = compat.recomputation_stop_errors()


def strict() -> bool:
    """Whether a fast path's failure raises instead of falling back."""
    if _strict_override:
        return _strict_override[-1]
    return os.environ.get(STRICT_ENV, "") not in ("", "0", "false", "False")


@contextlib.contextmanager
def strict_fast_paths(on: bool = True) -> Iterator[None]:
    """Within the block, fast paths raise on failure (``on=True``) or fall back (``on=False``), whatever the env."""
    _strict_override.append(on)
    try:
        yield
    finally:
        _strict_override.pop()


def errors_file() -> Path:
    """Where the full errors of fallen-back fast paths go: ``$DALLE_LIGHTNING_FAST_PATH_ERRORS`` or the temp dir
    (``dalle_lightning``'s command-line apps set the variable to the run directory's ``fast_path_errors.log``)."""
    named = os.environ.get(ERRORS_ENV)
    if named:
        return Path(named)
    return Path(tempfile.gettempdir()) / f"dalle_lightning_fast_paths_{os.getpid()}.log"


def summary(error: BaseException) -> str:
    """The error's type and first line; with the next line too where the first only introduces it (dynamo's
    ``backend='inductor' raised:``), so the one line says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


def fall_back(what: str, option: str, error: BaseException, site: str = "") -> None:
    """Report that ``what`` failed and the plain path runs instead; in strict mode re-raise ``error``.

    ``option`` is the setting that turns the path off (e.g. ``model.compile=false``). Each ``what`` is reported
    once per process (a distributed run's ranks each print theirs, prefixed by the rank: a GPU of one node may
    fail where the others do not); every failure's traceback is appended to :func:`errors_file`, headed by
    ``what`` and the ``site`` (which of the places sharing ``what`` failed).
    """
    if strict():
        raise error
    path = errors_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"--- {what}{f' ({site})' if site else ''}\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
        where = str(path)
    except OSError as write_error:  # a full disk must not turn a fallback into a crash
        where = f"(not written: {write_error})"
    if what in _reported:
        return
    _reported.add(what)
    several = os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    rank = f"rank {os.environ['RANK']}: " if several and "RANK" in os.environ else ""
    log.warning("%s%s failed (%s); running the eager path instead. Turn it off with %s; full error in %s",
                rank, what, summary(error), option, where)


class FastPath:
    """The fast-path policy at one place in the code (a compiled function, a kernel, a capture).

    ``what`` names the path in the line a failure prints (several places may share it: one line for them all),
    ``option`` the setting that turns it off, and ``passthrough`` the errors that are not the path's failure and
    must reach the caller as they are (a limit the caller reports itself); ``site`` heads its traceback in the
    errors file."""

    def __init__(self, what: str, option: str, site: str = "",
                 passthrough: tuple[type[BaseException], ...] = ()) -> None:
        self.what, self.option, self.site, self.passthrough = what, option, site, passthrough
        self.failed = False
        _paths.add(self)

    def run(self, fast: Callable[[], T], plain: Callable[[], T]) -> T:
        """``fast()`` until it has failed once, ``plain()`` after (and for the call that failed)."""
        if self.failed:
            return plain()
        try:
            return fast()
        except (*self.passthrough, *_CONTROL_FLOW):
            raise
        except Exception as error:
            if strict():
                raise
            result = plain()  # raises the input's own error, if it is one: then the fast path was not at fault
            self.failed = True
            fall_back(self.what, self.option, error, self.site)
            return result


def reset_reports() -> None:
    """Forget which fast paths were reported and which failed (tests), so the next call tries each again."""
    _reported.clear()
    for path in list(_paths):
        path.failed = False
