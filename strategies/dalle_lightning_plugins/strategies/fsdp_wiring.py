"""FSDP2 wiring of the strategy within a node: the root unit, sharding the blocks over the stand-ins
(:mod:`~dalle_lightning_plugins.strategies.stand_ins`), gathering and resharding, the module made plain again after a
stage. Every rank starting from the same weights and buffers is :mod:`~dalle_lightning_plugins.strategies.broadcasts`'.

Everything here is about the ``"shard"`` axis of the mesh (the devices of one node); what crosses between nodes
is :mod:`dalle_lightning_plugins.compression.inter_node`'s. The functions take modules, meshes and groups, not the strategy,
so the strategy's own module reads as Lightning's hook order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies import stand_ins
from dalle_lightning_plugins.strategies.broadcasts import (  # noqa: F401 (their names here before)
    broadcast_buffers,
    broadcast_flat,
    broadcast_replicas,
)
from dalle_lightning_plugins.strategies.prefetch import apply_prefetch
from dalle_lightning_plugins.strategies.stand_ins import make_stand_ins as swap_in_stand_ins  # noqa: F401 (old name)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ShardedRoot(nn.Module):
    """The FSDP root of a stage: stand-ins of the LightningModule's children, sharded, around its ``training_step``.

    Lightning calls ``training_step``, not ``forward``; FSDP's root hooks (lazy init, unsharding the root's own
    parameters, the end-of-backward callback) live on ``forward``. Lightning's forward redirection routes
    ``training_step`` through this module's ``forward``. The LightningModule is held, not registered: FSDP2 never
    reaches the user's module itself. Its children are registered here under their own names (so this module's
    parameter names are the LightningModule's): for a sharded stage meta-device stand-ins of them
    (:mod:`~dalle_lightning_plugins.strategies.stand_ins`), which the LightningModule holds for the stage while
    ``originals`` keeps the user's own children for :func:`to_plain` (``released``: their tensors whose storage the
    shards hold; ``guards``: the hooks refusing their forward for the stage); at one device per node the children
    themselves (``originals`` None: nothing is copied).
    """

    def __init__(self, module: nn.Module, parts: dict[str, nn.Module],
                 originals: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.units_ran: dict[str, int] = {}  # block unit -> forwards since the last check (check_units_ran)
        self.gathered_outside = False  # gathered again after a backward resharded it (see gather_root_before_forward)
        object.__setattr__(self, "owner", module)  # not a submodule: FSDP2 and state dicts never reach it
        object.__setattr__(self, "originals", originals)
        object.__setattr__(self, "owner_hooks", [])  # handles of hooks on the LightningModule, for this stage only
        object.__setattr__(self, "released", {})  # parameter or buffer name -> stand_ins.Released
        object.__setattr__(self, "guards", [])  # forward pre-hooks on the user's children, for this stage only
        for name, part in parts.items():
            self.add_module(name, part)  # a clash with an attribute above raises here, naming it

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner(*args, **kwargs)

    def remove_owner_hooks(self) -> None:
        """Take the strategy's hooks off the LightningModule (teardown: the module leaves as it came)."""
        for handle in self.owner_hooks:
            handle.remove()
        self.owner_hooks.clear()


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
    on the stand-ins stay with them; the one on the LightningModule is the stage's (:func:`hook_lightning_module`).
    """
    block_params = {id(p) for m in root.modules() if isinstance(m, FSDPModule) and m is not root for p in m.parameters()}
    owned = [(m, n) for m in root.modules() for n, p in m.named_parameters(recurse=False)
             if m is not root and id(p) not in block_params]
    object.__setattr__(root, "probe", owned[0] if owned else None)  # FSDP2 swaps it: a DTensor while sharded
    for owner in {id(m): m for m, _ in owned}.values():
        owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root))
    hook_lightning_module(root)


def hook_lightning_module(root: ShardedRoot) -> None:
    """The LightningModule's own forward (``self(x)`` in a step) gathers the root unit too, for this stage:
    :meth:`ShardedRoot.remove_owner_hooks` takes it off at teardown."""
    if getattr(root, "probe", None) is not None and not root.owner_hooks:
        root.owner_hooks.append(root.owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root)))


def _gather_if_sharded(root: ShardedRoot, *_: Any) -> None:
    owner, name = root.probe
    if isinstance(getattr(owner, name), DTensor):
        root.unshard()  # type: ignore[operator]
        root.gathered_outside = True


def prepare_for_sharding(module: nn.Module) -> set[nn.Parameter]:
    """Convert what FSDP2 cannot shard at the boundary; return the parameters it must leave alone.

    * Parameters in another memory format (channels-last convolution weights, which FSDP2 refuses as
      non-contiguous) are made contiguous. The activations keep their format: a convolution with a
      channels-last input still runs channels-last, and FSDP2 all-gathers every weight into a contiguous
      buffer anyway. Single-process runs never come here and keep channels-last weights.
    * Scalar (0-d) parameters, such as CLIP's ``logit_scale``, cannot be sharded on dim 0: they stay whole on
      every rank (``ignored_params``) and the strategy averages their gradients over all ranks itself.
    """
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    return {p for p in module.parameters() if p.dim() == 0}


def shard_module(
    module: nn.Module,
    originals: dict[str, nn.Module],
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch_depth: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    block_names: Sequence[str] | None = None,
) -> ShardedRoot:
    """Make each block an FSDP2 unit on the 1-D ``mesh`` (bottom-up), then the root unit of ``module``'s stand-ins
    (:func:`~dalle_lightning_plugins.strategies.stand_ins.make_stand_ins` made them on the meta device; ``blocks``
    are theirs; :func:`materialize_stand_ins` allocates and fills their shards). The LightningModule's own
    parameters (not in a child) stay whole on every rank, as scalars do (:func:`prepare_for_sharding`). With
    ``block_names``, each block marks ``root.units_ran[name]`` when its forward runs (:func:`check_units_ran`)."""
    policy = mp_policy or MixedPrecisionPolicy()
    ignored = prepare_for_sharding(module) | set(module.parameters(recurse=False))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, ignored_params=ignored)
    root = ShardedRoot(module, {name: getattr(module, name) for name in originals}, originals)
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    with torch.no_grad():  # FSDP2 moves what it manages; the LightningModule's own tensors are not under root
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            # meta (init_module(empty_init=True)): allocated (zeros: no reset_parameters covers the module's own
            # tensors, which Lightning's materialisation leaves uninitialised); rank 0's reach every rank
            if tensor.is_meta:
                stand_ins.assign(tensor, torch.zeros_like(tensor, device=mesh.device_type))
            else:
                tensor.data = tensor.data.to(mesh.device_type)
    # ddp(find_unused_parameters=True): a parameter without a gradient on this rank (a branch only some ranks
    # take) joins the reduce-scatter with zeros, so every rank sends the same buffers.
    compat.reduce_scatter_unused_params(root)  # torch's own call from 2.13
    gather_root_before_forward(root)
    apply_prefetch(list(blocks), prefetch_depth)  # type: ignore[arg-type]
    for name, block in zip(block_names or (), blocks):
        block.register_forward_pre_hook(functools.partial(_mark_ran, root.units_ran, name))
    return root


@torch.no_grad()
def materialize_stand_ins(root: ShardedRoot, device: torch.device) -> None:
    """Allocate this rank's shards of the meta stand-ins on ``device`` and fill them from the user's tensors, whose
    storage then goes back (:mod:`~dalle_lightning_plugins.strategies.stand_ins`); a user's child built on the meta
    device (``init_module(empty_init=True)``) is initialised as ``ModelParallelStrategy`` does (each submodule's
    ``reset_parameters`` on its shards). From here to the stage's end a forward through a user's child is refused."""
    originals = root.originals
    if any(t.is_meta for child in originals.values() for t in [*child.parameters(), *child.buffers()]):
        compat.materialize_distributed_module(root, device)
    else:
        root.to_empty(device=device)
    stand_ins.fill_shards(root, originals)
    root.released.update(stand_ins.release(originals, stand_ins.keeps_storage(originals, device)))
    root.guards.extend(stand_ins.guard_originals(originals))


def shard_stand_ins(module: nn.Module, prepare: Callable[[nn.Module], tuple[nn.Module, list[tuple[str, nn.Module]]]],
                    mesh: DeviceMesh, device: torch.device, **options: Any) -> ShardedRoot:
    """A sharded stage's root: meta stand-ins of ``module``'s children
    (:func:`~dalle_lightning_plugins.strategies.stand_ins.make_stand_ins`), ``prepare``d (the precision plugin's
    conversion and hooks go on them; it returns the module and its blocks by name), sharded (:func:`shard_module`
    with ``options``) and filled (:func:`materialize_stand_ins`), ``self.device`` the root device. A failure on the way
    puts the user's children back as they came, then raises."""
    originals = stand_ins.make_stand_ins(module, mesh.size())
    root: ShardedRoot | None = None
    try:
        module, blocks = prepare(module)
        root = shard_module(module, originals, [b for _, b in blocks], mesh, block_names=[n for n, _ in blocks],
                            **options)
        materialize_stand_ins(root, device)
    except BaseException:
        if root is None:
            stand_ins.put_back(module, originals)  # nothing released yet
        else:
            restore_after_error(root, torch.device("cpu"))
        raise
    compat.set_module_device(module, device)  # self.device in the stage: the root device, as under ddp
    return root


def _remove_guards(root: ShardedRoot) -> None:
    for handle in root.guards:
        handle.remove()
    root.guards.clear()


def restore_after_error(root: ShardedRoot, device: torch.device) -> bool:
    """No collective (a stage that failed or was interrupted; a peer may be gone): the LightningModule gets its own
    children back, each rank alone (:func:`~dalle_lightning_plugins.strategies.stand_ins.restore_locally`). Returns
    whether released tensors came back from this rank's shards only. A no-op for a root without stand-ins."""
    if not getattr(root, "originals", None):
        return False
    _remove_guards(root)
    if not is_plain(root):
        reshard_all(root)
        stand_ins.put_back(root.owner, root.originals)
    return stand_ins.restore_locally(root, root.released, device)


def _mark_ran(ran: dict[str, int], name: str, *_: Any) -> None:
    ran[name] = ran.get(name, 0) + 1


def check_units_ran(root: ShardedRoot, block_names: Sequence[str], group: dist.ProcessGroup,
                    device: torch.device) -> tuple[list[str], list[str]]:
    """Collective over the node: every FSDP unit must have run forward on every rank before a backward.

    A block only some ranks run (layer drop decided per rank) leaves FSDP2's gathers and reduce-scatters
    unmatched between the ranks of a node, which hangs or mixes up buffers. One small all-reduce turns that
    into an error on every rank before the backward's collectives start. Returns the units no rank ran, and
    those some rank ran more than once (FSDP2 then reduce-scatters them once per forward, so their gradients
    are final only at the end of the backward).
    """
    counts = torch.tensor([root.units_ran.get(n, 0) for n in block_names], dtype=torch.float32, device=device)
    root.units_ran.clear()
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
    """The parameters FSDP2 left whole on every rank of a sharded node (see :func:`prepare_for_sharding`)."""
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


def whole_bytes(module: nn.Module) -> int:
    """Bytes of every parameter of ``module`` whole (what :func:`to_plain` puts on each rank): a DTensor counts
    its global size."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def is_plain(root: nn.Module) -> bool:
    """Whether ``root``'s LightningModule holds the user's own children again (:func:`to_plain`), not the sharded
    stand-ins (:func:`from_plain` puts those back). False for a root without stand-ins (one device per node)."""
    originals = getattr(root, "originals", None)
    return bool(originals) and all(getattr(root.owner, n) is child for n, child in originals.items())


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


@torch.no_grad()
def to_plain(root: ShardedRoot, device: torch.device | None = None) -> None:
    """Collective over the shard axis: the LightningModule gets its own children back, holding the trained values
    whole, as ``ddp`` leaves a module after ``fit``; :func:`from_plain` puts the sharded stand-ins back.

    Each stand-in tensor is gathered (``DTensor.full_tensor()``, one at a time: the peak is one parameter) into the
    user's tensor of the same name (:func:`~dalle_lightning_plugins.strategies.stand_ins.give_back`; one whose
    storage the stage released is allocated anew, on ``device`` if given), so the user's parameter objects, classes
    and hooks are those they had before the stage. The stand-ins stay with ``root`` (the optimizer's parameters).
    """
    if is_plain(root) or not getattr(root, "originals", None):
        return
    reshard_all(root)
    _remove_guards(root)
    stand_ins.put_back(root.owner, root.originals)
    stand_ins.give_back(root, root.released, device)


@torch.no_grad()
def from_plain(root: ShardedRoot) -> None:
    """Undo :func:`to_plain` (no collective): the sharded stand-ins back into the LightningModule, each rank taking
    its shard of what the user's tensors hold now, so what a user did to the plain module after a stage (an update,
    ``load_state_dict``) is in the shards (a checkpoint saved after ``fit``). A no-op when the stand-ins are in."""
    if not is_plain(root):
        return
    module = root.owner
    current = dict(_named_tensors(module))
    for name in root.originals:
        setattr(module, name, getattr(root, name))
    for name, value in _named_tensors(root):
        source = current[name].detach().to(value.device, value.dtype)
        if isinstance(value, DTensor):
            source = distribute_tensor(source, value.device_mesh, value.placements, src_data_rank=None)
        value.copy_(source)


def release_originals(root: ShardedRoot) -> None:
    """The module stays sharded after the stage (``full_weights_after=False``): the user's own children are dropped,
    so that only the shards take memory; a later stage reuses the stand-ins."""
    _remove_guards(root)
    root.released.clear()
    object.__setattr__(root, "originals", None)
