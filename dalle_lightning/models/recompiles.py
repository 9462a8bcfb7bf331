"""Dynamo's recompiles in the functions the model compiles: counted per region, warned once, an error only in strict
mode.

Why a policy at all: a compiled function's graphs are specialised on its inputs (dtype, grad mode, train/eval, the
shapes dynamo did not make dynamic). A shape the run did not meet at its start (a validation batch, a last partial
batch, the FID prefill) compiles one more graph, and after ``recompile_limit`` graphs dynamo stops compiling that
function. Left to dynamo, the limit is a warning among many and the new shapes run eagerly, unseen; made an error
(what this module did before), it ends a user's run at the first new shape, which may come hours in. Here:

- every graph a function compiles is counted under its name (:func:`graphs_per_region`; the
  ``dalle_lightning.lit.compiled_graphs`` callback logs them as ``compile/graphs/<name>``);
- the batch dimension is dynamic from the first call (``maybe_mark_dynamic``), so training batches, the last
  partial batch and validation batches of another size share one graph per dtype, grad mode and train/eval mode
  (a batch of one is still its own graph: dynamo specialises sizes 0 and 1); the validation graphs compile at
  start-up where a run compiles (the callback runs one sanity-check batch);
- hitting the limit prints one line (:func:`dalle_lightning_plugins.fast_paths.fall_back`) and the function keeps
  its compiled graphs while new shapes run eagerly. In strict mode (the tests, ``benchmarks/gpu.py``) it raises
  :class:`RecompileLimitError` instead, one line naming the function, the limit and the inputs;
- a graph compiled after the run's start-up (:func:`settle`, called by the callback once the first epoch with its
  validation has run) is warned once per process: a recompile the start-up did not foresee.

The limit may be raised for a function that legitimately specialises on many shapes (the dVAE's groups); it is set
for the call only, and only once the function nears dynamo's limit (see :meth:`CompiledFunction._config`), so the
rest of the process keeps dynamo's own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from dalle_lightning_plugins.fast_paths import STRICT_ENV, fall_back

log = logging.getLogger(__name__)

_FUNCTIONS: dict[str, CompiledFunction] = {}
_late_warned = False  # the line for a graph compiled after start-up was printed


class RecompileLimitError(RuntimeError):
    """A compiled function hit dynamo's recompile limit (strict mode only: elsewhere new shapes run eagerly)."""


def _unique_graphs() -> int:
    """Graphs dynamo has compiled in this process (all functions): a call's increase is what that call compiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def is_recompile_limit(error: BaseException) -> bool:
    """Whether ``error`` is dynamo refusing to compile past its limit. By type where the release has one (so that a
    compile failure whose text happens to name the limit stays a compile failure), else by its text."""
    exc = torch._dynamo.exc
    types = tuple(t for t in (getattr(exc, "FailOnRecompileLimitHit", None), getattr(exc, "FailOnCacheLimitHit", None))
                  if t is not None)
    if types:
        return isinstance(error, types)
    return "recompile_limit" in str(error) or "cache_size_limit" in str(error)


def describe(args: tuple[Any, ...]) -> str:
    """The tensor inputs' shapes and dtypes, for the lines this module prints."""
    shapes = [f"{tuple(a.shape)} {a.dtype}" for a in args if isinstance(a, torch.Tensor)]
    return ", ".join(shapes) if shapes else "no tensors"


def _limit(at_least: int | None, fail: bool) -> contextlib.AbstractContextManager[None]:
    """Dynamo's limit raised to ``at_least`` for the call, and made an error (``fail``) so that the caller decides
    what a hit means; both settings are restored on exit."""
    config = torch._dynamo.config
    limit = config.recompile_limit if at_least is None else max(config.recompile_limit, at_least)
    return config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=fail)


class CompiledFunction:
    """``torch.compile(fn)`` under a ``name``, compiled on first call, with this module's recompile policy.

    ``limit``: graphs allowed for this function (``None``: dynamo's ``recompile_limit``); ``option``: the setting
    that turns compiling off, named in the line a limit hit prints; ``error``: the :class:`RecompileLimitError`
    subclass strict mode raises; ``what``: the path a limit hit's line names, shared by functions that one new input
    reaches together (one line for all the model's regions); ``dynamic_batch``: mark dimension 0 of every tensor
    input dynamic; ``backend``: ``torch.compile``'s (the tests' recording backend checks guards and counts without
    inductor's seconds per graph)."""

    def __init__(self, name: str, fn: Callable[..., Any], *, limit: int | None = None, option: str,
                 error: type[RecompileLimitError] = RecompileLimitError,
                 what: str = "compiling the model's regions for new input shapes", dynamic_batch: bool = True,
                 backend: str | Callable[..., Any] = "inductor") -> None:
        self.name, self.fn, self.limit, self.option, self.error, self.what = name, fn, limit, option, error, what
        self.dynamic_batch, self.backend = dynamic_batch, backend
        self.graphs = 0  # compiled by calls of this function, in this process
        self.limit_hits = 0
        self.settled = False  # graphs from now on are recompiles the start-up did not foresee
        self._run_only = False  # the limit was hit: dynamo runs new shapes eagerly and keeps the graphs it has
        self._compiled: Callable[..., Any] | None = None
        _FUNCTIONS[name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, backend=self.backend)
        if self.dynamic_batch:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        before = _unique_graphs()
        try:
            with self._config():
                out = self._compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - only the limit is handled; anything else is re-raised
            if not is_recompile_limit(error):
                raise
            self._limit_hit(error, args)
            with self._config():  # this call runs eagerly, without dynamo trying (and warning) once more
                out = self._compiled(*args, **kwargs)
        new = _unique_graphs() - before
        if new > 0:
            self._count(new, args)
        return out

    def _config(self) -> contextlib.AbstractContextManager[Any]:
        """Dynamo's settings for one call. Far from the limit, none: a compile there cannot reach it, and setting
        dynamo's config costs tens of microseconds a call, a visible share of a step that calls a region per layer.
        Near it, the limit raised to ``limit`` and made an error. Past it (outside strict mode), dynamo's
        ``eager_on_recompile`` stance: the graphs it has still run, a new shape runs eagerly, and dynamo neither
        compiles nor warns again."""
        if self._run_only:
            return torch.compiler.set_stance("eager_on_recompile")
        if self.graphs + 1 < torch._dynamo.config.recompile_limit:
            return contextlib.nullcontext()
        return _limit(self.limit, fail=True)

    def _limit_hit(self, error: BaseException, args: tuple[Any, ...]) -> None:
        """Raise the one-line error in strict mode; else print it once and let new shapes run eagerly."""
        self.limit_hits += 1
        limit = max(torch._dynamo.config.recompile_limit, self.limit or 0)
        limit_error = self.error(  # the first line is what a user's line quotes; the second is for strict mode
            f"{self.name} hit torch._dynamo.config.recompile_limit ({limit}) with inputs {describe(args)}\n"
            f"expected at most {limit} graphs: raise the limit, or turn compiling off with {self.option}"
        )
        limit_error.__cause__ = error
        fall_back(self.what, self.option, limit_error, site=self.name)
        self._run_only = True  # not in strict mode (fall_back raised): there every later hit raises too

    def _count(self, new: int, args: tuple[Any, ...]) -> None:
        global _late_warned
        self.graphs += new
        if self.settled and not _late_warned:  # once per process: one new shape recompiles every region it meets
            _late_warned = True
            log.warning(
                "%s compiled graph %d after start-up, for inputs %s (a shape or mode the first epoch did not bring); "
                "recompiles are counted per region in compile/graphs/* and not printed again. At %d graphs a region "
                "runs new shapes eagerly (strict mode, %s=1, raises there).",
                self.name, self.graphs, describe(args), max(torch._dynamo.config.recompile_limit, self.limit or 0),
                STRICT_ENV,
            )


def graphs_per_region() -> dict[str, int]:
    """Graphs compiled so far by each compiled function that has compiled any, by name."""
    return {name: f.graphs for name, f in sorted(_FUNCTIONS.items()) if f.graphs}


def limit_hits() -> int:
    """How many times a compiled function hit its recompile limit (each hit's shapes ran eagerly)."""
    return sum(f.limit_hits for f in _FUNCTIONS.values())


def settle(on: bool = True) -> None:
    """Mark the start-up over: a graph compiled from now on is warned (once per process) (``on=False`` undoes it)."""
    for f in _FUNCTIONS.values():
        f.settled = on


def reset_counts() -> None:
    """Forget the counts, the warnings and the limit hits (tests; after ``torch._dynamo.reset()``)."""
    global _late_warned
    _late_warned = False
    for f in _FUNCTIONS.values():
        f.graphs = f.limit_hits = 0
        f.settled = f._run_only = False
