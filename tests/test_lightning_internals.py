"""The private Lightning (and torch) names the plugins rely on still exist, each checked by name.

``pyproject.toml`` pins ``lightning`` to the range these plugins were tested with; a newer release may move or
drop a private helper without notice. Then this file fails first, naming the symbol, instead of a training run
failing halfway with an ``AttributeError`` deep in a strategy hook. Private imports from ``lightning`` are found
by reading the plugins' sources, so a new one is checked without being listed here; private attributes and
methods are listed by hand.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = ("strategies", "callbacks")


def private_imports(top: str, paths: list[Path]) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from <top>... import _name`` in ``paths``."""
    found: set[tuple[str, str]] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == top:
                found.update((node.module, a.name) for a in node.names if a.name.startswith("_"))
    return sorted(found)


PLUGIN_SOURCES = sorted(p for folder in PLUGIN_DIRS for p in (ROOT / folder).glob("*.py"))


@pytest.mark.parametrize(("module", "name"), private_imports("lightning", PLUGIN_SOURCES), ids=lambda v: str(v))
def test_private_lightning_import_exists(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), (
        f"lightning no longer has {module}.{name}, which strategies/ imports; "
        "pin lightning below this release or replace the helper"
    )


def _owner(name: str) -> object:
    """An instance of a Lightning class (instance attributes are set in ``__init__``), or a torch module."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    makers = {
        "ModelParallelStrategy": ModelParallelStrategy,
        "LightningModule": LightningModule,
        "LightningOptimizer": lambda: LightningOptimizer(optimizer),
        "Precision": Precision,
    }
    return makers[name]() if name in makers else importlib.import_module(name)


# Owner -> private attribute paths the plugins use. Torch is pinned too, but an upgrade should fail here first.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    # ShardedPowerSGDStrategy.setup_environment: process group, backend, timeout and mesh of the parent class.
    "ModelParallelStrategy": ("_setup_distributed", "_get_process_group_backend", "_timeout", "_device_mesh"),
    # setup_environment hands the mesh to the module; ResblockScalingPrecision asks if a trainer is attached.
    "LightningModule": ("_device_mesh", "_trainer"),
    # The strategy's optimizer state and checkpoints unwrap Lightning's optimizer.
    "LightningOptimizer": ("_optimizer",),
    # ResblockScalingPrecision.optimizer_step runs Lightning's hooks and clipping on unscaled gradients.
    "Precision": ("_after_closure",),
    "torch": ("_amp_foreach_non_finite_check_and_unscale_",),  # the precision plugin's fused unscale
    "torch.distributed": ("ProcessGroupGloo._Options",),  # strategies.mesh: the gloo groups' timeout
    "torch.distributed._composable": ("checkpoint",),  # shard_module: activation checkpointing
    "torch.utils._pytree": ("tree_map",),  # strategies.grad_filter
}


@pytest.mark.parametrize(
    ("owner", "name"), [(o, n) for o, names in PRIVATE_NAMES.items() for n in names], ids=lambda v: str(v)
)
def test_private_name_exists(owner: str, name: str) -> None:
    value = _owner(owner)
    for part in name.split("."):
        assert hasattr(value, part), f"{owner} has no {name} in the installed release; strategies/ relies on it"
        value = getattr(value, part)


def test_the_source_scan_finds_private_imports(tmp_path: Path) -> None:
    """Guards the scan itself: if it missed imports, the parametrized test above would pass vacuously."""
    source = tmp_path / "plugin.py"
    source.write_text("from lightning.fabric.utilities.init import _private, public\nfrom torch import _other\n")
    assert private_imports("lightning", [source]) == [("lightning.fabric.utilities.init", "_private")]
