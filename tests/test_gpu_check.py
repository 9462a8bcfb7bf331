"""``benchmarks/gpu.py --all`` (``benchmarks/_gpu_check.py``): the GPU check's steps, each in its own process and
time budget, into one summary; a step that fails leaves the others to run.

On the CPU the check runs with ``--smoke`` (tiny shapes; the CUDA tests are collected and skipped). Here the demo
step is given half a second, so it is killed, as a hung step on a GPU would be, and the summary must record it with
its last lines while the four other steps run to their end (the memory step as on one GPU: a world of 1, so
``devices_per_node=2`` is reported as skipped). The targets are read from made-up figures in a unit test, so their
comparisons are checked without a GPU. Without CUDA (``CUDA_VISIBLE_DEVICES=""`` hides any GPU), the memory step
is skipped in one line and fails nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWO_ROWS = ["prior_353M_flex_plugin_bf16_eager", "prior_353M_flex_lightning_bf16_eager"]


def gpu_check():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_killed_step_leaves_the_others_run_and_the_summary_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--all", "--smoke", "--out-dir", str(out),
                           "--demo-dir", str(tmp_path / "demo"), "--budget", "demo=0.5", "--training-rows", *TWO_ROWS,
                           "--memory-rows", "dpn1", "dpn2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # a step failed: exit 1
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["failed_steps"] == ["demo"], (last, done.stdout[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert last["summary"] == str(out / "summary.json")
    assert list(summary["steps"]) == ["cuda_tests", "training", "sampling", "memory", "demo"]
    for name, step in summary["steps"].items():
        assert {"status", "returncode", "seconds", "budget_s", "command", "log"} <= set(step)
        assert Path(step["log"]) == out / f"{name}.log" and Path(step["log"]).is_file()
    demo = summary["steps"]["demo"]
    assert demo["status"] == "timed_out" and demo["budget_s"] == 0.5
    assert "killed: over its budget" in demo["tail"][-1] and demo["tail"][0].startswith("$ sh -c ")
    assert summary["figures"]["demo"]["wall_s"] is None  # killed under 180 s: not a measured wall time
    for name in ("cuda_tests", "training", "sampling", "memory"):
        assert summary["steps"][name]["status"] == "ok", summary["steps"][name].get("tail")
    assert summary["smoke"] and summary["strict_fast_paths"] and not summary["targets_judged"]
    assert summary["all_targets_met"] is None
    assert summary["device"]["device"] == "cpu"

    tests = summary["figures"]["cuda_tests"]
    assert tests["passed"] == tests["failed"] == tests["error"] == 0 and tests["skipped"] >= 8  # no CUDA here
    assert "tests/test_graph_decode.py::test_the_replayed_graph_draws_the_eager_tokens_on_cuda[1.0]" in tests["outcomes"]
    assert "tests/test_sparse_attention.py::test_flex_on_cuda_matches_dense_forward_and_backward[row]" in tests["outcomes"]
    training = summary["figures"]["training"]
    assert list(training["rows"]) == TWO_ROWS and all(r["step_ms"] > 0 for r in training["rows"].values())
    assert list(training["plugin_over_lightning"]) == ["prior_353M_flex_bf16_eager"]
    assert training["last_line"]["recompile_limit_messages"] == [] and training["last_line"]["failed_rows"] == []
    sampled = summary["figures"]["sampling"]["rows"]
    assert list(sampled) == ["sample_tiny_b4_eager"] and sampled["sample_tiny_b4_eager"]["images_per_s"] > 0
    memory = summary["figures"]["memory"]
    assert memory["world"] == 1 and memory["device"] == "cpu" and memory["errors"] == {}
    assert list(memory["rows"]) == ["dpn1", "dpn2"]
    assert memory["rows"]["dpn2"] == {"skipped": "devices_per_node 2 does not divide the world of 1"}
    dpn1 = memory["rows"]["dpn1"]
    assert dpn1["P_bytes"] == 4 * 2 * (64 * 64 + 64)  # two Linear(64, 64): the model's fp32 bytes
    assert len(dpn1["steps"]) == len(dpn1["fit_bytes"]) == 1 and dpn1["whole_after"]
    assert 0 < dpn1["steps_bytes"][0] <= dpn1["fit_bytes"][0] and 0 < dpn1["steps"][0] <= dpn1["fit"][0]
    names = [t["target"] for t in summary["targets"]]
    assert "plugin_over_lightning[prior_353M_flex_bf16_eager]" in names and "demo_wall_s" in names
    for t in summary["targets"]:
        assert set(t) == {"target", "step", "want", "value", "met", "issue"}


def test_targets_read_the_figures_the_gpu_issues_asked_for(tmp_path: Path) -> None:
    check = gpu_check()
    rows = "\n".join(json.dumps(r) for r in [
        {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "bf16_peak_tflop_s": 790.0},
        {"row": "prior_353M_flex_plugin_bf16_eager", "step_ms": 153.0, "fraction_of_peak": 0.33},
        {"row": "prior_353M_flex_lightning_bf16_eager", "step_ms": 150.0, "fraction_of_peak": 0.33},
        {"row": "dvae_paper_plugin_bf16_eager", "step_ms": 300.0, "fraction_of_peak": 0.2},
        {"row": "dvae_paper_lightning_bf16_eager", "step_ms": 280.0, "fraction_of_peak": 0.2},
        {"row": "prior_353M_flex_plugin_bf16_compiled", "step_ms": 100.0, "fraction_of_peak": 0.51, "compile_s": 40.0},
        {"row": "prior_1.3B_flex_plugin_bf16_compiled", "error": "FlexRecompileError: recompile limit (8) hit"},
        {"graphs": {"flex_attention": 2}, "recompile_limit_messages": [], "unfused_fallback_warnings": [],
         "skipped_rows": [], "failed_rows": ["prior_1.3B_flex_plugin_bf16_compiled"]},
    ])
    work = tmp_path / "demo"
    work.mkdir()
    (work / "demo.json").write_text(json.dumps({"device": "cuda (NVIDIA H200)", "experiment": "shapes_long",
                                                "total_s": 170.0, "updates_per_s": {"dvae": 160.0, "clip": 90.0}}))
    (work / "eval.json").write_text(json.dumps({"seen": {"1": {"accuracy": 0.6}, "16": {"accuracy_clip": 0.8,
                                                                                        "any_of_n": 0.9}},
                                                "zeroshot": {"16": {"accuracy_clip": 0.38}}}))
    figures = {
        "cuda_tests": check.cuda_test_figures("tests/test_a.py::test_x PASSED [ 50%]\n"
                                              "tests/test_a.py::test_y FAILED [100%]\n"),
        "training": check.figures_of("training", rows, work),
        "sampling": check.figures_of("sampling", "\n".join(json.dumps(r) for r in [
            {"row": "sample_demo_b64_eager", "images_per_s": 900.0, "times_the_bound": 9.0},
            {"row": "sample_demo_b64_graphs", "images_per_s": 2500.0, "times_the_bound": 2.0,
             "same_tokens_as_eager": True}]), work),
        "demo": check.figures_of("demo", "== device: cuda (NVIDIA H200); experiment=shapes_long\n== data: 9.5 s\n", work),
    }
    figures["demo"]["wall_s"] = 175.0
    met = {t["target"]: t["met"] for t in check.targets(figures)}
    assert met["cuda_tests_failed"] is False
    assert met["plugin_over_lightning[prior_353M_flex_bf16_eager]"] is True  # 1.02
    assert met["plugin_over_lightning[dvae_paper_bf16_eager]"] is False  # 1.07
    assert met["fraction_of_peak[prior_353M_flex_plugin_bf16_compiled]"] is True
    assert met["fraction_of_peak[prior_1.3B_flex_plugin_bf16_compiled]"] is None  # the row failed: not measured
    assert met["recompile_limit_hits"] is False  # strict mode turned the hit into the row's error
    assert met["unfused_fallbacks"] is True
    assert met["images_per_s[sample_demo_b64]"] is True and met["times_the_bound[sample_demo_b64]"] is True
    assert met["same_tokens_as_eager[sample_demo_b64_graphs]"] is True
    assert met["images_per_s[sample_353M_b16]"] is None  # not measured
    assert met["demo_wall_s"] is True
    assert met["demo_clip_pick_of_16[seen]"] is True and met["demo_clip_pick_of_16[zeroshot]"] is False
    assert met["demo_updates_per_s[dvae]"] is True and met["demo_updates_per_s[clip]"] is False
    assert met["demo_updates_per_s[prior]"] is None
    assert figures["demo"]["stage_s"] == {"data": 9.5} and figures["demo"]["accuracy"]["seen"]["best_of_1"] == 0.6
    assert figures["training"]["compile_s"] == {"prior_353M_flex_plugin_bf16_compiled": 40.0}
    assert check.all_met(check.targets(figures)) is False  # one missed
    assert check.all_met([{"met": True}, {"met": None}]) is None and check.all_met([{"met": True}]) is True
    stale = check.figures_of("demo", "", work, since=(work / "demo.json").stat().st_mtime + 60)
    assert "total_s" not in stale and "accuracy" not in stale  # files an earlier run left: not this run's figures


def test_the_cuda_tests_are_found_by_their_markers() -> None:
    files = gpu_check().cuda_test_files()
    for name in ("test_sparse_attention.py", "test_graph_decode.py", "test_resblock_precision.py",
                 "test_flex_recompiles.py", "test_exchange_cuda.py"):
        assert f"tests/{name}" in files
    assert "tests/test_gpu_check.py" not in files and "tests/test_prior.py" not in files


def test_without_cuda_the_memory_step_is_skipped_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "benchmarks/gpu.py", "--all", "--only", "memory", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["failed_steps"] == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["memory"]["status"] == "skipped"
    assert summary["figures"]["memory"]["skipped"].startswith("no CUDA device")
    assert summary["figures"]["memory"]["rows"] == {}
    said = (tmp_path / "memory.log").read_text().splitlines()
    assert said[0].startswith("$ ") and len(said) == 2 and "no CUDA device" in said[1]  # the command, then one line
    assert "[gpu_check] memory: skipped in" in done.stdout


def test_the_memory_figures_are_each_rank_s_peak_or_why_not() -> None:
    check = gpu_check()
    lines = [{"row": "ddp", "steps": [5.1, 5.1], "steps_bytes": [580000000, 580000000]},
             {"row": "dpn2", "error": "RuntimeError: NCCL error"},
             {"model": "12 x Linear(1536, 1536) + ReLU, Adam", "device": "cuda", "world": 2,
              "measure": "torch.cuda.max_memory_allocated after reset_peak_memory_stats", "rows": {}}]
    figures = check.figures_of("memory", "noise\n" + "\n".join(json.dumps(line) for line in lines), ROOT)
    assert figures["rows"] == {"ddp": {"steps": [5.1, 5.1], "steps_bytes": [580000000, 580000000]},
                               "dpn2": {"error": "RuntimeError: NCCL error"}}
    assert figures["errors"] == {"dpn2": "RuntimeError: NCCL error"}
    assert figures["world"] == 2 and figures["measure"].startswith("torch.cuda.max_memory_allocated")
    assert "skipped" not in figures
