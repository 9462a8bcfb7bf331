"""The protocols through which the plugins meet a model and each other.

**Resblocks.** A *resblock* here is a residual branch: a module ``f`` whose output the parent adds to an identity
path, ``x + f(x)``. The sharding strategy makes each one an FSDP unit; the precision plugin gives each one its own
gradient scale. A stranger's model can take part in three ways, tried in this order:

1. explicit module classes and/or fnmatch name patterns (from config), matched against ``named_modules()``;
2. a method ``resblocks()`` on the root module (e.g. a LightningModule) or on the first submodule that has
   one, returning an iterable of ``(qualified_name, module)`` pairs or of modules;
3. nothing found: an error naming the model class and what was expected.

Names are qualified relative to the root module passed in, so they are stable across runs and usable in logs,
configs and state dicts.

**Strategy and precision plugin.** A strategy that transforms gradients between the backward and the update
(``ShardedPowerSGDStrategy`` compresses them between nodes) must see them unscaled, and a skipped step must back
off the right loss scale. A precision plugin that satisfies :class:`UnscalingPrecision` lets it: the strategy
asks it to unscale and flag, reduces, and reports a non-finite result back; the plugin keeps the skip decision.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor, nn
from torch.optim import Optimizer

RESBLOCKS_METHOD = "resblocks"


@runtime_checkable
class UnscalingPrecision(Protocol):
    """What a strategy may ask of a precision plugin that scales gradients (``ResblockScalingPrecision``).

    The strategy calls, once per optimizer step after the final backward and before its own reduction:

    1. ``unscale_and_flag(optimizer)``: divide every gradient by its scale now, agree on non-finite flags across
       all ranks (a collective: every rank must call it), and return True if every gradient is finite. The
       plugin's next ``optimizer_step`` reuses these flags instead of unscaling again.
    2. ``mark_nonfinite()``, only if 1. returned True and the strategy's own reduction then found a non-finite
       value: the coming update is skipped like any overflow outside the blocks (no scale backs off).

    Checked with ``isinstance`` at run time, so a plugin takes part by defining both methods, without
    inheriting from anything here.
    """

    def unscale_and_flag(self, optimizer: Optimizer) -> bool:
        """Unscale all gradients in place, agree on the flags across ranks; True when all are finite."""
        ...

    def mark_nonfinite(self) -> None:
        """Make the coming update a skipped one (after a True from :meth:`unscale_and_flag`)."""
        ...


@runtime_checkable
class GroupUnscalingPrecision(UnscalingPrecision, Protocol):
    """An :class:`UnscalingPrecision` that can also unscale a group of gradients during the backward.

    A strategy that overlaps its exchange with the backward (``ShardedPowerSGDStrategy`` at one device per node)
    calls ``unscale_group(params)`` on each group as soon as its gradients are complete, before sending them, so
    that every group is compressed unscaled; the scales must stay fixed within a step (they change only in the
    optimizer step). The plugin records the group's non-finite flags as ``unscale_and_flag`` would, and that
    later call leaves the groups already unscaled alone (it still agrees on every flag across ranks).
    """

    def unscale_group(self, params: Sequence[Tensor]) -> None:
        """Unscale these parameters' gradients in place now and record their non-finite flags."""
        ...


def _qualify(root: nn.Module, modules: Iterable[object]) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in root.named_modules()}
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for item in modules:
        if isinstance(item, tuple):
            _, mod = item
        else:
            mod = item
        if not isinstance(mod, nn.Module) or id(mod) not in names:
            raise ValueError(f"{RESBLOCKS_METHOD}() returned {type(mod).__name__}, expected submodules of the model")
        if id(mod) not in seen:  # one block applied twice (ALBERT-style sharing) is one unit, under its first name
            seen.add(id(mod))
            out.append((names[id(mod)], mod))
    return out


def find_resblocks(
    root: nn.Module,
    classes: Sequence[type[nn.Module]] | None = None,
    patterns: Sequence[str] | None = None,
) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified_name, module)`` for each resblock of ``root``, in module order.

    Explicit ``classes``/``patterns`` win; otherwise the ``resblocks()`` protocol. Raises ``ValueError``
    when nothing is found, so a misconfigured run fails before it trains in the wrong precision.
    """
    if classes or patterns:
        cls_tuple = tuple(classes or ())
        found = [
            (name, mod)
            for name, mod in root.named_modules()
            if name
            and ((cls_tuple and isinstance(mod, cls_tuple)) or any(fnmatch.fnmatchcase(name, p) for p in patterns or ()))
        ]
        # Keep only outermost matches: a block nested inside another matched block is not a unit of its own.
        outer: list[tuple[str, nn.Module]] = []
        for name, mod in found:
            if not any(name.startswith(o + ".") for o, _ in outer):
                outer.append((name, mod))
        if not outer:
            raise ValueError(
                f"no resblocks in {type(root).__name__} match classes={[c.__name__ for c in cls_tuple]} "
                f"patterns={list(patterns or [])}; expected at least one submodule"
            )
        return outer
    for _, mod in root.named_modules():
        method = getattr(mod, RESBLOCKS_METHOD, None)
        if callable(method):
            blocks = _qualify(root, method())
            if blocks:
                return blocks
    raise ValueError(
        f"{type(root).__name__} declares no resblocks: give module classes or name patterns, "
        f"or define {RESBLOCKS_METHOD}() returning its residual branches"
    )


def blocks_tied_outside(root: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The blocks holding a parameter that a module outside the block holds too (weights tied across blocks, or
    between a block and the rest of the model, as an embedding and its unembedding).

    Such a block cannot be a sharding unit of its own: FSDP2 manages each parameter in exactly one unit. Left out
    of the units, its parameters join the unit that holds the rest of the model, with the tie intact.
    """
    tied: list[str] = []
    for name, block in blocks:
        inside = {id(m) for m in block.modules()}
        own = {id(p) for p in block.parameters()}
        outside = {id(p) for m in root.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
        if own & outside:
            tied.append(name)
    return tied


def resolve_block_class(spec: type[nn.Module] | str) -> type[nn.Module]:
    """Accept classes or dotted paths (``"torchvision.models.resnet.BasicBlock"``) so Hydra configs can name them."""
    if isinstance(spec, type):
        return spec
    module_name, _, attr = str(spec).rpartition(".")
    if not module_name:
        raise ValueError(f"block class {spec!r} is not a dotted path like 'package.module.Class'")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"block class {spec!r} does not name an nn.Module subclass")
    return cls
