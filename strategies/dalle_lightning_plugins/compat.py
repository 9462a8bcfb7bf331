"""Every private torch or Lightning name the plugins need, and what differs between the torch releases they support
(2.9 to 2.14), each behind one function of this module.

The second half of the module holds the private names themselves (Lightning's meta-module materialisation, its
process-group connection and ``reduce``, its launcher, ``LightningModule._device_mesh``, ``Precision._after_closure``,
a ``GradScaler``'s found-Inf record, FSDP2's root pre-backward hook, DTensor's op-handler table, an op's schema,
the trainer a module is attached to, pytree's map, dynamo's config, the fused unscale-and-check kernel, a process
group's timeout option, a DTensor's local tensor): one place to look when a release renames one, each function saying
why it is needed and tested in ``tests/test_compat.py`` against a value worked out by hand. The first half:

The plugins require ``torch>=2.9`` (``strategies/pyproject.toml`` says why that is the floor: the newest public
API they call, ``init_device_mesh(backend_override=)``). Where a torch API the strategy calls is newer than the
floor, or a private FSDP2 name moved between releases, the call goes through a function here: it uses torch's own
API where the installed release has it, and a fallback with the same effect where it does not. Each fallback is
tested on every release (``tests/test_compat.py`` forces it on the newest torch too, and compares both with
a reference computed by hand), and every private name a function here reaches is checked on every tested release
by ``tests/test_lightning_internals.py``. CI runs both files on the oldest supported torch (``make test-oldest``).

| need | torch's own API | fallback (older releases) |
| --- | --- | --- |
| parameters no rank used join FSDP2's reduce-scatter | ``FSDPModule.set_reduce_scatter_unused_params`` (2.13) | :func:`reduce_scatter_unused_params` |
| an FSDP2 unit's parameter groups | ``FSDPState._fsdp_param_groups`` (2.13, per-parameter meshes) | ``FSDPState._fsdp_param_group`` (one group) |
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "HAS_REDUCE_SCATTER_UNUSED_PARAMS",
    "TORCH_VERSION",
    "after_closure",
    "amp_unscale_and_check",
    "attached_trainer",
    "averaged_model",
    "compile_config",
    "compiled_call",
    "default_store",
    "dtensor_op_handlers",
    "dynamo_config",
    "fsdp_param_groups",
    "init_dist_connection",
    "mark_scaler_overflow",
    "materialize_distributed_module",
    "materialize_meta_tensors",
    "op_argument",
    "process_group_backend",
    "recomputation_stop_errors",
    "strategy_timeout",
    "optimizers_to_device",
    "reduce_scatter_unused_params",
    "register_root_pre_backward",
    "gloo_options",
    "set_group_timeout",
    "set_module_device_mesh",
    "subprocess_script_launcher",
    "sync_ddp_if_available",
    "tensor_hook_count",
    "torch_version",
    "tree_map",
    "undo_fully_shard",
]


def torch_version(version: str = torch.__version__) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"`` -> ``(2, 11)``), for messages and tests;
    the shims below test for the API itself, never for a version number."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = torch_version()

# 2.13 added it (FSDP2's counterpart of ddp's find_unused_parameters).
HAS_REDUCE_SCATTER_UNUSED_PARAMS: bool = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def fsdp_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one FSDP2 unit's state (``unit._get_fsdp_state()``).

    torch 2.13 lets one ``fully_shard`` call hold several groups (one per mesh) in ``_fsdp_param_groups``; 2.9
    to 2.12 hold at most one, in ``_fsdp_param_group`` (None for a unit that manages no parameter). 2.13 keeps
    the singular name as a property, valid only with one group, so the plural is asked first."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def reduce_scatter_unused_params(root: nn.Module, *, native: bool | None = None) -> None:
    """Every FSDP2 unit under ``root`` reduce-scatters zeros for a parameter that got no gradient on this rank.

    ``ddp(find_unused_parameters=True)``'s rule for FSDP2: when a branch runs on some ranks only, the ranks that
    skipped it must still send the same buffers, or the reduce-scatters of the node mismatch (a hang, or the
    wrong gradients mixed). torch 2.13 and later do it with ``FSDPModule.set_reduce_scatter_unused_params(True)``
    (``native=None`` picks it where present). Older releases get the same rule by wrapping each parameter
    group's ``post_backward``: a parameter that needs a gradient and has neither a gradient nor an accumulated
    one gets a zero gradient just before FSDP2 collects the gradients, which is where 2.13 adds its zeros, so
    both reduce-scatter the same buffers (``native=False`` forces this path, for the tests on newer releases).
    """
    if native is None:
        native = HAS_REDUCE_SCATTER_UNUSED_PARAMS
    if native:
        root.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
        return
    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module._get_fsdp_state()):  # type: ignore[operator]
                if not getattr(group, "_zero_fills_unused", False):
                    group.post_backward = functools.partial(_post_backward_with_zeros, group, group.post_backward)
                    group._zero_fills_unused = True


def _post_backward_with_zeros(group: Any, post_backward: Any, *args: Any) -> Any:
    """``FSDPParamGroup.post_backward`` after giving each unused parameter a zero gradient (see
    :func:`reduce_scatter_unused_params`). Only when this backward reduces gradients (``reduce_grads``): under
    ``set_requires_gradient_sync(False)`` FSDP2 only accumulates, and 2.13 adds no zeros there either."""
    if group.reduce_grads:
        for fsdp_param in group.fsdp_params:
            if not hasattr(fsdp_param, "_unsharded_param"):  # never gathered: FSDP2 skips it too
                continue
            param = fsdp_param.unsharded_param
            if param.requires_grad and param.grad is None and fsdp_param.unsharded_accumulated_grad is None:
                param.grad = torch.zeros_like(param)
    return post_backward(*args)


# ---------------------------------------------------------------------------------------------------------------
# Private names of Lightning and torch the plugins still need, each behind one function here (tests/test_compat.py
# runs every one against a reference; tests/test_lightning_internals.py checks the names exist on every tested
# release). Why each is needed is said where it is used and in docs/plugins.md ("What the plugins rely on").


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Lightning's materialisation of a module built under ``init_module(empty_init=True)`` (meta tensors) after
    FSDP2 sharded it: each submodule's ``reset_parameters`` on its shards, as ``ModelParallelStrategy`` does."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def materialize_meta_tensors(module: nn.Module, device: torch.device) -> None:
    """The same for a module that is not sharded (``devices_per_node=1``)."""
    from lightning.fabric.utilities.init import _materialize_meta_tensors

    _materialize_meta_tensors(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Every optimizer's state tensors onto ``device``, as Lightning's strategies move them after setup."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """The default process group from a cluster environment (its address, port, rank and world size), or nothing
    if one exists: Lightning's own for every strategy, so a run starts as under ``ddp``."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """``ddp``'s ``strategy.reduce``: Lightning's all-reduce with its "mean"/"sum"/ReduceOp names and dtypes."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def subprocess_script_launcher(cluster_environment: Any, num_processes: int, num_nodes: int) -> Any:
    """Lightning's launcher that starts the other ranks by running the script again, as ``strategy="ddp"`` does."""
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (a read-only property over ``_device_mesh``, which Lightning's
    own strategies set), so ``configure_model`` can read the strategy's mesh."""
    module._device_mesh = mesh


def after_closure(precision: Any, model: Any, optimizer: Any) -> None:
    """Lightning's ``Precision._after_closure``: ``on_before_optimizer_step`` and gradient clipping, which a
    precision plugin runs between the closure and the optimizer's step."""
    precision._after_closure(model, optimizer)


def mark_scaler_overflow(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
    """Record a non-finite gradient for ``optimizer`` in a ``GradScaler`` already unscaled for it, so its
    ``step`` skips and ``update`` backs the scale off (``GradScaler`` has no public way to add a found Inf)."""
    for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found_inf.fill_(1.0)


def register_root_pre_backward(root: FSDPModule, loss: torch.Tensor) -> None:
    """FSDP2's own pre-backward hook of ``root`` on ``loss``, which its root forward registers: a loss from a
    forward outside the root's then still reduce-scatters the root unit's gradients."""
    root._get_fsdp_state()._register_pre_backward_hook(loss)  # type: ignore[operator]


def dtensor_op_handlers() -> dict[Any, Any]:
    """DTensor's table of custom op handlers (op -> ``handler(op, args, kwargs)``), consulted before sharding
    propagation; torch's own ``loss_parallel`` adds and removes entries in it the same way."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher._custom_op_handlers  # type: ignore[attr-defined]


def op_argument(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` among ``op``'s schema arguments in a call, its default when not
    passed, or None when the op has no such argument (``async_op``, named ``asyncOp`` by some releases)."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name in names:
            if argument.name in kwargs:
                return kwargs[argument.name]
            if index < len(args):
                return args[index]
            return argument.default_value if argument.has_default_value() else None
    return None


def averaged_model(callback: Any) -> Any:
    """The ``AveragedModel`` of a Lightning ``WeightAveraging`` callback (``EMAWeightAveraging`` too), None for any
    other callback or before its ``setup``: the strategy shards it as the module for a fit (it has no public name)."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # a Lightning release before the callback
        return None
    return callback._average_model if isinstance(callback, WeightAveraging) else None


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None: ``LightningModule.trainer`` raises when there is none,
    and a precision plugin also runs on modules outside a fit (its own tests, a user's loop)."""
    return getattr(module, "_trainer", None)


def strategy_timeout(strategy: Any) -> Any:
    """The collective timeout a Lightning strategy gives its process groups (``DDPStrategy(timeout=...)``, the
    plugins' strategies), or None for one that has none: the elastic restart path makes the default group with it
    before the strategy would (``_timeout`` has no public name)."""
    return getattr(strategy, "_timeout", None)


def recomputation_stop_errors() -> tuple[type[BaseException], ...]:
    """What non-reentrant activation checkpointing raises to stop a recomputed forward early, as control flow
    (``torch.utils.checkpoint._StopRecomputationError``); empty where a release has none."""
    import torch.utils.checkpoint

    found = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    return (found,) if isinstance(found, type) and issubclass(found, BaseException) else ()


def compiled_call(module: nn.Module) -> Any:
    """The compiled call ``module.compile(...)`` set (``nn.Module._compiled_call_impl``), or None: none set, or a
    compile with ``disable=True`` (the module's own call, eager). A sharded stage sets it aside and compiles around
    FSDP2's units with the same configuration (:func:`compile_config`), whose hooks dynamo does not trace."""
    call = getattr(module, "_compiled_call_impl", None)
    return None if getattr(call, "__self__", None) is module else call


def compile_config(module: nn.Module) -> Any:
    """The ``torch.compile`` configuration behind ``module.compile(...)`` (backend, ``fullgraph``, ``dynamic``,
    ``mode``, ``options`` in one object, dynamo's ``_TorchDynamoContext``), or None where the module is not compiled
    or this torch does not show it. torch has no public way to read a compile's arguments back; the wrapper
    ``torch.compile`` returns holds the context in its closure, as ``self``. Applied to a callable
    (a module's ``_call_impl`` or ``forward``) it compiles it as ``module.compile(...)`` compiled ``module``'s
    call."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    compiled = compiled_call(module)
    code, closure = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None) or ()
    cells = dict(zip(code.co_freevars, closure)) if code is not None else {}
    try:
        context = cells["self"].cell_contents
    except (KeyError, ValueError):  # no such cell, or an empty one
        return None
    own_call = getattr(inspect.unwrap(compiled), "__self__", None) is module  # Module.compile() wrapped its call
    return context if own_call and isinstance(context, _TorchDynamoContext) else None


def set_module_device(module: Any, device: Any) -> None:
    """What ``LightningModule.device`` returns (``DeviceDtypeModuleMixin._device``, set by its ``to``): the stage's
    root device while the module's children are sharded in place, which ``to`` cannot move whole."""
    module._device = device


def tree_map(fn: Any, tree: Any) -> Any:
    """torch's pytree map (``torch.utils._pytree``: a block's outputs may be any nesting of tensors, and torch's own
    tree utilities know its containers, named tuples included)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def dynamo_config() -> Any:
    """dynamo's configuration module, whose ``recompile_limit`` and ``fail_on_recompile_limit_hit`` the fused
    boundary kernels set around their call (``torch.compiler`` has no public name for either)."""
    import torch._dynamo

    return torch._dynamo.config


def amp_unscale_and_check(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``GradScaler``'s fused kernel: multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1 where
    any value is non-finite, in one pass over a list of tensors (there is no public op for it)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def set_group_timeout(options: Any, timeout: Any) -> Any:
    """A process-group options object carrying ``timeout`` (gloo's options class is ``ProcessGroupGloo._Options``
    and its timeout field ``_timeout``; NCCL's shares the field): sub-groups of a mesh otherwise get the library's
    30-minute default. Returns ``options``."""
    options._timeout = timeout
    return options


def gloo_options() -> Any:
    """A new gloo process-group options object (the class is private to torch's bindings)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]


def process_group_backend(strategy: Any) -> str:
    """The backend a Lightning strategy will give its process group (``ddp``'s and the plugins' strategies answer
    with ``_get_process_group_backend``: the one passed, else gloo on CPU, nccl on CUDA)."""
    return strategy._get_process_group_backend()


def default_store() -> Any:
    """The default process group's key-value store (``torch.distributed``'s rendezvous store, which every rank
    reaches without a collective), or None where there is none: the teardown after an error asks it which ranks of a
    node are still there (:mod:`~dalle_lightning_plugins.strategies.roll_call`); ``torch.distributed`` has no public
    name for it."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def tensor_hook_count(tensor: Any) -> int:
    """How many gradient hooks a user put on ``tensor`` (``Tensor.register_hook``: ``_backward_hooks``;
    ``register_post_accumulate_grad_hook``: ``_post_accumulate_grad_hooks``); torch shows neither publicly. A
    sharded stage refuses a child's parameter that has any: FSDP2's parameter in its place would train without them."""
    hooks = [getattr(tensor, "_backward_hooks", None), getattr(tensor, "_post_accumulate_grad_hooks", None)]
    return sum(len(h) for h in hooks if h)


def local_tensor(value: Any) -> torch.Tensor:
    """A DTensor's local tensor without ``to_local()``'s autograd function (about 7 us a call, 40 times the
    attribute's cost): the hook guard (``strategies/shard_reads.py``) finds each DTensor a user's hook touches by its
    storage, among every parameter and gradient. ``to_local()`` where a release has no ``_local_tensor``."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value.to_local()


def top_function_mode() -> Any:
    """The innermost torch function mode active now (None without one)."""
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    return stack[-1] if stack else None


def undo_fully_shard(module: nn.Module, cls: type) -> Any:
    """``fully_shard``'s marks taken off ``module`` (an FSDP2 unit, or a module one manages), so that a user's module is
    plain again: its class back to ``cls`` (the one it had before ``fully_shard``), FSDP2's forward pre/post hooks
    removed, the state-dict hooks its unit put on the modules owning its parameters removed, and the entries
    ``fully_shard`` put in its ``__dict__`` removed. Its parameters are the caller's (the user's own objects, set
    back beforehand). Returns a function putting all of it back (a checkpoint saved after the stage shards the module
    again; no collective).

    Relies on torch internals (2.14): ``torch.distributed._composable.contract``'s ``STATE_KEY`` and ``REGISTRY_KEY``
    (``module.__dict__`` entries holding the ``fully_shard`` state and its registry),
    ``torch.distributed._composable_state._module_state_mapping`` (module -> weakref of its ``FSDPState``),
    ``FSDPState._pre_forward_hook_handle``/``_post_forward_hook_handle`` and its ``_pre_forward``/``_post_forward``
    (registered as ``FSDPState.init`` does), ``FSDPParam._post_load_hook_handle`` and ``reset_sharded_param`` (a
    load-state-dict post-hook per parameter), ``FSDPParamGroup._module_to_pre_save_state_dict_hook_handle``/
    ``_module_to_pre_load_state_dict_hook_handle`` and ``_register_state_dict_hooks`` (registered at lazy init), and
    the ``_is_fsdp_managed_module``/``_fsdp_use_orig_params`` flags ``fully_shard`` sets on each managed module."""
    import weakref

    from torch.distributed import _composable_state
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    flags = {k: module.__dict__.pop(k) for k in ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
             if k in module.__dict__}
    saved = {k: module.__dict__.pop(k) for k in (STATE_KEY, REGISTRY_KEY) if k in module.__dict__}
    sharded_cls = type(module)
    state = _composable_state._module_state_mapping.pop(module, None) if isinstance(module, FSDPModule) else None
    state = state() if state is not None else None
    groups = fsdp_param_groups(state) if state is not None else []
    state_dict_hooks = [bool(g._module_to_pre_save_state_dict_hook_handle) for g in groups]
    if state is not None:
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
    for group in groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param._post_load_hook_handle.remove()
        for handles in (group._module_to_pre_save_state_dict_hook_handle,
                        group._module_to_pre_load_state_dict_hook_handle):
            for handle in handles.values():
                handle.remove()
            handles.clear()
    module.__class__ = cls

    def redo() -> None:
        module.__dict__.update(flags)
        module.__dict__.update(saved)
        module.__class__ = sharded_cls
        if state is not None:
            _composable_state._module_state_mapping[module] = weakref.ref(state)
            state._pre_forward_hook_handle = module.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                              with_kwargs=True)
            state._post_forward_hook_handle = module.register_forward_hook(state._post_forward, prepend=False)
        for group, hooked in zip(groups, state_dict_hooks):
            for fsdp_param in group.fsdp_params:
                fsdp_param._post_load_hook_handle = fsdp_param._module_info.module.register_load_state_dict_post_hook(
                    functools.partial(_reset_sharded_param, fsdp_param))
            if hooked:
                group._register_state_dict_hooks()

    return redo


def _reset_sharded_param(fsdp_param: Any, *_: Any, **__: Any) -> None:
    fsdp_param.reset_sharded_param()
