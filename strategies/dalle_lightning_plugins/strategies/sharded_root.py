"""The root FSDP2 unit of a sharded stage and what happens around its forward: the LightningModule's own children
(sharded in place) registered under their own names, gathered before any forward that reads them, every unit returned
to its shards after a forward without backward, the check that every unit ran on every rank of a node, and every
parameter whole for a while (``full_parameters``).

Everything here is about the ``"shard"`` axis of the mesh (the devices of one node); what crosses between nodes is
:mod:`dalle_lightning_plugins.compression.inter_node`'s. Building the units is
:mod:`~dalle_lightning_plugins.strategies.sharding`'s; whole plain weights after a stage
:mod:`~dalle_lightning_plugins.strategies.plain_weights`'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from dalle_lightning_plugins.strategies.shard_reads import ShardReads, guard_hooks


class ShardedRoot(nn.Module):
    """The FSDP root of a stage: the LightningModule's children, sharded in place, around its ``training_step``.

    Lightning calls ``training_step``, not ``forward``; FSDP's root hooks (lazy init, unsharding the root's own
    parameters, the end-of-backward callback) live on ``forward``. Lightning's forward redirection routes
    ``training_step`` through this module's ``forward``. The LightningModule is held, not registered: FSDP2 never
    reaches the user's module itself. Its children are registered here under their own names (so this module's
    parameter names are the LightningModule's); ``originals`` (a sharded stage's
    :class:`~dalle_lightning_plugins.strategies.in_place.InPlace`) keeps the user's own parameter objects and classes
    for :func:`~dalle_lightning_plugins.strategies.plain_weights.to_plain`; None at one device per node.
    """

    def __init__(self, module: nn.Module, parts: dict[str, nn.Module], originals: Any = None) -> None:
        super().__init__()
        self.units_ran: dict[str, int] = {}  # block unit -> forwards since the last check (check_units_ran)
        self.gathered_outside = False  # gathered again after a backward resharded it (see gather_root_before_forward)
        object.__setattr__(self, "owner", module)  # not a submodule: FSDP2 and state dicts never reach it
        object.__setattr__(self, "originals", originals)  # in_place.InPlace of a sharded stage, else None
        object.__setattr__(self, "owner_hooks", [])  # handles of hooks on the LightningModule, for this stage only
        object.__setattr__(self, "reads", None)  # shard_reads.ShardReads of this stage (sharded only)
        for name, part in parts.items():
            self.add_module(name, part)  # a clash with an attribute above raises here, naming it

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, FSDPModule):  # one device per node: whole parameters, read as they are
            return self.owner(*args, **kwargs)
        if self.reads is None:
            object.__setattr__(self, "reads", ShardReads(None))
            units = [m for m in self.modules() if isinstance(m, FSDPModule) and m is not self]
            handles = self.reads.unit_hooks([u for u in units if not any(m is not u and m in units for m in u.modules())])
            if self.originals is not None:
                self.originals.handles.extend(handles)
        if self.reads.current_of is None:  # the stage's first forward: the tensors it released
            self.reads.current_of = self.originals.released_reads() if self.originals is not None else {}
        with self.reads.reading():  # a sharded parameter read outside its unit's forward is read whole (shard_reads)
            return self.owner(*args, **kwargs)

    @contextmanager
    def shards_read(self) -> Generator[None, None, None]:
        """The shards themselves, not whole reads, for a backward or an optimizer step run inside a step."""
        if self.reads is None:
            yield None
            return
        with self.reads.pause():
            yield None

    def remove_owner_hooks(self) -> None:
        """Take the strategy's hooks off the LightningModule (teardown: the module leaves as it came)."""
        for handle in self.owner_hooks:
            handle.remove()
        self.owner_hooks.clear()


def reshard_all(root: nn.Module) -> None:
    """Return every FSDP unit under ``root`` to its shards (a no-op for sharded ones).

    A forward without backward (validation, a metric under ``no_grad``) leaves the root unit gathered: its
    registered parameters are then the gathered copies, which an optimizer built now would update in vain.
    """
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def gather_root_before_forward(root: ShardedRoot) -> None:
    """Gather the root unit before any forward of a module owning its parameters, not only ``training_step``.

    FSDP2 gathers the root unit in ``ShardedRoot.forward`` (around ``training_step``) and reshards it after each
    backward; a second forward in the same step (after ``manual_backward``, with a second optimizer, a metric on
    the updated model) would meet sharded parameters. Gathering again there reads the current shards, so it also
    sees the update an optimizer made in between, as under ``ddp``. A no-op when the unit is gathered. The hooks
    on the children go with the stage's records; the one on the LightningModule is the stage's (:func:`hook_lightning_module`).
    """
    block_params = {id(p) for m in root.modules() if isinstance(m, FSDPModule) and m is not root for p in m.parameters()}
    owned = [(m, n) for m in root.modules() for n, p in m.named_parameters(recurse=False)
             if m is not root and id(p) not in block_params]
    object.__setattr__(root, "probe", owned[0] if owned else None)  # FSDP2 swaps it: a DTensor while sharded
    for owner in {id(m): m for m, _ in owned}.values():  # the user's modules: the handles go with fully_shard's
        root.originals.handles.append(owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root)))
    hook_lightning_module(root)


def hook_lightning_module(root: ShardedRoot) -> None:
    """The LightningModule's own forward (``self(x)`` in a step) gathers the root unit too, and its and the
    callbacks' hooks refuse a host read of a shard, for this stage: :meth:`ShardedRoot.remove_owner_hooks`
    takes them off at teardown."""
    if root.reads is not None:  # one mode per root (a compiled region's guards hold it): its map, at the first forward
        root.reads.current_of = None
    if root.owner_hooks:
        return
    if getattr(root, "probe", None) is not None:
        root.owner_hooks.append(root.owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root)))
    if isinstance(root, FSDPModule):  # hooks reading weights or gradients meet shards (shard_reads)
        root.owner_hooks.extend(guard_hooks(root.owner, "ShardedPowerSGDStrategy"))


def _gather_if_sharded(root: ShardedRoot, *_: Any) -> None:
    owner, name = root.probe
    if isinstance(getattr(owner, name), DTensor):
        root.unshard()  # type: ignore[operator]
        root.gathered_outside = True


def mark_ran(ran: dict[str, int], name: str, *_: Any) -> None:
    """A block's forward pre-hook: one more forward of unit ``name`` since the last :func:`check_units_ran`."""
    ran[name] = ran.get(name, 0) + 1


# Backwards of a stage whose unit counts are checked across the node: the first few (a layer dropped per rank shows
# at once), then one in every VERIFY_EVERY. In between each rank reads its own counts: no collective, no host sync.
VERIFY_FIRST, VERIFY_EVERY = 4, 100


def check_units_ran(root: ShardedRoot, block_names: Sequence[str], group: dist.ProcessGroup,
                    device: torch.device, verify: bool = True) -> tuple[list[str], list[str]]:
    """Every FSDP unit must have run forward on every rank of a node before a backward.

    A block only some ranks run (layer drop decided per rank) leaves FSDP2's gathers and reduce-scatters
    unmatched between the ranks of a node, which hangs or mixes up buffers. With ``verify``, one small all-reduce
    turns that into an error on every rank before the backward's collectives start; without, this rank's own
    counts answer (the same on every rank when every rank runs the same units, which the verified backwards
    establish). Returns the units no rank ran, and those some rank ran more than once (FSDP2 then
    reduce-scatters them once per forward, so their gradients are final only at the end of the backward).
    """
    local = [root.units_ran.get(n, 0) for n in block_names]
    root.units_ran.clear()
    if not verify:
        return [n for n, k in zip(block_names, local) if not k], [n for n, k in zip(block_names, local) if k > 1]
    counts = torch.tensor(local, dtype=torch.float32, device=device)
    ran = counts.clamp(max=1)
    both = torch.stack([ran, -ran, counts])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    highs, lows, most = both[0].tolist(), (-both[1]).tolist(), both[2].tolist()
    uneven = [n for n, hi, lo in zip(block_names, highs, lows) if hi != lo]
    if uneven:
        raise RuntimeError(
            f"block {uneven[0]} ran forward on some ranks of a node only; ShardedPowerSGDStrategy needs every "
            f"FSDP unit in every rank's forward at devices_per_node > 1: run it everywhere (scale its output "
            f"by 0 where skipped), or leave it out of the units (block_patterns/block_classes) or use devices_per_node=1"
        )
    return [n for n, hi in zip(block_names, highs) if not hi], [n for n, k in zip(block_names, most) if k > 1]


def replicated_parameters(module: nn.Module, sharded: bool) -> list[nn.Parameter]:
    """The parameters FSDP2 left whole on every rank of a sharded node (see :func:`~dalle_lightning_plugins.strategies.sharding.prepare_for_sharding`)."""
    return [p for p in module.parameters() if sharded and not hasattr(p, "to_local")]


@contextmanager
def full_parameters(root: nn.Module, reshard_after_forward: bool) -> Generator[None, None, None]:
    """Collective: every parameter whole on every rank for the duration (the strategy's ``full_parameters``).

    For code that reaches a sharded model outside its ``forward`` (sampling with a key/value cache, a
    decoder's ``decode`` method, image grids): FSDP2 only gathers a unit's parameters around its
    ``forward``. Inside, no unit reshards after its forward; on exit every unit returns to its shards.
    Memory: the whole model on every rank, as in a single-device run.
    """
    if not isinstance(root, FSDPModule):
        yield None
        return
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield None
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward and unit is not root, recurse=False)

