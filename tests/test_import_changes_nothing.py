"""Importing the plugins (or the project) changes nothing of torch or Lightning (issue 66, item 1).

In a fresh interpreter: first every torch and Lightning module that importing ``dalle_lightning_plugins`` and
``dalle_lightning`` loads is imported on its own (the list comes from a first interpreter that imports the
packages), and a snapshot is taken of every attribute of every class in those modules (``id`` of each value of the
class ``__dict__``), of every module-level function, and of the registries a plugin could add to: DTensor's op
handlers and sharding rules, pytree's node types, torch's safe globals for ``weights_only`` loading, the
distributed backends, and Lightning's strategy, accelerator and precision registries. Then the packages are
imported and the snapshot taken again. The only difference allowed is Lightning's public ``StrategyRegistry``
gaining the plugins' two names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dalle_lightning_plugins", "dalle_lightning")
ALLOWED_STRATEGIES = {"sharded_powersgd", "local_steps"}

LOADED = """
import json, sys
for name in {packages!r}:
    __import__(name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))))
"""

SNAPSHOT = r"""
import importlib, json, sys, types

for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:  # a module that only imports as part of another (none has so far)
        pass


def registries():
    import torch.utils._pytree as pytree
    import torch.serialization
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.accelerators import AcceleratorRegistry

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    return {
        "dtensor.custom_op_handlers": {str(k): id(v) for k, v in dispatcher._custom_op_handlers.items()},
        "dtensor.op_strategy_funcs": {str(k): id(v) for k, v in propagator.op_strategy_funcs.items()},
        "dtensor.op_to_rules": {str(k): id(v) for k, v in getattr(propagator, "op_to_rules", {}).items()},
        "pytree.SUPPORTED_NODES": {repr(k): id(v) for k, v in pytree.SUPPORTED_NODES.items()},
        "serialization.safe_globals": sorted(repr(g) for g in torch.serialization.get_safe_globals()),
        "distributed.backends": sorted(dist.Backend.backend_list),
        "lightning.StrategyRegistry": sorted(StrategyRegistry),
        "lightning.AcceleratorRegistry": sorted(AcceleratorRegistry),
    }


def classes_and_functions():
    out = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in ("torch", "lightning") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for key, member in list(vars(value).items()):
                    out[f"{name}.{attr}.{key}"] = id(member)
            elif isinstance(value, types.FunctionType):
                out[f"{name}.{attr}"] = id(value)
    return out


before_members, before_registries = classes_and_functions(), registries()
for package in sys.argv[2:]:
    __import__(package)
after_members, after_registries = classes_and_functions(), registries()
print(json.dumps({
    "classes": len({k.rsplit(".", 1)[0] for k in before_members}),
    "changed": sorted(k for k in before_members if k in after_members and after_members[k] != before_members[k]),
    "removed": sorted(k for k in before_members if k not in after_members),
    "added_to_known": sorted(k for k in after_members if k not in before_members
                             and k.rsplit(".", 1)[0] in {b.rsplit(".", 1)[0] for b in before_members}),
    "before": before_registries,
    "after": after_registries,
}))
"""


def _python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "strategies"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def snapshot() -> dict:
    loaded = _python(LOADED.format(packages=PACKAGES))
    return json.loads(_python(SNAPSHOT, loaded, *PACKAGES))


def test_no_class_or_function_of_torch_or_lightning_replaced(snapshot: dict) -> None:
    assert snapshot["classes"] > 1000  # the walk saw torch's and Lightning's classes, not an empty list
    assert snapshot["changed"] == []
    assert snapshot["removed"] == []
    assert snapshot["added_to_known"] == []


def test_no_registry_entry_but_the_strategy_names(snapshot: dict) -> None:
    before, after = snapshot["before"], snapshot["after"]
    assert before["dtensor.custom_op_handlers"], "the snapshot read DTensor's handler table"
    for key in before:
        if key == "lightning.StrategyRegistry":
            assert set(after[key]) - set(before[key]) == ALLOWED_STRATEGIES
            assert set(before[key]) <= set(after[key])
        else:
            assert after[key] == before[key], key
