"""Where each import name lives, read from the two ``pyproject.toml`` files as setuptools reads them.

    from tests.helpers.layout import import_roots, package_folders

    package_folders()  # {"dalle_lightning_plugins": ROOT/"strategies/dalle_lightning_plugins", ...}
    import_roots()     # {"dalle_lightning_plugins": ROOT/"strategies", "dalle_lightning": ROOT, "tests": ROOT, ...}

tests/test_packaging.py checks the folders (each has its package's name), tests/test_names_resolve.py follows every
import of the tree to a file under the roots.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each distribution's project folder (its pyproject.toml), in the repository.
DISTRIBUTIONS = {"dalle-lightning": ROOT, "dalle-lightning-plugins": ROOT / "strategies"}
# The one package mapped onto a folder of another name: the Hydra configs (YAML, nothing imports from them).
CONFIGS = "dalle_lightning.conf"
# Folders at the repository root that no distribution ships but that import by their path from there: the
# benchmarks (plain scripts, no __init__.py; a _target_ like benchmarks._torch_powersgd_hook.TorchPowerSGDHook)
# and the tests.
UNSHIPPED = {"benchmarks": ROOT, "tests": ROOT}


def pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def package_folders() -> dict[str, Path]:
    """Every package either distribution declares -> its folder, by setuptools' ``package-dir`` rule: the longest
    mapped prefix of the name (``""`` for all), then one folder per further component."""
    folders: dict[str, Path] = {}
    for project in DISTRIBUTIONS.values():
        setuptools = pyproject(project)["tool"]["setuptools"]
        mapping = setuptools.get("package-dir", {})
        for package in setuptools["packages"]:
            prefix = max((k for k in mapping if k == "" or package == k or package.startswith(k + ".")), key=len,
                         default=None)
            base = project / mapping[prefix] if prefix is not None else project
            rest = package[len(prefix):].lstrip(".") if prefix else package
            folders[package] = (base.joinpath(*rest.split(".")) if rest else base).resolve()
    return folders


def import_roots() -> dict[str, Path]:
    """Each top-level import name of the tree -> the folder that holds its package folder (what an editable
    install or ``python -m`` from the root puts on ``sys.path``). A declared package whose folder does not end
    in its dotted name has no root (tests/test_packaging.py fails on it)."""
    roots: dict[str, Path] = dict(UNSHIPPED)
    for package, folder in package_folders().items():
        parts = package.split(".")
        if package != CONFIGS and folder.parts[-len(parts):] == tuple(parts):
            roots.setdefault(parts[0], folder.parents[len(parts) - 1])
    return roots
