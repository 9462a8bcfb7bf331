"""Activation checkpointing the strategy can take off again: each block's forward runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` for the stage, and not after it.

torch's composable ``checkpoint(module)`` keeps module names too, but it registers hooks whose handles it never
returns (and a local closure pickle cannot name): a module fitted with it keeps them for good. Here the block's
own ``forward`` is wrapped by an instance attribute, the block's class, names, parameters and hooks stay the
user's, and :meth:`ActivationCheckpointing.remove` restores what was there. The recompute in backward calls the
block's forward directly (not ``__call__``): FSDP2's pre-backward hook has gathered the block's parameters by then,
and hooks that count forwards (the strategy's, a user's) see each forward once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ABSENT = object()  # the block had no instance-level forward of its own


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # validation, sampling: nothing to save for a backward
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


class ActivationCheckpointing:
    """The blocks whose forward recomputes in backward, and what each had before (for :meth:`remove`)."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[nn.Module, Any]] = []

    def apply(self, blocks: Iterable[nn.Module]) -> None:
        done = {id(b) for b, _ in self._wrapped}
        for block in blocks:
            if id(block) in done:
                continue
            previous = block.__dict__.get("forward", _ABSENT)
            block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
            self._wrapped.append((block, previous))

    def remove(self) -> None:
        """Every block's forward as it was before :meth:`apply` (at teardown: the module leaves as it came)."""
        for block, previous in reversed(self._wrapped):
            if previous is _ABSENT:
                block.__dict__.pop("forward", None)
            else:
                block.forward = previous  # type: ignore[method-assign]
        self._wrapped.clear()

    def __len__(self) -> int:
        return len(self._wrapped)
