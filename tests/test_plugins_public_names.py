"""The names users import from the top of the plugins keep working after the layout by kind.

The modules moved into subpackages (``strategies``, ``precision``, ``compression``, ``io``, ``environments``;
docs/plugins.md, "Layout"), and a module's old flat path is gone without an alias (the "Moved names" table
says where each went). What users write, ``from dalle_lightning_plugins import ShardedPowerSGDStrategy``, must not
notice: every name the top exported before the move (``BEFORE_THE_LAYOUT``, the ``__all__`` of the flat package)
still imports from it, in a fresh interpreter, and is the very object its new module defines, so an
``isinstance`` check or a pickled reference made through either path agrees with the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# dalle_lightning_plugins.__all__ before the layout by kind (commit 161665b^), each with the subpackage module
# that defines it now.
BEFORE_THE_LAYOUT = {
    "GroupUnscalingPrecision": "dalle_lightning_plugins.protocol",
    "LocalStepsStrategy": "dalle_lightning_plugins.strategies.local_steps",
    "ResblockScalingPrecision": "dalle_lightning_plugins.precision.resblock_precision",
    "ShardedPowerSGDStrategy": "dalle_lightning_plugins.strategies.sharded_powersgd",
    "UnscalingPrecision": "dalle_lightning_plugins.protocol",
    "apply_prefetch": "dalle_lightning_plugins.strategies.prefetch",
    "build_mesh": "dalle_lightning_plugins.strategies.mesh",
    "checkpoint_to_full_state_dict": "dalle_lightning_plugins.io.dcp_checkpoint",
    "export_full_state_dict": "dalle_lightning_plugins.io.dcp_checkpoint",
    "find_resblocks": "dalle_lightning_plugins.protocol",
    "mesh_shape": "dalle_lightning_plugins.strategies.mesh",
    "prefetch_plan": "dalle_lightning_plugins.strategies.prefetch",
}

# Run in a fresh interpreter: the names must import from a cold start, not from modules this session loaded.
PROBE = """
import importlib, json, sys
names = json.loads(sys.argv[1])
top = importlib.import_module("dalle_lightning_plugins")
report = {"all": sorted(top.__all__), "missing": [], "elsewhere": {},
          "unresolved": [n for n in top.__all__ if not hasattr(top, n)]}
for name, module in names.items():
    try:
        exec(f"from dalle_lightning_plugins import {name} as obj", {}, scope := {})
    except ImportError as exc:
        report["missing"].append(f"{name}: {exc}")
        continue
    owner = getattr(importlib.import_module(module), name, None)
    if scope["obj"] is not owner:
        report["elsewhere"][name] = f"{getattr(scope['obj'], '__module__', '?')} (expected {module})"
print(json.dumps(report))
"""


def _probe() -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(BEFORE_THE_LAYOUT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_name_the_top_exported_before_the_layout_still_imports_from_the_top() -> None:
    report = _probe()
    assert report["missing"] == [], "names users import from dalle_lightning_plugins that no longer import:\n" + \
        "\n".join(report["missing"])
    assert report["elsewhere"] == {}, f"the top's name is not the object its module defines: {report['elsewhere']}"
    assert report["unresolved"] == [], f"dalle_lightning_plugins.__all__ lists {report['unresolved']}, absent from it"
    lost = sorted(set(BEFORE_THE_LAYOUT) - set(report["all"]))
    assert not lost, f"dalle_lightning_plugins.__all__ lost {lost}; expected every name it listed before the layout"
