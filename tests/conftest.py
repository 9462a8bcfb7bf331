"""Shared fixtures: run the real Hydra apps in-process, and a tiny shapes-world pipeline on disk."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


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
