"""``benchmarks/gpu.py --smoke``: the GPU check's every row kind runs on the CPU at a tiny shape and reports JSON lines.

What it checks is the script, not speed: the rows a GPU run measures (the plugin and Lightning's precision in bf16
and fp16, the paper's dVAE, the other attention kernels) each print one well-formed line, and the last line counts
the compiled graphs and finds no recompile-limit message or unfused fallback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_check_smoke_runs_every_eager_row_on_the_cpu() -> None:
    listed = subprocess.run([sys.executable, "gpu.py", "--list"], cwd=BENCHMARKS, capture_output=True, text=True,
                            check=True).stdout.split()
    done = subprocess.run([sys.executable, "gpu.py", "--smoke", "--steps", "1"], cwd=BENCHMARKS, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    header, measured, summary = lines[0], lines[1:-1], lines[-1]
    sampled = [r for r in measured if r["row"].startswith("sample_")]
    measured = [r for r in measured if not r["row"].startswith("sample_")]
    assert [r["row"] for r in sampled] == ["sample_tiny_b4_eager"]  # no graphs without CUDA
    assert sampled[0]["ms_per_token_step"] > 0 and sampled[0]["times_the_bound"] > 0 and sampled[0]["same_tokens_as_eager"]
    assert header["device"] == "cpu" and header["bf16_peak_tflop_s"] > 0
    assert [r["row"] for r in measured] == [name for name in listed if name.endswith("_eager")]
    for r in measured:
        assert r["step_ms"] > 0 and r["fraction_of_peak"] >= 0 and r["model_gflop_per_step"] > 0
        assert ("tokens_per_s" in r) == (r["model"] == "prior")
    assert {"plugin", "lightning"} == {r["precision"] for r in measured}
    assert {"bf16", "fp16"} == {r["dtype"] for r in measured}
    assert summary["recompile_limit_messages"] == [] and summary["unfused_fallback_warnings"] == []
    assert set(summary["graphs"]) == {"flex_attention", "prior.qkv", "prior.out", "prior.mlp", "dvae.res_path"}


def test_gpu_check_names_a_mistyped_row() -> None:
    done = subprocess.run([sys.executable, "gpu.py", "--smoke", "--rows", "prior_9B"], cwd=BENCHMARKS,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "unknown rows ['prior_9B']" in done.stderr
