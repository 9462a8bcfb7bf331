"""The project's commands import its code under the names it owns only: ``dalle_lightning_plugins`` (built from
``strategies/``) and ``dalle_lightning_callbacks`` (built from ``callbacks/``), never a top-level ``strategies`` or
``callbacks``, although both folders would import under those names from the repository root.

Each check runs in a fresh interpreter started in the repository root (the root first on its path, as when a
command runs there); tests/conftest.py checks the suite's own process at the end of the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import OLD_IMPORT_NAMES

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PREFIXES = ("dalle_lightning.", "dalle_lightning_plugins.")


def _targets() -> dict[str, str]:
    """``_target_`` value -> the config file that names it, over every config in conf/."""
    found: dict[str, str] = {}

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "_target_" and isinstance(value, str):
                    found.setdefault(value, where)
                walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            walk(document, str(path.relative_to(ROOT)))
    return found


def test_config_targets_name_the_new_modules() -> None:
    targets = _targets()
    own = {t: where for t, where in targets.items() if t.split(".")[0] in {"dalle_lightning", "dalle_lightning_plugins",
                                                                            *OLD_IMPORT_NAMES}}
    assert own, "conf/ names the project's classes"
    old = {t: where for t, where in own.items() if not t.startswith(PROJECT_PREFIXES)}
    assert not old, f"_target_ under an old import name: {old}"


# Every console script's module, the demo, the plotting module run with -m, and every project class a config
# names, resolved as Hydra resolves a _target_.
CHECK = """
import importlib, json, sys
from hydra.utils import get_object
for name in sys.argv[2:]:
    importlib.import_module(name)
for target in json.loads(sys.argv[1]):
    get_object(target)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("strategies", "callbacks"))))
"""


def test_the_commands_import_no_old_name_from_the_repository_root() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    modules = sorted({entry.split(":")[0] for entry in scripts.values()}) + [
        "dalle_lightning.demo", "dalle_lightning.evaluation.plot_quality_vs_time", "dalle_lightning.artifacts"]
    targets = sorted(t for t in _targets() if t.startswith(PROJECT_PREFIXES))
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(targets), *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_the_old_names_are_not_installed() -> None:
    """Outside the repository root neither old name imports: no shim, no second distribution owning them."""
    proc = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                           "print([n for n in ('strategies', 'callbacks') if u.find_spec(n)])"],
                          cwd=ROOT / "tests" / "helpers", capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
