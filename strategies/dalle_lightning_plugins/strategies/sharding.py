"""Building a sharded stage within a node: meta-device stand-ins of the LightningModule's children
(:mod:`~dalle_lightning_plugins.strategies.stand_ins`) become FSDP2 units on the ``"shard"`` axis of the mesh (each
block, bottom-up, then the root, :class:`~dalle_lightning_plugins.strategies.sharded_root.ShardedRoot`), with the
next blocks prefetched, and each rank's shards are filled from the user's tensors. A failure on the way gives the
user's children back (:mod:`~dalle_lightning_plugins.strategies.plain_weights`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies import stand_ins
from dalle_lightning_plugins.strategies.compiled_stand_ins import compile_stand_ins
from dalle_lightning_plugins.strategies.plain_weights import restore_after_error
from dalle_lightning_plugins.strategies.prefetch import apply_prefetch
from dalle_lightning_plugins.strategies.sharded_root import ShardedRoot, mark_ran, gather_root_before_forward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
    ``block_names``, each block marks ``root.units_ran[name]`` when its forward runs (:func:`~dalle_lightning_plugins.strategies.sharded_root.check_units_ran`)."""
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
        block.register_forward_pre_hook(functools.partial(mark_ran, root.units_ran, name))
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
    root.released.update(stand_ins.release(originals))
    root.guards.extend(stand_ins.guard_originals(originals))


def shard_stand_ins(module: nn.Module, prepare: Callable[[nn.Module], tuple[nn.Module, list[tuple[str, nn.Module]]]],
                    mesh: DeviceMesh, device: torch.device, **options: Any) -> ShardedRoot:
    """A sharded stage's root: meta stand-ins of ``module``'s children
    (:func:`~dalle_lightning_plugins.strategies.stand_ins.make_stand_ins`), ``prepare``d (the precision plugin's
    conversion and hooks go on them; it returns the module and its blocks by name), sharded (:func:`shard_module`
    with ``options``), compiled where the user's are (:mod:`~dalle_lightning_plugins.strategies.compiled_stand_ins`)
    and filled (:func:`materialize_stand_ins`), ``self.device`` the root device. A failure on the way puts the
    user's children back as they came, then raises."""
    originals = stand_ins.make_stand_ins(module, mesh.size())
    root: ShardedRoot | None = None
    try:
        module, blocks = prepare(module)
        root = shard_module(module, originals, [b for _, b in blocks], mesh, block_names=[n for n, _ in blocks],
                            **options)
        compile_stand_ins(originals, dict(root.named_children()), mesh.size())
        materialize_stand_ins(root, device)
    except BaseException:
        if root is None:
            stand_ins.put_back(module, originals)  # nothing released yet
        else:
            restore_after_error(root, torch.device("cpu"))
        raise
    compat.set_module_device(module, device)  # self.device in the stage: the root device, as under ddp
    return root

