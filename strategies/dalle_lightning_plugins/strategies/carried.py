"""What a LightningModule left sharded (``full_weights_after=False``) carries from one Trainer to the next: its sharded
root and the size of the axis it was sharded over. FSDP2 shards a module only once, so a later stage reuses the units
(:meth:`~dalle_lightning_plugins.strategies.stage_model.ShardedModel.reuse`); pickling and ``deepcopy`` leave the
value out, since FSDP2's state holds process groups neither can copy.
"""

from __future__ import annotations

from typing import Any

from torch import nn


# Attribute of a LightningModule a full_weights_after=False stage left sharded: (its ShardedRoot, shard-axis size).
# FSDP2 shards a module only once, so a later stage of the same Trainer, or a new Trainer, reuses the units.
SHARDED_ROOT_ATTR = "_sharded_powersgd_root"


class Carried:
    """A value a module carries from one Trainer to the next that pickling and ``deepcopy`` leave out (as ``None``).

    Only a module left sharded (``full_weights_after=False``) carries one: FSDP2's state holds process groups,
    which neither can copy. A module left whole carries nothing.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Carried, ())


def carried(module: nn.Module, attr: str) -> Any:
    """The value ``module`` carries under ``attr`` (see :class:`Carried`), or None."""
    value = module.__dict__.get(attr)
    return value.value if isinstance(value, Carried) else None


def carry(module: nn.Module, attr: str, value: Any) -> None:
    """Carry ``value`` under ``attr`` (see :class:`Carried`); None takes the attribute off the module."""
    if value is None:
        module.__dict__.pop(attr, None)
        return
    object.__setattr__(module, attr, Carried(value))  # not a submodule: no parameters counted twice

