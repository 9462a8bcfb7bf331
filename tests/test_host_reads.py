"""At most one host read per training update in steady state, on every stage (outside the logging interval).

Counted as ``benchmarks/host_reads.py`` counts them: two in-process ``dalle-train`` fits of different lengths
under a dispatch mode, the difference per update, on the tiny pipeline with the progress bar on and Lightning's
logging interval beyond both fits. The one read left is the non-finite guard's skip decision; the progress bar,
the CLIP stage's image check and the dVAE's reconstructions read nothing per update.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.resume_utils import STAGES

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _host_reads():  # noqa: ANN202 - the benchmark module
    spec = importlib.util.spec_from_file_location("benchmark_host_reads", BENCHMARKS / "host_reads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dvae", "clip", "prior"])
def test_one_host_read_per_update(stage: str, resume_work: Path, tmp_path: Path) -> None:
    work = [f"paths.work_dir={resume_work}", "data.batch_size=2", "trainer.enable_model_summary=false",
            f"paths.runs={tmp_path}"]
    result = _host_reads().per_update(work, STAGES[stage], short=3, long=11, log_every=1000)
    assert result["host_reads_per_update"] <= 1.0, result["read_sites"]
    assert any("nonfinite.py" in site for site in result["read_sites"])  # the guard's decision is the one left
