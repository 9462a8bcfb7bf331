"""Every name the tree uses for its own code leads to one file of that name.

* Imports, read statically (``ast``, as an editor or a drawing of the tree from its imports reads them): every
  ``import X.Y`` and ``from X.Y import n`` of a project name, in every ``.py`` file of the tree, is the file
  ``X/Y.py`` or ``X/Y/__init__.py`` under exactly one of the folders that hold the project's packages
  (tests/helpers/layout.py reads them from the two ``pyproject.toml``: the repository root for
  ``dalle_lightning``, ``benchmarks`` and ``tests``, ``strategies/`` for ``dalle_lightning_plugins``,
  ``callbacks/`` for ``dalle_lightning_callbacks``), and ``n`` is a submodule or a name bound at its top level.
  Nothing imports ``strategies`` or ``callbacks``, the folders' own names.
* In a fresh interpreter started in the repository root: every console script's module imports, and every
  ``_target_`` in conf/ and in the benchmarks' command lines resolves as Hydra resolves it (``get_object``); the
  benchmarks' own targets also from another directory, with the environment ``benchmarks/two_nodes.py`` launches
  its runs with.
* Every ``strategy.<key>=`` override the README, the docs, the benchmarks and the tests write names a key of a
  config in conf/strategy/ (Hydra refuses to override an absent key without ``+``).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.helpers.layout import import_roots

ROOT = Path(__file__).resolve().parents[1]
ROOTS = import_roots()  # top-level project name -> the folder holding its package folder
OLD_NAMES = ("strategies", "callbacks")  # the project folders' own names: never import names


def _tree_files(*patterns: str) -> list[Path]:
    """The files git tracks or would track (none it ignores) matching ``patterns``, as they are in the tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *patterns],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / name for name in sorted(set(filter(None, listed))) if (ROOT / name).is_file()]


def _imports(path: Path) -> list[tuple[int, str, list[str], int]]:
    """``(line, module, imported names, level)`` of every import statement in ``path`` (``names`` empty for
    ``import X.Y``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, [], 0) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", [a.name for a in node.names], node.level))
    return found


def _candidates(module: str) -> list[Path]:
    """The files ``module`` is, under every root (more than one: two copies of the module)."""
    parts = module.split(".")
    found = []
    for root in sorted(set(ROOTS.values())):
        folder = root.joinpath(*parts[:-1])
        # every enclosing package has its __init__.py, except the benchmarks' folder of scripts
        packages = [root.joinpath(*parts[:i]) for i in range(1, len(parts))]
        if not all((p / "__init__.py").is_file() or p == ROOT / "benchmarks" for p in packages):
            continue
        for path in (folder / f"{parts[-1]}.py", folder / parts[-1] / "__init__.py"):
            if path.is_file():
                found.append(path)
        if len(parts) == 1 and parts[0] == "benchmarks" and (root / "benchmarks").is_dir():
            found.append(root / "benchmarks")
    return found


@cache
def _top_level_names(path: Path) -> frozenset[str] | None:
    """The names a module binds at its top level (``None``: it has a module ``__getattr__`` or a ``*`` import)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    return False
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return False
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [i.optional_vars for i in node.items if i.optional_vars] if isinstance(node, ast.With) else \
                    [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody"):
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.For)) and not visit(getattr(node, field, [])):
                    return False
            for handler in getattr(node, "handlers", []):
                if not visit(handler.body):
                    return False
        return True

    return frozenset(names) if visit(ast.parse(path.read_text()).body) else None


def _unresolved(path: Path) -> list[str]:
    problems = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for line, module, names, level in _imports(path):
        top = module.split(".")[0]
        if level:
            problems.append(f"{where}:{line}: relative import; the tree imports by absolute names")
        elif top in OLD_NAMES:
            problems.append(f"{where}:{line}: imports {module}, a folder's name; import its package instead")
        elif top in ROOTS:
            files = _candidates(module)
            if len(files) != 1 or not files[0].is_relative_to(ROOTS[top]):
                found = [str(f.relative_to(ROOT)) for f in files] or "no file"
                problems.append(f"{where}:{line}: {module} is {found}")
                continue
            # ``from package import n``: n is a submodule or bound in __init__.py; ``from module import n``: bound
            bound = _top_level_names(files[0]) if files[0].suffix == ".py" else frozenset()
            package = files[0].is_dir() or files[0].name == "__init__.py"
            problems += [f"{where}:{line}: {module} has no {name}" for name in names if bound is not None
                         and name not in bound and not (package and _candidates(f"{module}.{name}"))]
    return problems


def test_every_project_import_is_the_file_of_its_name() -> None:
    files = _tree_files("*.py")
    assert len(files) > 100 and {"dalle_lightning", "strategies", "callbacks", "benchmarks", "tests"} <= {
        f.relative_to(ROOT).parts[0] for f in files}
    problems = [problem for path in files for problem in _unresolved(path)]
    assert not problems, "\n".join(problems)


def test_the_static_resolution_catches_what_it_should(tmp_path: Path) -> None:
    """Guards the check itself: an old name, a missing module, a missing name and a relative import are found."""
    source = tmp_path / "probe.py"
    source.write_text("import dalle_lightning_plugins.strategies.mesh\nfrom dalle_lightning_callbacks.ema import EMA\n"
                      "from tests.helpers import layout\nfrom benchmarks._two_hosts import TwoHosts\n"
                      "import strategies.dalle_lightning_plugins.strategies.mesh\nimport dalle_lightning_plugins.nowhere\n"
                      "from dalle_lightning_plugins.strategies.mesh import nothing_of_that_name\nfrom . import conftest\n")
    problems = _unresolved(source)
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in problems] == ["5", "6", "7", "8"], problems


def _targets_in(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "_target_" and isinstance(v, str)] + \
            [t for v in node.values() for t in _targets_in(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets_in(v)]
    return []


def _config_targets() -> dict[str, str]:
    """``_target_`` value -> the first config file that names it, over every config in conf/."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            for target in _targets_in(document):
                found.setdefault(target, str(path.relative_to(ROOT)))
    return found


def _benchmark_targets() -> list[str]:
    """The ``_target_`` values the benchmarks pass on command lines (``+callbacks.x._target_=...``)."""
    text = "\n".join(p.read_text() for p in _tree_files("benchmarks/*.py"))
    return sorted(set(re.findall(r"_target_=([A-Za-z_][\w.]+)", text)) | {
        m for m in re.findall(r'^HOOK = "([\w.]+)"', text, re.M)})


# Every console script's module, the demo, the plotting module run with -m, and every project class a config names,
# resolved as Hydra resolves a _target_; prints the project modules that came from outside their roots.
CHECK = """
import importlib, json, sys
from hydra.utils import get_object
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
for target in json.loads(sys.argv[1]):
    get_object(target)
print(json.dumps({m: getattr(sys.modules[m], "__file__", None) for m in sys.modules
                  if m.split(".")[0] in json.loads(sys.argv[3])}))
"""


def _check(targets: list[str], modules: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(targets), json.dumps(modules),
                           json.dumps([*ROOTS, *OLD_NAMES])], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_command_and_target_imports_in_a_fresh_interpreter() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    modules = sorted({entry.split(":")[0] for entry in scripts.values()}) + [
        "dalle_lightning.demo", "dalle_lightning.evaluation.plot_quality_vs_time", "dalle_lightning.artifacts"]
    targets = sorted(t for t in [*_config_targets(), *_benchmark_targets()] if t.split(".")[0] in ROOTS)
    assert any(t.startswith("dalle_lightning_plugins.") for t in targets)
    assert any(t.startswith("dalle_lightning_callbacks.") for t in targets)
    assert any(t.startswith("benchmarks.") for t in targets)
    loaded = _check(targets, modules, cwd=ROOT)
    assert not [m for m in loaded if m.split(".")[0] in OLD_NAMES], loaded
    for module, file in loaded.items():  # each from its own root (no second copy from elsewhere)
        assert file is None or Path(file).resolve().is_relative_to(ROOTS[module.split(".")[0]]), (module, file)


def test_the_benchmarks_targets_import_in_their_runs_from_any_directory(tmp_path: Path) -> None:
    """benchmarks/two_nodes.py's ``dalle-train`` runs (under ``torchrun``, in the directory the benchmark was
    started from) load ``benchmarks._torch_powersgd_hook``: the environment it gives them puts the root on the path."""
    import os

    from benchmarks.two_nodes import HOOK, launch_env

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | launch_env()
    loaded = _check([HOOK], [], cwd=tmp_path, env=env)
    assert Path(loaded["benchmarks._torch_powersgd_hook"]).resolve() == ROOT / "benchmarks" / "_torch_powersgd_hook.py"


def test_the_old_names_are_not_installed() -> None:
    """Outside the repository root neither folder's name imports: no shim, no distribution owning them."""
    import os

    proc = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                           "print([n for n in sys.argv[1:] if u.find_spec(n)])", *OLD_NAMES],
                          cwd=ROOT / "tests" / "helpers", capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


STRATEGY_KEYS = {key for path in (ROOT / "conf" / "strategy").glob("*.yaml")
                 for key in yaml.safe_load(path.read_text())}
# ``strategy.<key>=`` on a command line, or ``strategy:<key>=`` in benchmarks/two_nodes.py's --settings (not
# ``+strategy.<key>=``, which adds a key)
OVERRIDE = re.compile(r"(?<![+\w.])strategy[.:]([a-z_]+)=")


def test_every_strategy_key_a_command_line_overrides_is_in_the_config() -> None:
    files = _tree_files("README.md", "docs/*.md", "benchmarks/*.py", "tests/*.py", "dalle_lightning/*.py")
    used = {(str(path.relative_to(ROOT)), key) for path in files for key in OVERRIDE.findall(path.read_text())}
    assert {key for _, key in used} >= {"devices_per_node", "powersgd_rank", "overlap"}
    assert not [(where, key) for where, key in sorted(used) if key not in STRATEGY_KEYS], STRATEGY_KEYS


# The one value the strategies' configs set apart from their constructors, as each file says at its top.
CONFIG_DIFFERS = {"checkpoint_format": ("sharded", "full")}


@pytest.mark.parametrize("name", ["sharded_powersgd", "local_steps"])
def test_every_strategy_config_key_is_a_parameter_with_the_constructors_default(name: str) -> None:
    """Hydra passes the keys of conf/strategy/<name>.yaml as keyword arguments: each names a parameter, and each
    value is its default (one default per setting), except the ones the file explains."""
    import inspect
    from datetime import timedelta

    from hydra.utils import get_object

    config = yaml.safe_load((ROOT / "conf" / "strategy" / f"{name}.yaml").read_text())
    parameters = inspect.signature(get_object(config.pop("_target_"))).parameters
    assert set(config) == set(parameters), set(config) ^ set(parameters)

    def plain(value: object) -> object:  # the constructor's types as YAML writes them
        if isinstance(value, timedelta):
            return value.total_seconds()
        if isinstance(value, tuple):
            return list(value)
        return str(value).removeprefix("torch.") if type(value).__module__ == "torch" else value

    differ = {k: (v, plain(parameters[k].default)) for k, v in config.items() if v != plain(parameters[k].default)}
    assert differ == CONFIG_DIFFERS
    text = (ROOT / "conf" / "strategy" / f"{name}.yaml").read_text()
    assert all(re.search(rf"^{key}: .+ # ", text, re.M) for key in config), "every key has its comment"
