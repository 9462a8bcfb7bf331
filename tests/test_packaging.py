"""The wheel carries the code packages and the top-level ``conf/`` (as ``dalle_lightning/conf``), so an installed
``dalle-train`` finds its configs without the source tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_package_list_matches_the_source_tree() -> None:
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(ROOT), include=["dalle_lightning*", "strategies*", "callbacks*"]))
    assert declared - {"dalle_lightning.conf"} == found
    assert not (ROOT / "dalle_lightning" / "conf").exists(), "the configs live at the top level, in conf/"


@pytest.mark.slow
def test_wheel_ships_every_config(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("dalle_lightning-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"dalle_lightning/conf/" + p.relative_to(ROOT / "conf").as_posix()
                for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= names
    assert "strategies/sharded_powersgd.py" in names and "callbacks/ema.py" in names
