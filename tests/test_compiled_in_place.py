"""Modules compiled with ``Module.compile(...)``, compiled again in place around FSDP2's units with the user's
configuration, in one process (``strategies/.../strategies/compiled_in_place.py``, ``compat.compile_config``). The sharded fit on 2
processes, against ``ddp``, is ``tests/test_module_patterns.py`` (``compiled_child``).

A block's forward pre-hook made opaque to dynamo (``torch.compiler.disable``) stands for FSDP2's hooks, which torch
disables for dynamo the same way."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.strategies.compiled_in_place import compile_in_place, compile_regions


def _compile_call(module: nn.Module, config: Any) -> None:
    """``module``'s call compiled with ``config`` (another module's :func:`compat.compile_config`), as
    ``Module.compile`` compiles it (``compiled_in_place`` does the same for a module without units)."""
    module._compiled_call_impl = config(module._call_impl)


class Graphs:
    """A dynamo backend that counts the graphs it is given and runs each as traced."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.count += 1
        return gm.forward


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * 0.5
        return self.out(x)


class Breaks(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        torch._dynamo.graph_break()
        return x + 1


@torch.compiler.disable
def _opaque_hook(module: nn.Module, args: Any) -> None:
    """What FSDP2's pre-forward hook is to dynamo: a call it does not trace."""


def test_the_configuration_compiles_another_module_as_the_users() -> None:
    graphs = Graphs()
    user = Block()
    user.compile(backend=graphs, fullgraph=True)
    config = compat.compile_config(user)
    assert config is not None
    other = Block()
    _compile_call(other, config)
    x = torch.randn(3, 4)
    torch.testing.assert_close(other(x), other.forward(x), rtol=0, atol=0)
    assert graphs.count == 1  # the user's backend compiled the other module's call
    breaks = Breaks()
    _compile_call(breaks, config)
    with pytest.raises(Exception, match="graph_break"):  # fullgraph=True kept: a graph break is an error
        breaks(x)
    lenient = Graphs()
    user.compile(backend=lenient)
    _compile_call(breaks, compat.compile_config(user))
    torch.testing.assert_close(breaks(x), breaks.forward(x), rtol=0, atol=0)
    assert lenient.count == 2  # fullgraph=False kept: two graphs around the break


def test_an_uncompiled_or_disabled_module_has_no_configuration() -> None:
    module = Block()
    assert compat.compiled_call(module) is None and compat.compile_config(module) is None
    module.compile(backend="eager", disable=True)  # the module's own call: eager
    assert compat.compiled_call(module) is None and compat.compile_config(module) is None
    assert compat.compile_config(copy.deepcopy(Block())) is None


def test_regions_leave_the_units_hooks_outside() -> None:
    torch.manual_seed(0)
    graphs = Graphs()
    user = Body()
    user.compile(backend=graphs, fullgraph=True)
    config = compat.compile_config(user)
    x = torch.randn(3, 4)
    expected = user.forward(x)
    sharded = copy.deepcopy(user)
    for block in sharded.blocks:
        block.register_forward_pre_hook(_opaque_hook)
    whole = copy.deepcopy(sharded)
    _compile_call(whole, config)
    with pytest.raises(Exception, match="disable"):  # why the regions: fullgraph through an opaque hook fails
        whole(x)
    sharded._compiled_call_impl = None  # the user's call set aside (compile_in_place)
    changed: list = []
    compile_regions(sharded, config, {id(b) for b in sharded.blocks}, set(), changed)
    graphs.count = 0
    torch.testing.assert_close(sharded(x), expected, rtol=0, atol=0)
    # the blocks' forward (its hook outside; the second block runs the first one's graph) and the out block's call
    assert graphs.count == 2
    assert compat.compiled_call(sharded) is None  # the body's own loop, around the units, runs eagerly
    for change in reversed(changed):  # the stage's end: the modules' own forward and call again
        change.remove()
    assert all("forward" not in vars(b) for b in sharded.blocks) and compat.compiled_call(sharded.out) is None


def test_a_configuration_this_torch_does_not_show_is_said_in_one_line() -> None:
    user = Block()
    user._compiled_call_impl = functools.partial(user._call_impl)  # a compiled call dynamo's wrapper did not make
    own = user._compiled_call_impl
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        changed = compile_in_place({"enc": user}, 2)
    lines = [str(w.message) for w in said]
    assert len(lines) == 1 and lines[0].startswith(
        "ShardedPowerSGDStrategy(devices_per_node=2): enc compiled with Module.compile() trains eagerly"), lines
    assert compat.compiled_call(user) is None  # eager in the stage
    for change in changed:
        change.remove()
    assert user._compiled_call_impl is own  # the user's own call after the stage
