"""A sharded stage's stand-ins of modules the user compiled with ``Module.compile(...)``, compiled again alike.

``make_stand_ins``' deep copy drops a module's compiled call (``nn.Module.__getstate__``), and the stand-ins carry
FSDP2's hooks, which dynamo never traces (torch disables them for it: a region holding one breaks there, ends
compiling nothing when the break is inside torch's own modules, and fails outright with ``fullgraph=True``). So
each stand-in is compiled with the user's own configuration (:func:`~dalle_lightning_plugins.compat.compile_config`:
backend, ``fullgraph``, ``mode``, ``options``, ``dynamic``), in regions that hold no FSDP2 hook:

* a stand-in with no FSDP2 unit in it (a head, a child inside a block) is compiled as the user's is: its whole
  call, its own hooks and ``forward`` (``Module.compile``'s region, the same on both sides);
* an FSDP2 unit with no unit below it (a block) has its ``forward`` compiled: the region between FSDP2's gather
  before it and its reshard after;
* a module holding units runs its own code eagerly (a container's loop over its blocks) and each of its children
  is compiled by these rules.

The values are ``ddp``'s (the same graphs, cut at the units). Where the installed torch does not show a compile's
configuration, the stand-in trains eagerly, said in one line on rank 0.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dalle_lightning_plugins import compat


def compile_regions(stand_in: nn.Module, config: Any, units: set[int], done: set[int]) -> None:
    """Compile ``stand_in`` with ``config`` in regions without an FSDP2 hook (``units``: the ids of the FSDP2 units);
    ``done``: the ids of modules already in a compiled region (a module shared between children, a module the user
    compiled inside another), left as they are."""
    if id(stand_in) in done:
        return
    inside = [m for m in stand_in.modules() if id(m) in units and m is not stand_in]
    if not inside:
        if id(stand_in) in units:
            stand_in.forward = config(stand_in.forward)  # FSDP2's hooks run around it, outside the region
        else:
            compat.compile_call(stand_in, config)
        done.update(id(m) for m in stand_in.modules())
        return
    for child in stand_in.children():
        compile_regions(child, config, units, done)


def compile_stand_ins(originals: dict[str, nn.Module], stand_ins: dict[str, nn.Module], shard_size: int) -> list[str]:
    """Compile each stand-in module (``stand_ins``: a sharded stage's, FSDP2 units among them) whose user's module
    (in ``originals``, by the same names) was compiled with ``Module.compile(...)``, with that configuration, in
    regions without FSDP2's hooks; outer modules first, so a module inside an outer compiled one keeps the outer
    one's region, as under ``ddp``. Returns the names of those left eager (this torch does not show the
    configuration), said in one line."""
    units = {id(m) for stand_in in stand_ins.values() for m in stand_in.modules() if isinstance(m, FSDPModule)}
    done: set[int] = set()
    eager: list[str] = []
    for name, child in originals.items():
        for sub, original in child.named_modules():  # outer modules first
            if compat.compiled_call(original) is None:
                continue
            stand_in = stand_ins[name].get_submodule(sub)  # a deep copy: the same structure, the same names
            if id(stand_in) in done:
                continue
            config = compat.compile_config(original)
            if config is None:
                eager.append(f"{name}.{sub}".rstrip("."))
                continue
            compile_regions(stand_in, config, units, done)
    if eager:
        rank_zero_warn(f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {', '.join(eager)} compiled with "
                       "Module.compile() trains eagerly in a sharded stage (the installed torch does not show the "
                       "compile's configuration to compile its stand-in alike)")
    return eager
