"""Shared fixtures: run the real Hydra apps in-process, and a tiny shapes-world pipeline on disk; the ``cuda`` skip."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Strict fast paths for the whole suite, and for the processes its tests start (they inherit the environment): a
# compile, capture or fused kernel that fails, or a recompile limit that is hit, raises instead of falling back, so
# no regression hides behind a fallback. Tests of the user's path turn it off with ``strict_fast_paths(False)``.
os.environ.setdefault("DALLE_LIGHTNING_STRICT_FAST_PATHS", "1")  # dalle_lightning_plugins.fast_paths.STRICT_ENV


def run_app(main: Callable[[], Any], *overrides: str) -> None:
    """Call a ``@hydra.main`` app exactly as the console script does, with ``overrides`` as its argv."""
    argv = sys.argv
    sys.argv = ["app", *overrides]
    try:
        main()
    finally:
        sys.argv = argv


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work dir holding a small shapes world (shared by the pipeline tests)."""
    from dalle_lightning.cli import data

    work = tmp_path_factory.mktemp("work")
    run_app(data.main, f"paths.work_dir={work}", "n_train=256", "n_val=64", "n_zeroshot=32", "shard_size=64")
    return work


@pytest.fixture(scope="session")
def resume_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pipeline (40 training samples) on which every stage trains in seconds, for kill-and-resume tests."""
    from tests.resume_utils import build_work

    return build_work(tmp_path_factory.mktemp("resume"))


TINY_DVAE_CONFIG = {"_target_": "dalle_lightning.models.dvae.DiscreteVAE", "image_size": 64, "n_hid": 8,
                    "n_blk_per_group": 1, "vocab_size": 32, "codebook_dim": 16}


def _save_dvae(path: Path, seed: int) -> dict:
    from hydra.utils import instantiate

    from dalle_lightning.artifacts import read_file, save_model

    torch.manual_seed(seed)
    dvae = instantiate(TINY_DVAE_CONFIG)
    blob = save_model(path, TINY_DVAE_CONFIG, dvae, meta={"stage": "dvae", "vocab_size": 32, "grid_size": 8})
    return read_file(blob)["meta"]


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json, two dVAEs of the same shape (dvae.pt, other_dvae.pt) and a prior that records dvae.pt."""
    from hydra.utils import instantiate

    from dalle_lightning.artifacts import save_model
    from dalle_lightning.lineage import dvae_record, tokenizer_record
    from dalle_lightning.data.tokenizer import CaptionTokenizer
    from dalle_lightning.world.scene import sample_captions

    work = tmp_path_factory.mktemp("artifacts")
    tok = CaptionTokenizer.train(sample_captions(0, "train", 200), vocab_size=300, text_len=20)
    tok.save(work / "tokenizer.json")
    dvae_meta = _save_dvae(work / "dvae.pt", seed=0)
    _save_dvae(work / "other_dvae.pt", seed=1)
    prior_cfg = {"_target_": "dalle_lightning.models.prior.DallePrior", "text_vocab_size": tok.vocab_size,
                 "text_len": 20, "image_vocab_size": 32, "image_grid": 8, "n_layer": 2, "n_head": 2, "d_head": 8}
    prior = instantiate(prior_cfg)
    trained_with = {"dvae": dvae_record(dvae_meta),
                    "tokenizer": tokenizer_record(work / "tokenizer.json", tok.vocab_size)}
    save_model(work / "prior.pt", prior_cfg, prior, meta={"stage": "prior", "trained_with": trained_with})
    save_model(work / "legacy_prior.pt", prior_cfg, prior, meta={"stage": "prior"})  # written before records
    return work


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """Every test runs torch on one intra-op thread. The models here are tiny, so thread start-up costs more than
    it saves, and on the shared 2-core machine two threads per process contend with every other process: a tiny
    dVAE training test then takes seconds instead of half a second. Session-wide, so module fixtures run on one
    thread too; worker processes set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def restore_rank_zero() -> Iterator[None]:
    """A strategy set up in this process (mocked or with a fake environment) sets Lightning's process-wide
    ``rank_zero_only.rank``; put it back, so that later tests do not run as rank 1 (the apps that run on rank 0
    only would then do nothing)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    before = getattr(rank_zero_only, "rank", None)
    yield
    if before is None:
        if hasattr(rank_zero_only, "rank"):
            del rank_zero_only.rank
    else:
        rank_zero_only.rank = before


# Multi-process files that mostly wait (link outages, collective timeouts, restarts): their own unit, so they run
# beside the other multi-process files instead of after them. Two processes at a time, one thread each.
MOSTLY_WAITING = {"test_two_namespaces.py"}


@functools.cache
def runs_processes(test_file: Path) -> bool:
    """Whether a test file has ``distributed`` tests (2-4 processes each), read from its source, and is not one
    of those that mostly wait."""
    return "mark.distributed" in test_file.read_text() and test_file.name not in MOSTLY_WAITING


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``make test`` runs two pytest-xdist workers with ``--dist loadfile``: a test file is one unit (its module
    fixtures are built once), and every file that starts processes joins one unit, so those files run one after
    another on one worker while the other runs the single-process files: at most one multi-process test at a
    time on the 2 cores. (pytest-xdist's own ``loadgroup`` marks do not reach its scheduler under pytest 9.2.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ProcessesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = super()._split_scope(nodeid)
            return "multi-process" if runs_processes(config.rootpath / test_file) else test_file

    return ProcessesTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``cuda``-marked tests on machines without enough GPUs, so they can live beside the CPU tests."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        needed = int(marker.kwargs.get("devices", 1))
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {available}"))
