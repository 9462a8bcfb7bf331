"""Build both distributions as ``make dist`` does, for the packaging tests: an sdist of each from a clean tree (the
files git tracks or would track, none it ignores), then each wheel from its sdist.

    from tests.helpers.dists import build_dists

    dists = build_dists(tmp_path)   # {"dalle-lightning": Dist(sdist, wheel), "dalle-lightning-plugins": ...}

``python -m build --no-isolation`` uses this environment's setuptools (the test extra installs ``build``), so the
tests need no package index; ``make dist`` builds in isolated environments instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# distribution -> its folder in the repository
FOLDERS = {"dalle-lightning": ".", "dalle-lightning-plugins": "strategies"}


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path


def clean_tree(dest: Path) -> Path:
    """Copy the files git tracks or would track (not the ignored ones: __pycache__, build/, egg-info) to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_dists(work: Path, names: tuple[str, ...] = tuple(FOLDERS)) -> dict[str, Dist]:
    """Build the distributions ``names`` under ``work``: their sdists, and each wheel from its sdist."""
    tree = clean_tree(work / "tree")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built: dict[str, Dist] = {}
    for name in names:
        folder = FOLDERS[name]
        out = work / "dist" / name
        proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, tree / folder],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
        built[name] = Dist(sdist, wheel)
    return built
