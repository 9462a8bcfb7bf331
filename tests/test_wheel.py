"""Both distributions as ``make dist`` builds them (an sdist each from a clean tree, each wheel from its sdist): what
the wheels install and require, what they hold, their metadata (``twine check``); and the package survives a normal
install: both wheels, installed into a fresh virtualenv, run the console scripts from outside the source tree (the
Hydra configs ship inside the package). tests/test_plugins_fresh_env.py installs the plugins' wheel alone, with
torch and Lightning only.

The fresh virtualenv reuses this environment's installed dependencies (torch and the rest) through a ``.pth`` file
instead of downloading them; directories added that way do not run their own ``.pth`` files, so an editable
install of the project there stays invisible and the wheel's copy is the one imported.
"""

from __future__ import annotations

import email
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers.dists import Dist, build_dists

ROOT = Path(__file__).resolve().parents[1]
VERSION = (ROOT / "strategies" / "VERSION").read_text().strip()
# distribution -> the top-level import names it installs (its package folders: dalle_lightning/,
# callbacks/dalle_lightning_callbacks/; strategies/dalle_lightning_plugins/)
TOP_LEVEL = {"dalle-lightning": ["dalle_lightning", "dalle_lightning_callbacks"],
             "dalle-lightning-plugins": ["dalle_lightning_plugins"]}
# distribution -> the project names its wheel's .dist-info folder and the sdist's top folder carry
PROJECT_NAME = {"dalle-lightning": "dalle_lightning", "dalle-lightning-plugins": "dalle_lightning_plugins"}
# distribution -> the folder that holds each top-level package's folder in the repository
SOURCES = {"dalle-lightning": {"dalle_lightning": ROOT, "dalle_lightning_callbacks": ROOT / "callbacks"},
           "dalle-lightning-plugins": {"dalle_lightning_plugins": ROOT / "strategies"}}


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the source tree must not leak in
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Dist]:
    return build_dists(tmp_path_factory.mktemp("dists"))


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


@pytest.mark.slow
def test_each_wheel_installs_names_of_its_own_and_no_tests(dists: dict[str, Dist]) -> None:
    for name, dist in dists.items():
        info = f"{PROJECT_NAME[name]}-{VERSION}.dist-info"
        with zipfile.ZipFile(dist.wheel) as z:
            files = z.namelist()
            assert sorted(z.read(f"{info}/top_level.txt").decode().split()) == TOP_LEVEL[name]
        assert {f.split("/")[0] for f in files} == {*TOP_LEVEL[name], info}
        assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc") or "/tests/" in f
                    or "benchmarks/" in f or f.startswith(("strategies/", "callbacks/"))], name
        assert f"{info}/licenses/LICENSE" in files
        meta = _metadata(dist.wheel)
        assert (meta["Name"], meta["Version"], meta["License-Expression"]) == (name, VERSION, "MIT")
        assert meta["Requires-Python"] and meta["Summary"] and meta["Description-Content-Type"] == "text/markdown"
    root_files = zipfile.ZipFile(dists["dalle-lightning"].wheel).namelist()
    assert {"dalle_lightning_callbacks/ema.py", "dalle_lightning_callbacks/image_files.py",
            "dalle_lightning/conf/train.yaml", "dalle_lightning/conf/strategy/sharded_powersgd.yaml"} <= set(root_files)
    # the benchmarks' comparison with torch's hook stays beside the benchmarks
    assert not [f for f in root_files if "torch_powersgd" in f]
    lean_files = zipfile.ZipFile(dists["dalle-lightning-plugins"].wheel).namelist()
    assert {"dalle_lightning_plugins/__init__.py", "dalle_lightning_plugins/strategies/sharded_powersgd.py",
            "dalle_lightning_plugins/io/atomic_files.py"} <= set(lean_files)
    assert not [f for f in lean_files if f.startswith("dalle_lightning_plugins/") and not f.endswith(".py")]
    with tarfile.open(dists["dalle-lightning-plugins"].sdist) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "VERSION", "dalle_lightning_plugins/strategies/sharded_powersgd.py"} <= names
    with tarfile.open(dists["dalle-lightning"].sdist) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"callbacks/dalle_lightning_callbacks/ema.py", "conf/train.yaml", "dalle_lightning/demo.py"} <= names


@pytest.mark.slow
def test_each_wheel_holds_every_module_of_every_subpackage(dists: dict[str, Dist]) -> None:
    """The packages are laid out by kind (the plugins' strategies/, precision/, compression/, io/, environments/;
    dalle_lightning's run/ beside cli/), and each subpackage is a package the pyproject must declare: one left out
    builds a wheel without it, which imports nowhere but a checkout. Every module of the source tree is in its
    wheel, and the wheel holds no module the tree does not."""
    for name, dist in dists.items():
        source = {f"{top}/{p.relative_to(folder / top).as_posix()}" for top, folder in SOURCES[name].items()
                  for p in (folder / top).rglob("*.py") if "__pycache__" not in p.parts}
        with zipfile.ZipFile(dist.wheel) as z:
            shipped = {f for f in z.namelist() if f.endswith(".py")}
        assert not source - shipped, f"{dist.wheel.name} lacks {sorted(source - shipped)}; declare their packages"
        assert not shipped - source, f"{dist.wheel.name} holds {sorted(shipped - source)}, which the tree does not"
    lean = zipfile.ZipFile(dists["dalle-lightning-plugins"].wheel).namelist()
    kinds = {"strategies", "precision", "compression", "io", "environments"}
    assert {f"dalle_lightning_plugins/{k}/__init__.py" for k in kinds} <= set(lean)
    assert "dalle_lightning/run/__init__.py" in zipfile.ZipFile(dists["dalle-lightning"].wheel).namelist()


@pytest.mark.slow
def test_the_plugins_require_torch_and_lightning_and_the_project_pins_them(dists: dict[str, Dist]) -> None:
    lean = [Requirement(r) for r in _metadata(dists["dalle-lightning-plugins"].wheel).get_all("Requires-Dist")]
    assert sorted(r.name for r in lean) == ["lightning", "torch"]
    root = [Requirement(r) for r in _metadata(dists["dalle-lightning"].wheel).get_all("Requires-Dist")]
    (pin,) = [r for r in root if r.name == "dalle-lightning-plugins"]
    assert str(pin.specifier) == f"=={VERSION}" and pin.marker is None


@pytest.mark.slow
def test_twine_accepts_every_sdist_and_wheel(dists: dict[str, Dist]) -> None:
    files = [f for d in dists.values() for f in (d.sdist, d.wheel)]
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("PASSED") == 4, proc.stdout


@pytest.mark.slow
def test_wheels_install_and_the_console_scripts_run_outside_the_source_tree(tmp_path: Path,
                                                                              dists: dict[str, Dist]) -> None:

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                   .stdout.strip())
    (purelib / "dalle_lightning_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
         *(d.wheel for d in dists.values()), cwd=tmp_path)

    run_dir = tmp_path / "elsewhere"  # neither the source tree nor its copy
    run_dir.mkdir()
    where = _run(python, "-c", "import dalle_lightning_callbacks, dalle_lightning_plugins; "
                 "print(dalle_lightning_callbacks.__file__); print(dalle_lightning_plugins.__file__)",
                 cwd=run_dir).stdout.split()
    assert all(w.startswith(str(purelib)) for w in where), where
    _run(bin_dir / "dalle-data", "out_dir=world", "n_train=16", "n_val=8", "n_zeroshot=0", "shard_size=8",
         "hydra.run.dir=runs/data", cwd=run_dir)
    assert sorted(p.name for p in (run_dir / "world" / "train").glob("*.tar")) == ["000000.tar", "000001.tar"]
    _run(bin_dir / "dalle-train", "stage=dvae", "paths.work_dir=.", "trainer.fast_dev_run=true", "model.n_hid=8",
         "model.vocab_size=32", "model.codebook_dim=16", "data.batch_size=8", "hydra.run.dir=runs/dvae", cwd=run_dir)
    job = _run(bin_dir / "dalle-train", "--cfg", "job", "stage=prior", cwd=run_dir).stdout
    assert "stage:" in job and "name: prior" in job  # the configs come from the wheel's dalle_lightning/conf
    _run(bin_dir / "dalle-train", "stage=tokenizer", "paths.work_dir=.", "stage.max_captions=2",
         "model.vocab_size=260", "hydra.run.dir=runs/tokenizer", cwd=run_dir)
    assert (run_dir / "tokenizer.json").is_file()
