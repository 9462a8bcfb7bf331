"""FSDP2 wiring of the strategy within a node: the root unit, sharding the blocks, gathering and resharding, and
making every rank start from the same weights and buffers.

Everything here is about the ``"shard"`` axis of the mesh (the devices of one node); what crosses between nodes
is :mod:`dalle_lightning_plugins.compression.inter_node`'s. The functions take modules, meshes and groups, not the strategy,
so the strategy's own module reads as Lightning's hook order.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from typing_extensions import override

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies.prefetch import apply_prefetch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ShardedRoot(nn.Module):
    """The FSDP root around the LightningModule.

    Lightning calls ``training_step``, not ``forward``; FSDP's root hooks (lazy init, unsharding the root's own
    parameters, the end-of-backward callback) live on ``forward``. Lightning's forward redirection routes
    ``training_step`` through this module's ``forward``, so the hooks run, while the LightningModule itself
    stays a plain module (its own ``self(x)`` calls are not re-entrant FSDP calls).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.units_ran: dict[str, int] = {}  # block unit -> forwards since the last check (check_units_ran)
        self.gathered_outside = False  # gathered again after a backward resharded it (see gather_root_before_forward)

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


# Attribute of a sharded LightningModule: (its ShardedRoot, shard-axis size). FSDP2 shards a module only once, so
# a later fit of the same Trainer, or a new Trainer, reuses the units made for it.
SHARDED_ROOT_ATTR = "_sharded_powersgd_root"


class Carried:
    """A value a module carries from one Trainer to the next that pickling and ``deepcopy`` leave out (as ``None``).

    FSDP2's state holds process groups, which neither can copy; and a copy of a module is a new model, which a
    later Trainer shards afresh. So ``torch.save(module)`` or ``copy.deepcopy(module)`` after ``fit`` works as under
    ``ddp``.
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
    sees the update an optimizer made in between, as under ``ddp``. A no-op when the unit is gathered.
    """
    block_params = {id(p) for m in root.modules() if isinstance(m, FSDPModule) and m is not root for p in m.parameters()}
    owned = [(m, n) for m in root.module.modules() for n, p in m.named_parameters(recurse=False)
             if id(p) not in block_params]
    if not owned:
        return  # the root unit holds no parameters
    probe = owned[0]  # FSDP2 swaps the registered parameter: a DTensor while the unit is sharded
    for owner in {id(m): m for m in [root.module, *(m for m, _ in owned)]}.values():
        owner.register_forward_pre_hook(functools.partial(_gather_if_sharded, root, probe))


def _gather_if_sharded(root: ShardedRoot, probe: tuple[nn.Module, str], *_: Any) -> None:
    owner, name = probe
    if isinstance(owner._parameters[name], DTensor):
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
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch_depth: int = 1,
    activation_checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    block_names: Sequence[str] | None = None,
) -> ShardedRoot:
    """Make each block an FSDP2 unit on the 1-D ``mesh`` (bottom-up), then wrap ``module`` in the root unit.
    With ``block_names``, each block marks ``root.units_ran[name]`` when its forward runs (:func:`check_units_ran`)."""
    policy = mp_policy or MixedPrecisionPolicy()
    ignored = prepare_for_sharding(module)
    for block in blocks:
        if activation_checkpointing:
            checkpoint_activations(block)  # hook-based: keeps parameter names unchanged
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, ignored_params=ignored)
    root = ShardedRoot(module)
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    # ddp(find_unused_parameters=True): a parameter without a gradient on this rank (a branch only some ranks
    # take) joins the reduce-scatter with zeros, so every rank sends the same buffers.
    compat.reduce_scatter_unused_params(root)  # torch's own call from 2.13
    gather_root_before_forward(root)
    apply_prefetch(list(blocks), prefetch_depth)  # type: ignore[arg-type]
    for name, block in zip(block_names or (), blocks):
        block.register_forward_pre_hook(functools.partial(_mark_ran, root.units_ran, name))
    return root


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


def full_bytes(root: nn.Module) -> int:
    """Bytes of every parameter of ``root``'s FSDP units, whole (what :func:`to_plain` puts on each rank)."""
    units = [u for u in root.modules() if isinstance(u, FSDPModule)]
    return sum(fp.sharded_param.numel() * fp.sharded_param.element_size() for u in units for fp in _fsdp_params(u))


def _fsdp_params(unit: nn.Module) -> list[Any]:
    state = unit._get_fsdp_state()  # type: ignore[operator]
    return [fp for group in compat.fsdp_param_groups(state) for fp in group.fsdp_params]


# Attribute of a ShardedRoot made plain by :func:`to_plain` (carried): [(unit, its FSDP class, its FSDP state, its
# FSDPParams, its composable-API entries)].
PLAIN_UNITS_ATTR = "_plain_units"


def is_plain(root: nn.Module) -> bool:
    """Whether :func:`to_plain` made ``root`` whole and plain (and :func:`from_plain` has not sharded it again)."""
    return bool(carried(root, PLAIN_UNITS_ATTR))


def _detach_fsdp_hooks(unit: nn.Module, state: Any, params: list[Any]) -> dict[str, Any]:
    """Take FSDP2's hooks and composable-API entries off a unit made plain; :func:`_attach_fsdp_hooks` puts them back.

    A plain module is then a single-process one, as under ``ddp``: a forward runs no unshard; ``load_state_dict``
    runs no post-load hook expecting a DTensor (``reset_sharded_param``); pickling and ``deepcopy`` meet no local
    closures and no ``fully_shard`` registry entry (whose function pickle cannot name).
    """
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    for group in compat.fsdp_param_groups(state):
        for handles in (group._module_to_pre_save_state_dict_hook_handle,
                        group._module_to_pre_load_state_dict_hook_handle):
            for handle in handles.values():
                handle.remove()
            handles.clear()
    for fp in params:
        fp._post_load_hook_handle.remove()
    entries: dict[str, Any] = {}
    all_state, registry = unit.__dict__.get(STATE_KEY, {}), unit.__dict__.get(REGISTRY_KEY, {})
    entries["state"] = {k: all_state.pop(k) for k, v in list(all_state.items()) if v is state}
    entries["registry"] = {k: registry.pop(k) for k in list(registry) if k == "fully_shard"}
    return entries


def _attach_fsdp_hooks(unit: nn.Module, state: Any, params: list[Any], entries: dict[str, Any]) -> None:
    unit.__dict__.setdefault(STATE_KEY, {}).update(entries["state"])
    unit.__dict__.setdefault(REGISTRY_KEY, {}).update(entries["registry"])
    for fp in params:
        fp._post_load_hook_handle = fp._module_info.module.register_load_state_dict_post_hook(
            functools.partial(_reset_sharded_param, fp))
    for group in compat.fsdp_param_groups(state):
        group._register_state_dict_hooks()
    module = state._modules[0]
    state._pre_forward_hook_handle = module.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                      with_kwargs=True)
    state._post_forward_hook_handle = module.register_forward_hook(state._post_forward, prepend=False)


def _reset_sharded_param(fp: Any, *args: Any, **kwargs: Any) -> None:
    fp.reset_sharded_param()  # FSDP2's own post-load hook, as fully_shard registers it


@torch.no_grad()
def to_plain(root: nn.Module) -> None:
    """Collective over the shard axis: every FSDP unit's parameters whole and plain (``torch.Tensor``), as ``ddp``
    leaves a module after ``fit``; :func:`from_plain` shards them again (taking what they hold then).

    Each sharded parameter is gathered (``DTensor.full_tensor()``) into a new plain ``nn.Parameter`` registered in
    its place; the units' hooks are taken off (:func:`_detach_fsdp_hooks`) and their class set back to the
    module's own, so a forward, ``.cpu()``/``.to()``, ``load_state_dict``, ``torch.save`` or ``deepcopy`` of the
    plain module is a single-process one, as under ``ddp``. The shards stay referenced (carried, not registered),
    for :func:`from_plain`. Memory: the whole model on every rank.
    """
    if is_plain(root):
        return
    reshard_all(root)
    plain = []
    for unit in [u for u in root.modules() if isinstance(u, FSDPModule)]:
        state = unit._get_fsdp_state()  # type: ignore[operator]
        params = _fsdp_params(unit)
        for fp in params:
            sharded = fp.sharded_param
            fp._setattr_on_modules(nn.Parameter(sharded.full_tensor(), requires_grad=sharded.requires_grad))
        plain.append((unit, type(unit), state, params, _detach_fsdp_hooks(unit, state, params)))
    for unit, cls, *_ in plain:
        unit.__class__ = cls.__bases__[1]  # fully_shard's FSDP<Cls>(FSDPModule, Cls) -> Cls
    carry(root, PLAIN_UNITS_ATTR, plain)


@torch.no_grad()
def from_plain(root: nn.Module) -> None:
    """Undo :func:`to_plain` (no collective): each rank copies its shard of every plain parameter's current value
    into the unit's sharded parameter and registers that again, so what a user did to the plain module between
    two stages (an update, ``load_state_dict``) carries into the next ``fit``. A no-op when ``root`` is sharded."""
    plain = carried(root, PLAIN_UNITS_ATTR)
    if not plain:
        return
    for unit, cls, state, params, entries in plain:
        unit.__class__ = cls
        for fp in params:
            info = fp._module_info
            current = getattr(info.module, info.param_name)
            local = fp.sharded_param._local_tensor
            size, rank = fp.mesh_info.shard_mesh_size, fp.mesh_info.shard_mesh_rank
            chunks = torch.chunk(current.detach(), size, dim=0)
            if local.numel() and rank < len(chunks):
                local.copy_(chunks[rank].to(local.device, local.dtype))
            fp._setattr_on_modules(fp.sharded_param)
        _attach_fsdp_hooks(unit, state, params, entries)
    carry(root, PLAIN_UNITS_ATTR, None)


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (None: every rank) takes the group's first rank's buffers (as
    ``ddp(broadcast_buffers=True)`` before each forward)."""
    buffers = [b for b in module.buffers()
               if not isinstance(b, DTensor) and (b.is_floating_point() or b.dtype in (torch.int64, torch.int32))]
    if buffers:
        broadcast_flat(buffers, group)


@torch.no_grad()
def broadcast_replicas(module: nn.Module, replicate: DeviceMesh, world_size: int) -> None:
    """Make every node start from node 0's shards, and every rank from rank 0's whole parameters and buffers.

    Each process initialises its own copy; without this, replicas of one shard would start (and stay)
    different whenever the seeds differ.
    """
    if replicate.size() > 1:
        locals_ = [p.to_local() for p in module.parameters() if hasattr(p, "to_local")]
        broadcast_flat(locals_, replicate.get_group())
    whole = [p.data for p in module.parameters() if not hasattr(p, "to_local")]  # parameters left whole
    if whole and world_size > 1:
        broadcast_flat(whole, None)
    if world_size > 1:
        broadcast_buffers(module)


def broadcast_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Broadcast from the group's first rank in one collective per dtype instead of one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if group is None:
            dist.broadcast(flat, src=0)
        else:
            dist.broadcast(flat, group=group, group_src=0)
        for t, chunk in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(chunk.view(t.shape))
