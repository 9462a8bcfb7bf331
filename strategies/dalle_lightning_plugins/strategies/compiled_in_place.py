"""A sharded stage's modules the user compiled with ``Module.compile(...)``, compiled again around FSDP2's units.

Sharded in place, a compiled module's call would hold FSDP2's hooks, which dynamo never traces (torch disables them
for it: a region holding one breaks there, ends compiling nothing when the break is inside torch's own modules, and
fails outright with ``fullgraph=True``: ``Unsupported: Call to torch._dynamo.disable()``). So for the stage the
user's compiled call is set aside and the module is compiled with the user's own configuration
(:func:`~dalle_lightning_plugins.compat.compile_config`: backend, ``fullgraph``, ``mode``, ``options``,
``dynamic``), in regions that hold no FSDP2 hook:

* a module with no FSDP2 unit in it (a head, a child inside a block) is compiled as the user's is: its whole
  call, its own hooks and ``forward`` (``Module.compile``'s region, the same on both sides);
* an FSDP2 unit with no unit below it (a block) has its ``forward`` compiled: the region between FSDP2's gather
  before it and its reshard after;
* a module holding units runs its own code eagerly (a container's loop over its blocks) and each of its children
  is compiled by these rules.

The values are ``ddp``'s (the same graphs, cut at the units). At the stage's end each module's own compiled call and
``forward`` come back (:class:`Recompiled`, removed with FSDP2's hooks). Where the installed torch does not show a
compile's configuration, the module trains eagerly, said in one line on rank 0.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dalle_lightning_plugins import compat


class Recompiled:
    """What the stage changed on a user's module to compile it around the units; :meth:`remove` puts it back."""

    def __init__(self, module: nn.Module, attr: str, value: Any) -> None:
        self.module, self.attr = module, attr
        self.previous = module.__dict__.get(attr, _ABSENT)
        module.__dict__[attr] = self.value = value

    def remove(self) -> None:
        if self.module.__dict__.get(self.attr, _ABSENT) is not self.value:
            return  # changed since (activation checkpointing's own undo): left as it is
        if self.previous is _ABSENT:
            del self.module.__dict__[self.attr]
        else:
            self.module.__dict__[self.attr] = self.previous


_ABSENT = object()


def compile_regions(module: nn.Module, config: Any, units: set[int], done: set[int], changed: list[Recompiled]) -> None:
    """Compile ``module`` with ``config`` in regions without an FSDP2 hook (``units``: the ids of the FSDP2 units);
    ``done``: the ids of modules already in a compiled region (a module shared between children, a module the user
    compiled inside another), left as they are; ``changed``: what it changed, for the stage's end."""
    if id(module) in done:
        return
    inside = [m for m in module.modules() if id(m) in units and m is not module]
    if not inside:
        if id(module) in units:  # FSDP2's hooks run around it, outside the region
            changed.append(Recompiled(module, "forward", config(module.forward)))
        else:
            changed.append(Recompiled(module, "_compiled_call_impl", config(module._call_impl)))
        done.update(id(m) for m in module.modules())
        return
    for child in module.children():
        compile_regions(child, config, units, done, changed)


def compile_in_place(children: dict[str, nn.Module], shard_size: int) -> list[Recompiled]:
    """Compile each module of ``children`` (a sharded stage's, FSDP2 units among them) that the user compiled with
    ``Module.compile(...)`` with that configuration, in regions without FSDP2's hooks, the user's compiled call set
    aside; outer modules first, so a module inside an outer compiled one keeps the outer one's region, as under
    ``ddp``. Returns what it changed (removed at the stage's end). Those left eager (this torch does not show the
    configuration) are said in one line."""
    units = {id(m) for child in children.values() for m in child.modules() if isinstance(m, FSDPModule)}
    done: set[int] = set()
    eager: list[str] = []
    changed: list[Recompiled] = []
    found = []
    for name, child in children.items():
        for sub, module in child.named_modules():  # outer modules first
            if compat.compiled_call(module) is not None:  # every user's call set aside, an inner one's too
                found.append((f"{name}.{sub}".rstrip("."), module, compat.compile_config(module)))
                changed.append(Recompiled(module, "_compiled_call_impl", None))
    for label, module, config in found:
        if id(module) in done:
            continue
        if config is None:
            eager.append(label)
            continue
        compile_regions(module, config, units, done, changed)
    if eager:
        rank_zero_warn(f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {', '.join(eager)} compiled with "
                       "Module.compile() trains eagerly in a sharded stage (the installed torch does not show the "
                       "compile's configuration to compile it alike)")
    return changed[::-1]  # removed last change first
