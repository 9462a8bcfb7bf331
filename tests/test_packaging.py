"""The wheel's package list: the code packages and the top-level ``conf/`` (shipped as ``dalle_lightning/conf``).
tests/test_wheel.py installs the built wheel and runs it outside the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_package_list_matches_the_source_tree() -> None:
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(ROOT), include=["dalle_lightning*", "strategies*", "callbacks*"]))
    assert declared - {"dalle_lightning.conf"} == found
    assert not (ROOT / "dalle_lightning" / "conf").exists(), "the configs live at the top level, in conf/"
