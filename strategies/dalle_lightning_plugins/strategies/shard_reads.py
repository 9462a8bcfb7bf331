"""User code in a step that reads a sharded parameter outside its unit's ``forward`` gets the whole parameter, as
under ``ddp``.

FSDP2 gathers a unit's parameters only around the unit's own ``forward``. Code that reads them elsewhere meets
this rank's shard (a DTensor): a weight penalty in ``training_step`` (``self.fc.weight.pow(2).sum()``), a parent
reading a child's weight without calling it (``MultiheadAttention`` passes ``out_proj.weight`` to
``F.multi_head_attention_forward``; a head tied through ``F.linear(x, self.emb.weight)``), and parameters captured
in a list before the stage (which hold the user's released tensors). During a sharded stage's steps a torch
function mode (:class:`ShardReads`, entered around ``training_step``/``validation_step``) hands such a call the
whole parameter instead: gathered over the node (:class:`GatherForRead`, differentiable), its gradient averaged
over the node and added to the shard's, which is what ``ddp``'s average of the same term gives. A user's own
parameter captured before the stage reads FSDP2's parameter in its place.

Outside those steps, in the LightningModule's and the callbacks' ``on_*`` hooks (``on_after_backward``,
``on_train_batch_end``), a weight or gradient stays this rank's shard: a host read of a value computed from one
(``float(self.fc.weight.norm())``, this rank's part under ``ddp``'s name) is refused in one line naming it and
``.full_tensor()`` (:class:`HookReads`). A gather there would hang a hook only rank 0 runs.

The mode looks only at a call's arguments (one level, and the lists of ``foreach`` calls): a step that reads no
sharded parameter outside a unit costs a type check per argument. Each read is one all-gather over the node, so
every rank of the node must make it, as every rank runs the same ``training_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.overrides import TorchFunctionMode

from dalle_lightning_plugins import compat


class GatherForRead(torch.autograd.Function):
    """A sharded parameter whole on every rank of the node; backward: the node's average of the whole gradient,
    reduce-scattered to this rank's shard (so the term's gradient is averaged as ``ddp`` averages it)."""

    @staticmethod
    def forward(ctx: Any, param: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.placements = param.device_mesh, param.placements
        return param.full_tensor()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        partial = DTensor.from_local(grad / ctx.mesh.size(), ctx.mesh, [Partial()] * ctx.mesh.ndim, run_check=False)
        return partial.redistribute(ctx.mesh, ctx.placements)


# Tensor methods that read no values: a shard answers them as the whole parameter would (a DTensor's size is global).
METADATA = frozenset({"size", "dim", "ndimension", "stride", "numel", "nelement", "element_size", "is_floating_point",
                      "is_complex", "is_contiguous", "storage_offset", "data_ptr", "untyped_storage", "get_device",
                      "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "to_local",
                      "full_tensor", "redistribute"})


def is_sharded_parameter(value: Any) -> bool:
    """FSDP2's sharded parameters are DTensors marked as parameters (gradients and activations are not)."""
    return type(value) is DTensor and isinstance(value, nn.Parameter)


class ShardReads(TorchFunctionMode):
    """Whole parameters for torch calls that receive a sharded one (see the module). ``current_of`` maps the id of
    a user's released parameter to a function returning FSDP2's parameter that holds its values now."""

    def __init__(self, current_of: dict[int, Callable[[], torch.Tensor]] | None) -> None:
        super().__init__()
        self.current_of = current_of
        self.paused = 0  # an optimizer step or a backward inside the step (manual optimization) reads the shards
        self.read: set[int] = set()  # sharded parameters read whole with autograd on since the last backward
        self.entered = 0  # how deep in reading() or pause(): pushed on the mode stack at the outermost only
        self.popped: list[bool] = []  # per unit entered: whether the mode left the stack there

    def _whole(self, value: Any) -> Any:
        if type(value) is nn.Parameter or type(value) is torch.Tensor:
            find = self.current_of.get(id(value)) if self.current_of else None
            if find is None:
                return value
            value = find()
        if is_sharded_parameter(value):
            if torch.is_grad_enabled() and value.requires_grad:
                self.read.add(id(value))  # a gradient comes, even where the unit itself never ran
            return GatherForRead.apply(value)
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or self.paused:  # dynamo traces an active mode: first, so no guard on paused
            # (a unit's own forward, whose parameters are whole there) it adds nothing to the graph, which is ddp's
            return func(*args, **kwargs)
        if not any(map(self._to_read, args)) and not any(map(self._to_read, kwargs.values())):
            return func(*args, **kwargs)  # the common case: one type check (and a lookup) per argument
        name = getattr(func, "__name__", "")
        if name in METADATA or name.startswith("__") or name.endswith("_"):
            # no values read (``p.grad``, ``p.shape``, ``hash(p)``), or written in place on the shard (``p.clamp_``)
            return func(*args, **kwargs)
        args = tuple(self._whole_or_list(a) for a in args)
        kwargs = {k: self._whole_or_list(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _to_read(self, value: Any) -> bool:
        kind = type(value)
        if kind is DTensor:
            return is_sharded_parameter(value)
        if kind is nn.Parameter or kind is torch.Tensor:
            return bool(self.current_of) and id(value) in self.current_of
        if kind is list or kind is tuple:
            return any(map(self._to_read, value))
        return False

    def unit_hooks(self, units: list[nn.Module]) -> list[Any]:
        """No whole reads inside a unit's own ``forward`` (its parameters are whole there): the mode costs a step
        only the calls outside the units. ``units``: the FSDP2 units with no unit inside. Returns the handles."""
        return [handle for unit in units for handle in (unit.register_forward_pre_hook(self._enter_unit),
                                                        unit.register_forward_hook(self._leave_unit, always_call=True))]

    def _enter_unit(self, *_: Any) -> None:
        # Off the mode stack inside a unit, so a compiled region there meets the stack it meets without the
        # strategy (dynamo guards on it; a checkpointed recomputation in the backward meets the same).
        popped = compat.top_function_mode() is self
        if popped:
            self.__exit__(None, None, None)
        self.popped.append(popped)
        self.paused += 1

    def _leave_unit(self, *_: Any) -> None:
        self.paused = max(0, self.paused - 1)
        if self.popped and self.popped.pop():
            self.__enter__()

    @contextmanager
    def _on_stack(self) -> Generator[None, None, None]:
        """On the torch function mode stack once, however nested: dynamo guards on the stack's types."""
        if self.entered:
            yield
            return
        self.entered += 1
        try:
            with self:
                yield
        finally:
            self.entered -= 1

    @contextmanager
    def reading(self) -> Generator[None, None, None]:
        """Whole reads for a step, even one an optimizer step runs (its closure, under automatic optimization)."""
        paused, self.paused = self.paused, 0
        try:
            with self._on_stack():
                yield
        finally:
            self.paused = paused

    @contextmanager
    def pause(self) -> Generator[None, None, None]:
        """The shards themselves for a while: an optimizer's step, or a backward, run inside ``training_step``. The
        mode stays on the stack (paused), so a checkpointed region recomputed in the backward meets the modes its
        forward met, and compiles nothing more."""
        self.paused += 1
        try:
            with self._on_stack():
                yield
        finally:
            self.paused -= 1

    def _whole_or_list(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return type(value)(self._whole(v) for v in value)
        return self._whole(value)


def lightning_hooks(base: type) -> list[str]:
    """The ``on_*`` hooks ``base`` (``LightningModule`` or ``Callback``) defines: outside ``training_step`` and
    ``validation_step`` each rank holds its shard of every parameter and gradient there (a DTensor)."""
    return sorted(n for n in dir(base) if n.startswith("on_") and callable(getattr(base, n, None)))


# Reads that leave DTensor's semantics: a value on the host, or a plain tensor made from DTensors.
HOST_READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "tensor",
                        "as_tensor"})


class HookReads(TorchFunctionMode):
    """One line, naming the parameter, where a hook leaves DTensor's semantics with a value computed from a shard:
    a host read of a value that is not whole (``float(p.grad.norm())`` would be this rank's part, silently), or a
    plain tensor made from DTensors (Lightning's ``grad_norm``). DTensor's own arithmetic (``.clone()``,
    ``.norm()``, ``.full_tensor()``, writes in place), ``self.log(..., sync_dist=True)`` and the strategy's
    collectives on such values (``dtensor_collectives``) pass, as do a user's own DTensors (only the stage's
    parameters and gradients, and values computed from them, are followed)."""

    def __init__(self, owner: str, hook: str, module: nn.Module) -> None:
        super().__init__()
        self.owner, self.hook, self.module = owner, hook, module
        self.sources: dict[int, str] | None = None  # the stage's tensors, by their local storage
        self.derived: dict[int, tuple[str, Any]] = {}  # id of a DTensor computed here -> (its source, the value)

    def _source(self, value: Any) -> str | None:
        if not isinstance(value, DTensor):
            return None
        if id(value) in self.derived:
            return self.derived[id(value)][0]
        if self.sources is None:
            self.sources = {}
            for name, p in self.module.named_parameters():
                for tensor, label in ((p, name), (p.grad, f"{name}.grad")):
                    if isinstance(tensor, DTensor):
                        self.sources[compat.local_tensor(tensor).data_ptr()] = label
        return self.sources.get(compat.local_tensor(value).data_ptr())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat = [i for v in (*args, *kwargs.values()) for i in (v if isinstance(v, (list, tuple)) else (v,))]
        source = next((s for s in map(self._source, flat) if s is not None), None)
        if source is not None:
            whole = all(isinstance(i, DTensor) and all(pl.is_replicate() for pl in i.placements)
                        for i in flat if isinstance(i, DTensor))
            if name in HOST_READS and not whole:
                raise RuntimeError(self.line(source))
        result = func(*args, **kwargs)
        if source is not None and isinstance(result, DTensor) and name != "__get__":  # ``p.grad``: found by storage
            self.derived[id(result)] = (source, result)  # the value is kept so that its id stays its own
        return result

    def line(self, source: str) -> str:
        return (f"{self.owner}: {self.hook} computes with {source}, which holds this rank's shard in a sharded "
                f"stage (a DTensor), so the value is not ddp's; read .full_tensor() for ddp's whole tensor (a "
                f"collective: every rank of the node calls it), or use devices_per_node=1")


class GuardedHook:
    """A removable handle: ``obj.<hook>`` runs under :class:`HookReads` until :meth:`remove` (the stage's end)."""

    def __init__(self, obj: Any, hook: str, owner: str, module: nn.Module) -> None:
        self.obj, self.hook = obj, hook
        self.previous = obj.__dict__.get(hook, _ABSENT)
        original = getattr(obj, hook)
        label = hook if obj is module else f"{type(obj).__name__}.{hook}"

        def guarded(*args: Any, **kwargs: Any) -> Any:
            with HookReads(owner, label, module):
                return original(*args, **kwargs)

        obj.__dict__[hook] = guarded

    def remove(self) -> None:
        if self.previous is _ABSENT:
            self.obj.__dict__.pop(self.hook, None)
        else:
            self.obj.__dict__[self.hook] = self.previous


_ABSENT = object()


def guard_hooks(module: Any, owner: str) -> list[GuardedHook]:
    """Guard the hooks the LightningModule and the Trainer's callbacks override, for a sharded stage: a weight or a
    gradient read in ``on_train_batch_end`` or ``on_after_backward`` is a shard there."""
    from lightning.pytorch import Callback, LightningModule

    try:
        callbacks = list(module.trainer.callbacks)
    except RuntimeError:  # not attached to a Trainer: the module's own hooks only
        callbacks = []
    guarded = []
    for obj, base in ((module, LightningModule), *((c, Callback) for c in callbacks)):
        for hook in lightning_hooks(base):
            if getattr(type(obj), hook, None) is not getattr(base, hook, None):
                guarded.append(GuardedHook(obj, hook, owner, module))
    return guarded
