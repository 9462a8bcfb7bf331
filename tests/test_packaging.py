"""The two distributions' package lists, requirements and version, and the import names they install.

``pyproject.toml`` builds ``dalle-lightning``: the packages ``dalle_lightning`` (folder ``dalle_lightning/``) and
``dalle_lightning_callbacks`` (``callbacks/dalle_lightning_callbacks/``), with the top-level ``conf/`` shipped as
``dalle_lightning/conf``. ``strategies/pyproject.toml`` builds ``dalle-lightning-plugins`` from its package folder
``strategies/dalle_lightning_plugins/``. Every package's folder has its import name (only the configs are mapped onto
a folder of another name), and ``strategies/`` and ``callbacks/`` hold no module of their own, so nothing imports
twice under two names. tests/test_names_resolve.py follows every import of the tree to its file;
tests/test_wheel.py builds both distributions (sdist, then wheel from it) and opens them;
tests/test_plugins_fresh_env.py installs the plugins' wheel alone into a fresh environment.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from packaging.requirements import Requirement
from setuptools import find_packages

from tests.helpers.layout import CONFIGS, package_folders, pyproject

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "strategies"
CALLBACKS = ROOT / "callbacks"
PLUGINS_PACKAGE = PLUGINS / "dalle_lightning_plugins"
CALLBACKS_PACKAGE = CALLBACKS / "dalle_lightning_callbacks"


def _requirements(folder: Path) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name: r for line in pyproject(folder)["project"]["dependencies"]}


def test_package_list_matches_the_source_tree() -> None:
    setuptools = pyproject(ROOT)["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=["dalle_lightning", "dalle_lightning.*"]))
    found |= set(find_packages(str(CALLBACKS), include=["dalle_lightning_callbacks*"]))
    assert set(setuptools["packages"]) - {CONFIGS} == found
    assert setuptools["package-dir"] == {CONFIGS: "conf",
                                         "dalle_lightning_callbacks": "callbacks/dalle_lightning_callbacks"}
    assert find_packages(str(CALLBACKS)) == ["dalle_lightning_callbacks"], "one package, without subpackages"
    assert not (ROOT / "dalle_lightning" / "conf").exists(), "the configs live at the top level, in conf/"
    assert not (ROOT / "dalle_lightning" / "callbacks").exists(), "the callbacks live in callbacks/"


def test_every_package_folder_has_the_packages_name() -> None:
    """Import name = path: a package ``a.b`` lives in a folder ``.../a/b`` (the package-dir mappings only say
    which folder holds the top-level one), so a reader or a static tool finds ``a.b.c`` at ``.../a/b/c.py``. The one
    exception is ``dalle_lightning.conf`` -> ``conf/``: YAML configs, nothing imports from it."""
    folders = package_folders()
    assert folders[CONFIGS] == (ROOT / "conf").resolve()
    for project in (ROOT, PLUGINS):
        for package, folder in pyproject(project)["tool"]["setuptools"].get("package-dir", {}).items():
            if package and package != CONFIGS:
                assert Path(folder).name == package.split(".")[-1], (project, package, folder)
    for package, folder in folders.items():
        if package != CONFIGS:
            parts = tuple(package.split("."))
            assert folder.parts[-len(parts):] == parts and (folder / "__init__.py").is_file(), (package, folder)
            assert not any(p.is_symlink() for p in (folder, *folder.parents) if p.is_relative_to(ROOT)), folder


def test_strategies_and_callbacks_hold_no_module_of_their_own() -> None:
    """The project folders hold the package folders only: no module beside them that the repository root would
    import under the folder's name (``strategies.x``, ``callbacks.x``: a second copy of every class)."""
    for folder in (PLUGINS, CALLBACKS):
        assert not list(folder.glob("*.py")), f"{folder.name}/ holds modules; they belong in its package folder"
    assert sorted(p.name for p in CALLBACKS.iterdir() if not p.name.startswith((".", "__pycache__"))) == [
        "dalle_lightning_callbacks"]


def test_every_installed_name_is_the_projects_own() -> None:
    """No top-level ``strategies`` or ``callbacks`` (or any other generic word): a distribution that owns such a
    name, or a folder of that name on a user's path, would overwrite or shadow it."""
    root_packages = pyproject(ROOT)["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in root_packages} == {"dalle_lightning", "dalle_lightning_callbacks"}
    lean = pyproject(PLUGINS)["tool"]["setuptools"]
    assert {p.split(".")[0] for p in lean["packages"]} == {"dalle_lightning_plugins"}
    assert lean["package-dir"] == {"": "."}  # the package folder beside strategies/pyproject.toml
    assert lean["include-package-data"] is False
    # one package with a subpackage per kind, as Lightning lays out its own; every one of them declared
    assert sorted(find_packages(str(PLUGINS))) == sorted(lean["packages"])


def test_one_version_for_both_distributions() -> None:
    version = (PLUGINS / "VERSION").read_text().strip()
    assert pyproject(PLUGINS)["tool"]["setuptools"]["dynamic"]["version"] == {"file": "VERSION"}
    assert pyproject(ROOT)["tool"]["setuptools"]["dynamic"]["version"] == {"file": "strategies/VERSION"}
    assert all("version" in pyproject(folder)["project"]["dynamic"] for folder in (ROOT, PLUGINS))
    assert str(_requirements(ROOT)["dalle-lightning-plugins"].specifier) == f"=={version}"


def test_the_plugins_require_torch_and_lightning_only_in_the_projects_ranges() -> None:
    lean, root = _requirements(PLUGINS), _requirements(ROOT)
    assert set(lean) == {"torch", "lightning"}
    assert lean["lightning"].specifier == root["lightning"].specifier
    lower = {str(s) for s in lean["torch"].specifier if s.operator == ">="}
    assert lower == {str(s) for s in root["torch"].specifier if s.operator == ">="} == {">=2.9"}


def test_both_distributions_have_complete_metadata() -> None:
    for folder in (ROOT, PLUGINS):
        project = pyproject(folder)["project"]
        assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
        assert (folder / "LICENSE").read_text().startswith("MIT License")
        assert (folder / project["readme"]).is_file()
        assert project["requires-python"] and project["description"] and project["authors"]
        build = pyproject(folder)["build-system"]["requires"]
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
    """What the plugins import is what their distribution requires: ``torch`` and ``lightning`` (and
    ``typing_extensions``, which both require), at any depth, in every subpackage; images (Pillow) are
    ``dalle-lightning``'s."""
    allowed = set(sys.stdlib_module_names) | {"torch", "lightning", "typing_extensions", "dalle_lightning_plugins"}
    paths = sorted(PLUGINS_PACKAGE.rglob("*.py"))
    assert {p.parent.name for p in paths} >= {"strategies", "precision", "compression", "io", "environments"}
    for path in paths:
        for module, _ in _imports(path):
            where = path.relative_to(PLUGINS_PACKAGE)
            assert module.split(".")[0] in allowed, f"{where} imports {module}; expected torch, lightning or itself"


def test_the_callbacks_import_nothing_else_of_dalle_lightning() -> None:
    """The callbacks are reusable apart from the DALL-E code: of the project they import themselves and the
    plugins only, never ``dalle_lightning``, the benchmarks or the tests."""
    paths = sorted(CALLBACKS_PACKAGE.glob("*.py"))
    assert paths
    for path in paths:
        for module, _ in _imports(path):
            top = module.split(".")[0]
            assert top not in {"dalle_lightning", "benchmarks", "tests", "strategies", "callbacks"}, (path, module)


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
