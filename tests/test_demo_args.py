"""The demo's own arguments: which steps, where, and which experiment sizes its training stages."""

from __future__ import annotations

import pytest

from dalle_lightning.demo import parse


def test_experiment_defaults_to_auto_and_names_the_known_ones() -> None:
    assert parse([])["experiment"] == "auto"
    assert parse(["experiment=paper_prior", "steps=prior"])["experiment"] == "paper_prior"
    with pytest.raises(SystemExit, match=r"experiment='shape' is not in conf/experiment; expected auto or one of \[.*'shapes'"):
        parse(["experiment=shape"])


def test_auto_picks_the_longer_experiment_on_a_gpu_and_the_cpu_without_one() -> None:
    from unittest import mock

    from dalle_lightning.demo import experiment_for
    from dalle_lightning.hardware import resolve_device

    assert experiment_for("auto", "cuda") == "shapes_long" and experiment_for("auto", "cpu") == "shapes"
    assert experiment_for("shapes", "cuda") == "shapes"  # asked for: kept
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert resolve_device("auto") == "cpu"
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"


def test_unknown_argument_and_step_are_one_line_errors() -> None:
    with pytest.raises(SystemExit, match="unknown demo argument 'epochs=3'"):
        parse(["epochs=3"])
    with pytest.raises(SystemExit, match=r"unknown demo step\(s\) \['train'\]"):
        parse(["steps=data,train"])


def test_every_training_step_composes_as_the_demo_passes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The prior steps' overrides (the prior, and its run under both plugins) compose into a config, with the paths
    the demo adds: a typo in STEPS fails here, not after the demo's first 10 minutes. (The other steps pass only a
    stage and the timer.)"""
    import subprocess
    import sys

    from dalle_lightning.demo import STEPS

    for step, (module, *overrides) in STEPS.items():
        if not step.startswith("prior"):
            continue
        done = subprocess.run([sys.executable, "-m", module, *overrides, f"paths.work_dir={tmp_path}",
                               "experiment=shapes", "--cfg", "job"], capture_output=True, text=True)
        assert done.returncode == 0, f"{step}: {done.stderr[-800:]}"
        if step == "prior_plugins":  # 2 processes on the CPU, also where the other stages take the one GPU
            assert "devices_per_node: 1" in done.stdout and "batch_size: 16" in done.stdout
            assert "accelerator: cpu" in done.stdout


def test_without_native_bf16_the_side_run_keeps_the_strategy_in_fp32(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from dalle_lightning.demo import STEPS, step_overrides

    assert step_overrides("prior_plugins", native_bf16=True) == (STEPS["prior_plugins"][0], STEPS["prior_plugins"][1:])
    module, overrides = step_overrides("prior_plugins", native_bf16=False)
    assert "precision=fp32" in overrides and "strategy=sharded_powersgd" in overrides
    assert not any(o.startswith("precision.") or o == "precision=resblock16" for o in overrides)
    done = subprocess.run([sys.executable, "-m", module, *overrides, f"paths.work_dir={tmp_path}",
                           "experiment=shapes", "--cfg", "job"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-800:]
    assert "name: 32-true" in done.stdout and "devices_per_node: 1" in done.stdout
    assert step_overrides("dvae", native_bf16=False) == step_overrides("dvae", native_bf16=True)


def test_a_step_reports_the_rate_of_the_run_it_wrote(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from dalle_lightning.demo import metrics_files, training_rate

    old = tmp_path / "runs" / "prior" / "a" / "metrics.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"metrics": {"time/updates_per_s": 9.0}}))
    before = metrics_files(tmp_path)
    new = tmp_path / "runs" / "prior" / "b" / "metrics.json"
    new.parent.mkdir(parents=True)
    new.write_text(json.dumps({"metrics": {"time/updates_per_s": 6.789}}))
    assert training_rate(metrics_files(tmp_path) - before) == 6.79
    assert training_rate(set()) is None  # a step that reused its artifact trained nothing
