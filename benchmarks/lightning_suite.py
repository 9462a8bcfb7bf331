"""Lightning's own test suite (``tests/tests_pytorch`` of its public repository) against ShardedPowerSGDStrategy.

Issue 61, deliverable 6: no Lightning test code is copied into the project. Check out Lightning's repository at the
tag nearest the installed version (2.6.5 for lightning 2.6.6; ``git archive 2.6.5 tests | tar -x -C PATH``) and run::

    .venv/bin/python benchmarks/lightning_suite.py --lightning-src /work/lightning-src \
        [--pythonpath /work/lightning-deps] [--timeout 180] [--jobs 1] [ID ...]

Every test id runs in its own ``python -m pytest ID`` process, twice, with no assertion changed:

* ``ddp``: as written, on 2 CPU processes with gloo;
* ``strategy``: the same, but every ``strategy="ddp"``, ``strategy="ddp_spawn"`` (and their
  ``_find_unused_parameters_true/false`` names) and plain ``DDPStrategy(...)`` (its exact class, not a test's
  subclass) that reaches Lightning's ``_AcceleratorConnector`` becomes
  ``ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[torch.nn.Linear])``.

``"ddp_spawn"`` is swapped too: the strategy is meant to stand in for Lightning's data-parallel strategy whatever
launcher a test picked, and most of Lightning's CPU data-parallel tests are written with ``"ddp_spawn"``; a test that
checks the spawn launcher itself (results sent back through the spawn queue, ``isinstance(..., DDPStrategy)``) then
fails for that reason, which the first error line shows. Each id's record says which requests were swapped
(``swapped``); an id with none swapped ran ``ddp`` twice and is counted apart (``strategy_not_exercised``).

In both modes, so that the two stay comparable on a machine without GPUs: ``RunIf(min_cuda_gpus=N)`` and
``RunIf(standalone=True)`` no longer skip, ``accelerator="gpu"``/``"cuda"`` becomes ``"cpu"`` and a device list
``[0, 1]`` becomes its length. A test that needs a real GPU for another reason fails in both modes and is left out
of the comparison.

This file is also the pytest plugin the runs load (``-p lightning_suite``, ``LIGHTNING_SUITE_MODE`` set): the patches
are made when pytest imports it, in the test process and in every process Lightning launches from it (those rerun
the same pytest command line). Prints one JSON object: per id each mode's outcome and the first error line of a
failure; totals.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODE_ENV = "LIGHTNING_SUITE_MODE"
REPORT_ENV = "LIGHTNING_SUITE_REPORT"

# Known from the earlier study (the strategy failed these where ddp passed, or they needed the swap on CPU).
KNOWN_IDS = [
    "tests_pytorch/strategies/test_ddp_integration.py::test_multi_gpu_model_ddp_spawn",
    "tests_pytorch/strategies/test_ddp_integration.py::test_multi_gpu_early_stop_ddp_spawn",
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_gradients_synced[True-True]",
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_gradients_synced[False-False]",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py::"
    "test_step_with_optimizer_closure_with_different_frequencies_ddp",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_top_k_ddp[1-1-1.0-1]",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_top_k_ddp[2-2-0.3-4]",
    "tests_pytorch/checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py::test_manual_optimization_and_return_tensor",
]

# Distributed/strategy-relevant ids of tests_pytorch that run on 2 CPU processes.
SELECTED_IDS = [
    # strategies/test_ddp*.py, models
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_gradients_synced[True-False]",
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_gradients_synced[False-True]",
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_cpu",
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception",
    "tests_pytorch/strategies/test_ddp_integration.py::test_ddp_all_dataloaders_passed_to_fit",
    "tests_pytorch/strategies/test_ddp_integration.py::test_multi_gpu_model_ddp_fit_only",
    "tests_pytorch/strategies/test_ddp_integration.py::test_multi_gpu_model_ddp_test_only",
    "tests_pytorch/strategies/test_ddp_integration.py::test_multi_gpu_model_ddp_fit_test",
    "tests_pytorch/models/test_hooks.py::test_transfer_batch_hook_ddp",
    # trainer connectors
    "tests_pytorch/trainer/connectors/test_data_connector.py::test_replace_distributed_sampler[1]",
    "tests_pytorch/trainer/connectors/test_data_connector.py::test_replace_distributed_sampler[2]",
    "tests_pytorch/trainer/connectors/test_data_connector.py::test_dataloader_reinit_for_subclass",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py::test_strategy_choice_ddp_spawn_cpu",
    "tests_pytorch/trainer/properties/test_get_model.py::test_get_model_ddp_cpu",
    # checkpointing with ddp
    "tests_pytorch/checkpointing/test_torch_saving.py::test_model_torch_save_ddp_cpu",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py::test_model_checkpoint_ddp_monitor_none",
    # logging sync_dist
    "tests_pytorch/trainer/logging_/test_distributed_logging.py::test_all_rank_logging_ddp_cpu",
    "tests_pytorch/trainer/logging_/test_distributed_logging.py::test_all_rank_logging_ddp_spawn",
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py::test_logging_sync_dist_true[2-cpu]",
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py::test_logging_sync_dist_true_ddp",
    "tests_pytorch/utilities/test_all_gather_grad.py::test_all_gather_ddp_spawn",
    # manual optimization ddp
    "tests_pytorch/trainer/optimization/test_manual_optimization.py::"
    "test_step_with_optimizer_closure_with_different_frequencies_ddp_spawn",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py::"
    "test_step_with_optimizer_closure_with_different_frequencies_ddp_with_toggle_model",
    # early stopping ddp
    "tests_pytorch/callbacks/test_early_stopping.py::test_multiple_early_stopping_callbacks[callbacks2-2-False-ddp_spawn-2-2]",
    "tests_pytorch/callbacks/test_early_stopping.py::test_multiple_early_stopping_callbacks[callbacks7-3-True-ddp_spawn-2-None]",
    # other callbacks and loops that run under ddp
    "tests_pytorch/callbacks/test_pruning.py::test_pruning_callback_ddp_cpu",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py::test_swa_callback_ddp_cpu",
    "tests_pytorch/trainer/flags/test_overfit_batches.py::test_distributed_sampler_with_overfit_batches",
    "tests_pytorch/trainer/test_trainer.py::test_fit_test_synchronization",
    "tests_pytorch/trainer/test_trainer.py::test_trainer_predict_ddp_spawn[cpu]",
    "tests_pytorch/overrides/test_distributed.py::test_params_synced_during_nonfit",
    "tests_pytorch/profilers/test_profiler.py::test_simple_profiler_distributed_files",
    "tests_pytorch/trainer/test_dataloaders.py::test_distributed_sampler_without_global_seed",
]

# Lightning's own weight averaging under data parallelism (issue 66: it crashed at its first update under the
# strategy at devices_per_node > 1), a plain fit and one resumed after a crash.
WEIGHT_AVERAGING_IDS = [
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_ddp",
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_ddp_spawn",
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_ddp_spawn_cpu",
    "tests_pytorch/callbacks/test_weight_averaging.py::test_ema_resume_ddp",
]

DEFAULT_IDS = KNOWN_IDS + SELECTED_IDS + WEIGHT_AVERAGING_IDS

# Lightning's registered names for plain DDPStrategy with the popen or spawn launcher ("ddp_fork"/"ddp_notebook",
# whose fork launcher the strategy does not offer, are kept).
SWAPPED_NAMES = {
    "ddp", "ddp_spawn",
    "ddp_find_unused_parameters_false", "ddp_find_unused_parameters_true",
    "ddp_spawn_find_unused_parameters_false", "ddp_spawn_find_unused_parameters_true",
}


# ---------------------------------------------------------------------------------------------- pytest plugin side


def _install_patches(mode: str) -> None:
    import torch
    import lightning.pytorch.utilities.testing as pl_testing
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors import accelerator_connector as ac

    original_reasons = pl_testing._runif_reasons

    def runif_reasons(**kwargs):
        kwargs["min_cuda_gpus"] = 0  # the gpu accelerator is remapped to 2 CPU processes below
        kwargs["standalone"] = False  # every id runs in its own process anyway
        return original_reasons(**kwargs)

    pl_testing._runif_reasons = runif_reasons

    original_init = ac._AcceleratorConnector.__init__

    def init(self, *args, **kwargs):
        names = ["devices", "num_nodes", "accelerator", "strategy"]
        for name, value in zip(names, args):
            kwargs[name] = value
        args = ()
        accelerator = kwargs.get("accelerator", "auto")
        if isinstance(accelerator, str) and accelerator in ("gpu", "cuda"):
            kwargs["accelerator"] = "cpu"
            devices = kwargs.get("devices", "auto")
            if isinstance(devices, (list, tuple)):
                kwargs["devices"] = len(devices)
            elif devices in (-1, "-1"):
                kwargs["devices"] = 2
            _log({"remapped_accelerator": accelerator})
        strategy = kwargs.get("strategy", "auto")
        if mode == "strategy":
            requested = strategy if isinstance(strategy, str) else type(strategy).__name__
            if (isinstance(strategy, str) and strategy in SWAPPED_NAMES) or type(strategy) is DDPStrategy:
                from dalle_lightning_plugins import ShardedPowerSGDStrategy

                kwargs["strategy"] = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=[torch.nn.Linear])
                _log({"swapped": requested})
            else:
                _log({"kept": requested})
        return original_init(self, *args, **kwargs)

    ac._AcceleratorConnector.__init__ = init


_RANK = os.environ.get("LOCAL_RANK", "0")  # read at import: a test may set LOCAL_RANK itself later


def _log(record: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(f"{path}.rank{_RANK}", "a") as f:
            f.write(json.dumps(record) + "\n")


def _first_error_line(text: str) -> str:
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if line.startswith("E "):
            error = line[1:].strip()
            # a bare "assert False" says little: name the failing source line ("> assert ...") with it
            source = next((s[1:].strip() for s in reversed(lines[:n]) if s.startswith(">")), "")
            if source and len(error) < 60:
                error = f"{error}  [at: {source}]"
            return error[:300]
    for line in reversed(lines):
        if line.strip():
            return line.strip()[:300]
    return ""


if __name__ != "__main__" and os.environ.get(MODE_ENV):
    _install_patches(os.environ[MODE_ENV])

    def pytest_runtest_logreport(report):  # noqa: D103 (pytest hook)
        record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
        if hasattr(report, "wasxfail"):
            record["wasxfail"] = True
        if report.failed or (report.skipped and report.when == "setup"):
            text = report.longreprtext
            record["error"] = _first_error_line(text) if report.failed else text.strip()[-200:]
        _log(record)


# ---------------------------------------------------------------------------------------------- runner side


def _outcome(records: list[dict], rc: int | None) -> tuple[str, str]:
    phases = [r for r in records if "when" in r]
    if rc is None:
        return "timeout", ""
    if not phases:
        return ("not_collected" if rc in (4, 5) else "error"), ""
    for r in phases:
        if r["outcome"] == "failed":
            if r.get("wasxfail"):
                return "xpassed", ""
            return ("failed" if r["when"] == "call" else f"error_{r['when']}"), r.get("error", "")
    if any(r["outcome"] == "skipped" for r in phases):
        which = "xfailed" if any(r.get("wasxfail") for r in phases) else "skipped"
        return which, next((r.get("error", "") for r in phases if r["outcome"] == "skipped"), "")
    return "passed", ""


def _run_one(test_id: str, mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    tests_dir = Path(args.lightning_src, "tests")
    report = workdir / f"{abs(hash((test_id, mode)))}_{mode}"
    env = dict(os.environ)
    env[MODE_ENV] = mode
    env[REPORT_ENV] = str(report)
    paths = [str(Path(__file__).resolve().parent), str(tests_dir), *args.pythonpath]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    for var in ("PL_RUN_STANDALONE_TESTS", "RUN_ONLY_CUDA_TESTS", "LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(var, None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "pytest", test_id, "-p", "lightning_suite", "-q", "-p", "no:cacheprovider",
               "--color=no"]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=tests_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    seconds = round(time.monotonic() - start, 1)
    ranks = {}
    for path in sorted(workdir.glob(report.name + ".rank*")):
        ranks[path.name.rsplit(".rank", 1)[1]] = [json.loads(line) for line in path.read_text().splitlines()]
    outcome, error = _outcome(ranks.get("0", []), rc)
    if outcome == "error" and not error:
        error = _first_error_line(out)
    result = {"outcome": outcome, "seconds": seconds}
    if error:
        result["error"] = error
    for rank, records in ranks.items():
        if rank != "0":
            other, other_error = _outcome(records, 0)
            if other != outcome:
                result[f"rank{rank}"] = other + (f": {other_error}" if other_error else "")
    records = [r for rs in ranks.values() for r in rs]
    if mode == "strategy":
        result["swapped"] = sorted({r["swapped"] for r in records if "swapped" in r})
        kept = sorted({r["kept"] for r in records if "kept" in r})
        if kept:
            result["kept"] = kept
    if any("remapped_accelerator" in r for r in records):
        result["gpu_remapped_to_cpu"] = True
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="test ids relative to <lightning-src>/tests (default: the built-in list)")
    parser.add_argument("--lightning-src", required=True, help="a checkout of Lightning's repository (its tests/)")
    parser.add_argument("--pythonpath", action="append", default=[],
                        help="extra folders for the test processes' PYTHONPATH (test-only deps such as scikit-learn)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per id and mode")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once (each launches 2 ranks)")
    parser.add_argument("--modes", default="ddp,strategy")
    args = parser.parse_args()
    ids = args.ids or DEFAULT_IDS
    modes = args.modes.split(",")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning_suite_") as tmp:
        jobs = [(i, m) for i in ids for m in modes]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {job: pool.submit(_run_one, *job, args, Path(tmp)) for job in jobs}
            results: dict[str, dict] = {i: {} for i in ids}
            for (test_id, mode), future in futures.items():
                results[test_id][mode] = future.result()
                print(f"{mode:8s} {results[test_id][mode]['outcome']:10s} {test_id}", file=sys.stderr, flush=True)

    def count(mode: str, outcome: str) -> int:
        return sum(r.get(mode, {}).get("outcome") == outcome for r in results.values())

    totals = {m: {o: count(m, o) for o in sorted({r[m]["outcome"] for r in results.values() if m in r})}
              for m in modes}
    if {"ddp", "strategy"} <= set(modes):
        ddp_passed = [i for i, r in results.items() if r["ddp"]["outcome"] == "passed"]
        exercised = [i for i in ddp_passed if results[i]["strategy"].get("swapped")]
        totals["ddp_passed"] = len(ddp_passed)
        totals["strategy_not_exercised"] = sorted(set(ddp_passed) - set(exercised))
        totals["strategy_passed_of_ddp_passed_exercised"] = (
            f"{sum(results[i]['strategy']['outcome'] == 'passed' for i in exercised)}/{len(exercised)}")
        totals["strategy_failed_where_ddp_passed"] = [
            i for i in exercised if results[i]["strategy"]["outcome"] != "passed"]
    print(json.dumps({"lightning_src": args.lightning_src, "ids": len(ids), "wall_s": round(time.monotonic() - start, 1),
                      "totals": totals, "results": results}, indent=1))


if __name__ == "__main__":
    main()
