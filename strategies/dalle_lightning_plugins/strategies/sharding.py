"""Building a sharded stage within a node: the LightningModule's own children become FSDP2 units in place on the
``"shard"`` axis of the mesh (each block, bottom-up, then the root,
:class:`~dalle_lightning_plugins.strategies.sharded_root.ShardedRoot`), with the next blocks prefetched; the user's
parameter objects are recorded first and give their storage back once sharded
(:mod:`~dalle_lightning_plugins.strategies.in_place`). A failure on the way gives the user's module back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies import in_place
from dalle_lightning_plugins.strategies.compiled_in_place import compile_in_place
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
    kept: in_place.InPlace,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    prefetch_depth: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    block_names: Sequence[str] | None = None,
) -> ShardedRoot:
    """Make each block an FSDP2 unit on the 1-D ``mesh`` (bottom-up), then the root unit of ``module``'s children, in
    place; the user's parameter objects (``kept``) give their storage back unit by unit. The LightningModule's own
    parameters (not in a child) stay whole on every rank, as scalars do (:func:`prepare_for_sharding`). With
    ``block_names``, each block marks ``root.units_ran[name]`` when its forward runs (:func:`~dalle_lightning_plugins.strategies.sharded_root.check_units_ran`)."""
    policy = mp_policy or MixedPrecisionPolicy()
    ignored = prepare_for_sharding(module) | set(module.parameters(recurse=False))
    kept.ignore(ignored)
    for block in blocks:
        ids = [id(p) for p in block.parameters()]
        kept.hold(ids)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, ignored_params=ignored)
        kept.release(ids)
    root = ShardedRoot(module, kept.children, kept)
    ids = [id(p) for p in root.parameters()]
    kept.hold(ids)
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    kept.release(ids)
    kept.classes[id(root)] = (root, type(root))  # the root's class stays: its hooks on the user's modules go
    with torch.no_grad():  # FSDP2 moves what it manages; the LightningModule's own tensors are not under root
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            # meta (init_module(empty_init=True)): allocated (zeros: no reset_parameters covers the module's own
            # tensors, which Lightning's materialisation leaves uninitialised); rank 0's reach every rank
            if tensor.is_meta:
                in_place.assign(tensor, torch.zeros_like(tensor, device=mesh.device_type))
            else:
                tensor.data = tensor.data.to(mesh.device_type)
        for p in ignored - set(module.parameters(recurse=False)):  # a child's scalar: FSDP2 moves what it manages only
            if not p.is_meta:
                p.data = p.data.to(mesh.device_type)
    # ddp(find_unused_parameters=True): a parameter without a gradient on this rank (a branch only some ranks
    # take) joins the reduce-scatter with zeros, so every rank sends the same buffers.
    compat.reduce_scatter_unused_params(root)  # torch's own call from 2.13
    gather_root_before_forward(root)
    apply_prefetch(list(blocks), prefetch_depth)  # type: ignore[arg-type]
    for name, block in zip(block_names or (), blocks):
        kept.handles.append(block.register_forward_pre_hook(functools.partial(mark_ran, root.units_ran, name)))
    return root


def shard_in_place(module: nn.Module, prepare: Callable[[nn.Module], tuple[nn.Module, list[tuple[str, nn.Module]]]],
                   mesh: DeviceMesh, device: torch.device, **options: Any) -> ShardedRoot:
    """A sharded stage's root over ``module``'s own children, ``prepare``d (the precision plugin's conversion and
    hooks; it returns the module and its blocks by name) and sharded in place (:func:`shard_module` with
    ``options``); a child built on the meta device (``init_module(empty_init=True)``) is initialised as
    ``ModelParallelStrategy`` does (each submodule's ``reset_parameters`` on its shards). ``self.device`` the root
    device. A failure on the way gives the user's module back (each rank alone), then raises."""
    children = in_place.children_with_tensors(module)
    shard_size = mesh.size()
    in_place.refuse_owner_ties(module, children, shard_size)
    in_place.refuse_parameter_hooks(children, shard_size)
    in_place.refuse_sparse_gradients(children, shard_size)
    module, blocks = prepare(module)  # before the records: a plugin that swaps submodules swaps the user's, as ddp's
    children = in_place.children_with_tensors(module)
    kept = in_place.InPlace(children)
    root: ShardedRoot | None = None
    try:
        root = shard_module(module, kept, [b for _, b in blocks], mesh, block_names=[n for n, _ in blocks], **options)
        kept.handles.extend(compile_in_place(children, shard_size))  # where the user compiled: around the units
        if any(t.is_meta for child in children.values() for t in [*child.parameters(), *child.buffers()]):
            compat.materialize_distributed_module(root, device)
    except BaseException:
        kept.restore_locally(torch.device("cpu"))  # the values from before the stage, exactly
        if root is not None:
            root.remove_owner_hooks()  # hook_lightning_module's, on the LightningModule itself
        raise
    kept.built()
    compat.set_module_device(module, device)  # self.device in the stage: the root device, as under ddp
    return root
