"""Stand-ins of the LightningModule's children for a sharded stage, made without a whole copy of the model.

``fully_shard`` changes the class of each module it shards, registers hooks on it and marks the modules it manages,
with no public undo; so FSDP2 shards stand-ins, and the user's children come back after the stage with their own
classes, hooks and parameter objects. The stand-ins cost no whole copy: they are deep copies whose every parameter
and buffer is a meta-device twin (one memo for all the children, so weights tied between children stay tied), FSDP2
shards them on the meta device, each rank allocates only its own shards (``to_empty``) and fills them from the
user's tensors (a slice, no collective), and then the user's tensors give their storage back (``param.data`` an
empty tensor of the same dtype and device: the parameter object and its ``requires_grad`` stay). At the end of the
stage each is given back whole, one tensor at a time (:func:`give_back`, a collective); after an error, when a peer
may be gone, each rank puts its children back alone (:func:`restore_locally`).

Every user tensor gives its storage back, on the CPU too: a model built on the CPU for a stage on GPUs would
otherwise keep a whole host copy per rank for the fit (8 copies on a node of 8), where ``ddp`` moves it.

What would meet a released tensor is refused in one line: a child held in a plain attribute of the module
(``self.taps = [self.enc[0]]``, at setup, before anything is sharded), a forward through a user's child during the
stage (a reference taken before it that no scan sees, a closure), and a parameter the LightningModule registers itself and a
child holds too (``self.head_w = self.enc[0].weight``: FSDP2 would shard one and leave the other). Parameter groups
built before the stage from the children's parameters are handed the stand-ins' (:func:`remap_optimizers`).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.hooks import RemovableHandle

from dalle_lightning_plugins import compat


@dataclass
class Released:
    """A user tensor whose values the stage holds in shards: what giving it back needs."""

    tensor: torch.Tensor
    shape: torch.Size
    channels_last: bool


def _named_tensors(module: nn.Module, remove_duplicate: bool = True) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=remove_duplicate),
            *module.named_buffers(remove_duplicate=remove_duplicate)]


def _children_with_tensors(module: nn.Module) -> dict[str, nn.Module]:
    return {name: child for name, child in module.named_children()
            if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None}


def _meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    twin = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
        twin.__dict__.update(tensor.__dict__)  # a user's marks on the parameter (``p.no_decay = True``)
    return twin


def refuse_owner_ties(module: nn.Module, originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything trains: a tensor the LightningModule registers itself and a child holds too would
    be two tensors in a sharded stage (the child's stand-in sharded, the module's own whole)."""
    held: dict[int, str] = {}
    for name, child in originals.items():
        for sub, t in _named_tensors(child, remove_duplicate=False):
            held.setdefault(id(t), f"{name}.{sub}")
    for own, tensor in _named_tensors(module, remove_duplicate=False):
        if "." not in own and id(tensor) in held:
            raise ValueError(
                f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {type(module).__name__}.{own} is "
                f"{held[id(tensor)]} (one tensor registered on the LightningModule and in a child), which FSDP2 "
                f"would shard in the child and leave whole on the module; reach it through the child "
                f"(self.{held[id(tensor)]}) or a property, or use devices_per_node=1")


def refuse_parameter_hooks(originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything trains: a gradient hook on a child's parameter (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``), which ``ddp`` runs on every backward, would never run in a sharded
    stage, without a word: the stand-ins train, and FSDP2 reduce-scatters their gradients and sets them without
    autograd's hooks. The LightningModule's own parameters stay whole and keep theirs."""
    for child_name, child in originals.items():
        for name, p in child.named_parameters():
            if compat.tensor_hook_count(p):
                raise ValueError(
                    f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {child_name}.{name} has a gradient hook "
                    "(Tensor.register_hook or register_post_accumulate_grad_hook), which a sharded stage never runs: "
                    "FSDP2 trains sharded copies of the children; use a module hook (register_full_backward_hook) "
                    "or the optimizer, or devices_per_node=1")


def refuse_sparse_gradients(originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything is sharded: an embedding with ``sparse=True`` makes a sparse gradient, which FSDP2
    cannot reduce-scatter (``ddp`` all-reduces it as it is)."""
    for child_name, child in originals.items():
        for sub, m in child.named_modules():
            if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                raise ValueError(
                    f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {f'{child_name}.{sub}'.rstrip('.')} is "
                    f"an {type(m).__name__} with sparse=True, whose sparse gradient FSDP2 cannot shard; use "
                    "sparse=False (the optimizer then gets a dense gradient) or strategy='ddp'")


# nn.Module's own state in every instance's __dict__ (its registered children, parameters, buffers, hook tables).
_MODULE_STATE = frozenset(vars(nn.Module()))


def refuse_listed_children(module: nn.Module, originals: dict[str, nn.Module], shard_size: int) -> None:
    """One line before anything is sharded: a plain attribute of the LightningModule (a list, tuple or dict, one level
    deep) that holds one of its children's modules, as ``self.taps = [self.enc[0]]``, would reach the user's own
    module during the stage, whose values the stand-ins hold. Found here, the refusal leaves every weight as it was;
    a reference this scan cannot see (a closure, another object) meets :func:`guard_originals` instead."""
    inside: dict[int, str] = {}
    for child_name, child in originals.items():
        for sub, m in child.named_modules():
            inside.setdefault(id(m), f"{child_name}.{sub}".rstrip("."))
    for attr, value in vars(module).items():
        if attr in _MODULE_STATE:
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        found = next((inside[id(item)] for item in items if isinstance(item, nn.Module) and id(item) in inside), None)
        if found is not None:
            raise ValueError(
                f"ShardedPowerSGDStrategy(devices_per_node={shard_size}): {type(module).__name__}.{attr} holds the "
                f"child {found} outside the module's registered children, which would run the user's own module, "
                f"not its sharded stand-in; register it (nn.ModuleList) or reach it through the module "
                f"(self.{found}), or use devices_per_node=1")


def make_stand_ins(module: nn.Module, shard_size: int = 2) -> dict[str, nn.Module]:
    """Give ``module`` meta-device stand-ins of its children that hold parameters or buffers (one ``deepcopy`` whose
    memo maps every tensor to a meta twin: no whole copy, ties kept); return the user's own children by name.

    The LightningModule and its Trainer are not copied (a child may refer to them). ``deepcopy`` drops the compiled
    call of a module compiled with ``Module.compile()``: once the stand-ins are sharded,
    :func:`~dalle_lightning_plugins.strategies.compiled_stand_ins.compile_stand_ins` compiles them again."""
    originals = _children_with_tensors(module)
    refuse_owner_ties(module, originals, shard_size)
    refuse_listed_children(module, originals, shard_size)
    refuse_parameter_hooks(originals, shard_size)
    refuse_sparse_gradients(originals, shard_size)
    memo: dict[int, Any] = {id(module): module}
    trainer = compat.attached_trainer(module)
    if trainer is not None:
        memo[id(trainer)] = trainer
    for child in originals.values():
        for _, tensor in _named_tensors(child, remove_duplicate=False):
            if id(tensor) not in memo:
                memo[id(tensor)] = _meta_twin(tensor)
    for name, stand_in in copy.deepcopy(originals, memo).items():
        setattr(module, name, stand_in)
    return originals


def put_back(module: nn.Module, originals: dict[str, nn.Module]) -> None:
    """The user's own children in ``module`` again (no values move)."""
    for name, original in originals.items():
        setattr(module, name, original)


def local_slice(whole: torch.Tensor, value: DTensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``value`` (a DTensor of the same global shape) holds it: a view for FSDP2's
    ``Shard(dim)`` on a 1-D mesh, else DTensor's own local split (no collective either way)."""
    mesh = value.device_mesh
    if mesh.ndim == 1 and len(value.placements) == 1 and isinstance(value.placements[0], Shard):
        dim = value.placements[0].dim
        chunks = torch.chunk(whole, mesh.size(), dim=dim)
        rank = mesh.get_local_rank()
        part = chunks[rank] if rank < len(chunks) else whole.narrow(dim, 0, 0)
        if part.shape == value.to_local().shape:
            return part
    return distribute_tensor(whole.detach().to(value.device), mesh, value.placements, src_data_rank=None).to_local()


def _user_tensor(originals: dict[str, nn.Module], name: str, parameter: bool) -> torch.Tensor:
    child, _, rest = name.partition(".")
    owner = originals[child]
    return owner.get_parameter(rest) if parameter else owner.get_buffer(rest)


@torch.no_grad()
def fill_shards(root: nn.Module, originals: dict[str, nn.Module]) -> None:
    """Each stand-in tensor of ``root`` (allocated, this rank's shards only) takes the user's values: its slice of
    each whole tensor, in the stand-in's dtype (``"16-true"``). A user tensor on the meta device
    (``init_module(empty_init=True)``) leaves what its module's ``reset_parameters`` made."""
    for name, value in _named_tensors(root):
        source = _user_tensor(originals, name, isinstance(value, nn.Parameter))
        if source.is_meta:
            continue
        if isinstance(value, DTensor):
            value.to_local().copy_(local_slice(source, value))
        else:
            value.copy_(source)


@torch.no_grad()
def release(originals: dict[str, nn.Module]) -> dict[str, Released]:
    """Each user tensor's storage back (an empty tensor of its dtype on its device; the object and its
    ``requires_grad`` stay); meta ones stay meta. Returns what giving them back needs, by name."""
    released: dict[str, Released] = {}
    seen: set[int] = set()  # a tensor tied between children: under its first name, as the stand-ins' root names it
    for child_name, child in originals.items():
        for sub, tensor in _named_tensors(child):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            channels_last = tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(
                memory_format=torch.channels_last)
            released[f"{child_name}.{sub}"] = Released(tensor, tensor.shape, channels_last)
            if not tensor.is_meta:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return released


def _refuse_forward(name: str, *_: Any) -> None:
    raise RuntimeError(
        f"forward of the user's {name} during a sharded stage: ShardedPowerSGDStrategy trains sharded stand-ins of "
        "the LightningModule's children, so a reference taken before the stage (a list, a closure) holds no weights "
        f"now; reach it through the module during the stage (self.{name}), or use devices_per_node=1")


def guard_originals(originals: dict[str, nn.Module]) -> list[RemovableHandle]:
    """A forward pre-hook on every module of the user's children, for the stage only, that refuses the forward in
    one line instead of running it on released storage; the handles go at the stage's end."""
    handles, seen = [], set()
    for child_name, child in originals.items():
        for sub, m in child.named_modules():
            if id(m) not in seen:
                seen.add(id(m))
                name = f"{child_name}.{sub}".rstrip(".")
                handles.append(m.register_forward_pre_hook(functools.partial(_refuse_forward, name)))
    return handles


def remap_optimizers(optimizers: list[Any], root: nn.Module | None) -> None:
    """Parameter groups built before the stage from the user's children (in ``__init__`` or ``setup``) take the
    stand-ins' parameters in their place, by identity, so they train as under ``ddp``. A no-op without stand-ins
    in the module (one device per node, a stage on whole weights)."""
    originals = getattr(root, "originals", None)
    if root is None or not originals or any(getattr(root.owner, n) is c for n, c in originals.items()):
        return
    stand_in = {}
    for child_name, child in originals.items():
        for sub, p in child.named_parameters(remove_duplicate=False):
            stand_in[id(p)] = root.get_parameter(f"{child_name}.{sub}")
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer
        for group in optimizer.param_groups:
            group["params"] = [stand_in.get(id(p), p) for p in group["params"]]


def assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` (the user's tensor object, kept) holds ``value`` from now on. A meta tensor cannot take another
    device's storage through ``.data``; ``torch.utils.swap_tensors`` gives it one and keeps the object."""
    if not target.is_meta:
        target.data = value
        return
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
        value.__dict__.update(target.__dict__)
    torch.utils.swap_tensors(target, value)


def _whole_like(entry: Released, dtype: torch.dtype, device: torch.device, fill: float) -> torch.Tensor:
    whole = torch.full(entry.shape, fill if dtype.is_floating_point else 0, dtype=dtype, device=device)
    return whole.contiguous(memory_format=torch.channels_last) if entry.channels_last else whole


@torch.no_grad()
def give_back(root: nn.Module, released: dict[str, Released], device: torch.device | None) -> None:
    """Collective over the shard axis: each user tensor whole again, from the stand-ins, one tensor at a time (the
    peak is one gathered tensor). A released one is allocated anew (on ``device``, else where it was); a kept one
    takes the values in place. A tensor the precision plugin gave another dtype (``"16-true"``) takes that dtype, as
    ``ddp`` leaves it; a parameter the stage froze or unfroze (``BackboneFinetuning``) keeps that ``requires_grad``."""
    originals = root.originals
    for name, value in _named_tensors(root):
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        entry = released.pop(name, None)
        target = entry.tensor if entry is not None else _user_tensor(originals, name, isinstance(value, nn.Parameter))
        target.requires_grad_(value.requires_grad)  # set on the stand-in during the stage (False for a buffer)
        if entry is None and target.dtype == whole.dtype and target.shape == whole.shape:
            target.copy_(whole)
            continue
        where = device if device is not None else (target.device if not target.is_meta else torch.device("cpu"))
        given = whole.detach().to(where, copy=whole is value)
        if entry is not None and entry.channels_last:
            given = given.contiguous(memory_format=torch.channels_last)
        assign(target, given)


@torch.no_grad()
def restore_locally(root: nn.Module, released: dict[str, Released], device: torch.device) -> bool:
    """No collective (after an error a peer may be gone): each released user tensor comes back whole, on ``device``,
    holding this rank's trained shard in its slice and NaN elsewhere (a tensor FSDP2 left whole, a buffer: the
    trained value). Returns whether any was released."""
    any_released = bool(released)
    for name, value in _named_tensors(root):
        _user_tensor(root.originals, name, isinstance(value, nn.Parameter)).requires_grad_(value.requires_grad)
        entry = released.pop(name, None)
        if entry is None:
            continue
        if isinstance(value, DTensor):
            whole = _whole_like(entry, value.dtype, device, float("nan"))
            local_slice(whole, value).copy_(value.to_local())
        else:
            whole = value.detach().to(device, copy=True)
        assign(entry.tensor, whole)
    for entry in released.values():  # a name the stand-ins no longer hold (not expected): shapes at least
        assign(entry.tensor, _whole_like(entry, entry.tensor.dtype, device, float("nan")))
    released.clear()
    return any_released
