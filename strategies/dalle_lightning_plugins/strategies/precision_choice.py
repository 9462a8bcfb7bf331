"""Which of Lightning's precision strings the sharding strategies train in, and the one line for the others.

The strategies derive from Lightning's ``ParallelStrategy`` (:mod:`dalle_lightning_plugins.strategies.parallel_base`),
not ``ModelParallelStrategy``, whose instances Lightning's connector refuses ``"16-mixed"`` for: so every string
below reaches the strategy as ``ddp`` gets it (on CPU Lightning turns ``"16-mixed"`` into ``"bf16-mixed"`` with its
warning, on CUDA it is ``MixedPrecision`` with a ``GradScaler``), and Lightning's own check is left as it is for
every other strategy. What the strategies were never tested in (``"64-true"``, Transformer Engine's fp8) is refused
when Lightning hands the strategy its precision plugin, still inside ``Trainer(...)``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    TransformerEnginePrecision,
)

# The precision strings the strategy trains as ddp does.
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true")

# Lightning's plugins made from the strings the strategies refuse: 64-bit and Transformer Engine are untested under
# FSDP2 + PowerSGD here. (Without the transformer_engine package Lightning fails to make its plugin first, with the
# same ModuleNotFoundError as under ddp.)
REFUSED_PLUGINS = (DoublePrecision, TransformerEnginePrecision)


def refusal(strategy: str, precision: Any) -> str | None:
    """One line naming ``strategy``, the precision and what to pass instead; None when the strategy trains in it."""
    if precision is None or precision in PRECISIONS:
        return None
    return (f"{strategy} does not support Trainer(precision={precision!r}); pass one of "
            f"{', '.join(repr(p) for p in PRECISIONS)}, or a precision plugin (plugins=[...])")


def check_precision(precision: Any, strategy: str = "ShardedPowerSGDStrategy") -> None:
    """Raise :func:`refusal`'s line unless the strategy trains in ``precision`` (a Trainer precision string)."""
    message = refusal(strategy, precision)
    if message is not None:
        raise ValueError(message)


def check_precision_plugin(plugin: Any, strategy: str) -> None:
    """Raise one line for a Lightning plugin made from a refused string (``Trainer(precision="64-true")`` arrives
    as a ``DoublePrecision``); any other plugin, a user's own included, is the user's choice."""
    if isinstance(plugin, REFUSED_PLUGINS):
        check_precision(getattr(plugin, "precision", type(plugin).__name__), strategy)
