"""The package survives a normal install: a built wheel, installed into a fresh virtualenv, runs its console scripts
from outside the source tree (the Hydra configs ship inside the package).

The fresh virtualenv reuses this environment's installed dependencies (torch and the rest) through a ``.pth`` file
instead of downloading them; directories added that way do not run their own ``.pth`` files, so an editable
install of the project there stays invisible and the wheel's copy is the one imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                "outputs", "multirun", "lightning_logs")


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the source tree must not leak in
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.slow
def test_wheel_installs_and_its_console_scripts_run_outside_the_source_tree(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=IGNORE)
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         cwd=source)
    (wheel,) = (tmp_path / "dist").glob("dalle_lightning-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                   .stdout.strip())
    (purelib / "dalle_lightning_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel,
         cwd=tmp_path)

    run_dir = tmp_path / "elsewhere"  # neither the source tree nor its copy
    run_dir.mkdir()
    where = _run(python, "-c", "import dalle_lightning; print(dalle_lightning.__file__)", cwd=run_dir).stdout
    assert where.startswith(str(purelib)), where
    _run(bin_dir / "dalle-data", "out_dir=world", "n_train=16", "n_val=8", "n_zeroshot=0", "shard_size=8",
         "hydra.run.dir=runs/data", cwd=run_dir)
    assert sorted(p.name for p in (run_dir / "world" / "train").glob("*.tar")) == ["000000.tar", "000001.tar"]
    _run(bin_dir / "dalle-train", "stage=dvae", "paths.work_dir=.", "trainer.fast_dev_run=true", "model.n_hid=8",
         "model.vocab_size=32", "model.codebook_dim=16", "data.batch_size=8", "hydra.run.dir=runs/dvae", cwd=run_dir)
