"""The two distributions' package lists, requirements and version, and the import names they install.

``pyproject.toml`` builds ``dalle-lightning``: the code packages, the top-level ``conf/`` (shipped as
``dalle_lightning/conf``) and ``callbacks/`` (shipped as ``dalle_lightning/callbacks``). ``strategies/pyproject.toml``
builds ``dalle-lightning-plugins`` from the folder ``strategies/``, installed as ``dalle_lightning_plugins``. Neither
installs a generic top-level name. tests/test_wheel.py builds both (sdist, then wheel from it) and opens them;
tests/test_plugins_fresh_env.py installs the plugins' wheel alone into a fresh environment.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "strategies"


def _pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def _requirements(folder: Path) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name: r for line in _pyproject(folder)["project"]["dependencies"]}


def test_package_list_matches_the_source_tree() -> None:
    setuptools = _pyproject(ROOT)["tool"]["setuptools"]
    declared = set(setuptools["packages"])
    found = set(find_packages(str(ROOT), include=["dalle_lightning*"]))
    assert declared - {"dalle_lightning.conf", "dalle_lightning_callbacks"} == found
    assert setuptools["package-dir"] == {"dalle_lightning.conf": "conf", "dalle_lightning_callbacks": "callbacks"}
    assert not find_packages(str(ROOT / "callbacks")), "callbacks/ ships as one package, without subpackages"
    assert not (ROOT / "dalle_lightning" / "conf").exists(), "the configs live at the top level, in conf/"
    assert not (ROOT / "dalle_lightning" / "callbacks").exists(), "the callbacks live at the top level, in callbacks/"


def test_every_installed_name_is_the_projects_own() -> None:
    """No top-level ``strategies`` or ``callbacks`` (or any other generic word): a distribution that owns such a
    name, or a folder of that name on a user's path, would overwrite or shadow it."""
    root_packages = _pyproject(ROOT)["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in root_packages} == {"dalle_lightning"}
    lean = _pyproject(PLUGINS)["tool"]["setuptools"]
    assert lean["packages"] == ["dalle_lightning_plugins"]
    assert lean["package-dir"] == {"dalle_lightning_plugins": "."}
    assert lean["include-package-data"] is False  # README.md, LICENSE, VERSION sit in the package's folder
    assert not find_packages(str(PLUGINS)), "strategies/ ships as one package, without subpackages"


def test_one_version_for_both_distributions() -> None:
    version = (PLUGINS / "VERSION").read_text().strip()
    assert _pyproject(PLUGINS)["tool"]["setuptools"]["dynamic"]["version"] == {"file": "VERSION"}
    assert _pyproject(ROOT)["tool"]["setuptools"]["dynamic"]["version"] == {"file": "strategies/VERSION"}
    assert all("version" in _pyproject(folder)["project"]["dynamic"] for folder in (ROOT, PLUGINS))
    assert str(_requirements(ROOT)["dalle-lightning-plugins"].specifier) == f"=={version}"


def test_the_plugins_require_torch_and_lightning_only_in_the_projects_ranges() -> None:
    lean, root = _requirements(PLUGINS), _requirements(ROOT)
    assert set(lean) == {"torch", "lightning"}
    assert lean["lightning"].specifier == root["lightning"].specifier
    lower = {str(s) for s in lean["torch"].specifier if s.operator == ">="}
    assert lower == {str(s) for s in root["torch"].specifier if s.operator == ">="} == {">=2.13"}


def test_both_distributions_have_complete_metadata() -> None:
    for folder in (ROOT, PLUGINS):
        project = _pyproject(folder)["project"]
        assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
        assert (folder / "LICENSE").read_text().startswith("MIT License")
        assert (folder / project["readme"]).is_file()
        assert project["requires-python"] and project["description"] and project["authors"]
        build = _pyproject(folder)["build-system"]["requires"]
        assert any(Requirement(r).name == "setuptools" and Requirement(r).specifier.contains("77") for r in build)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, nested)`` of every absolute import in ``path``; ``nested``: inside a function or class."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, nested))
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def test_the_plugins_import_only_torch_lightning_and_themselves() -> None:
    """What ``strategies/`` imports is what its distribution requires: ``torch`` and ``lightning`` (and
    ``typing_extensions``, which both require); Pillow only inside the image writer the callbacks call."""
    allowed = set(sys.stdlib_module_names) | {"torch", "lightning", "typing_extensions", "dalle_lightning_plugins"}
    for path in sorted(PLUGINS.glob("*.py")):
        for module, nested in _imports(path):
            top = module.split(".")[0]
            assert top in allowed or (nested and top == "PIL"), f"{path.name} imports {module}"


def test_the_callbacks_import_nothing_else_of_dalle_lightning() -> None:
    for path in sorted((ROOT / "callbacks").glob("*.py")):
        for module, _ in _imports(path):
            if module.split(".")[0] in {"dalle_lightning", "strategies", "callbacks"}:
                assert module.startswith(("dalle_lightning_callbacks", "dalle_lightning_plugins")), (path, module)


def test_pip_check_is_clean_in_this_environment() -> None:
    """Both distributions installed from the checkout (``make install``), with every requirement satisfied;
    tests/test_plugins_fresh_env.py runs ``pip check`` in an environment with the plugins alone."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    names = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                           timeout=300).stdout
    installed = {line.split("==")[0].replace("_", "-").lower() for line in names.splitlines()}
    assert {"dalle-lightning", "dalle-lightning-plugins"} <= installed
