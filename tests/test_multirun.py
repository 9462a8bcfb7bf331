"""Multirun sweeps: a real two-point ``dalle-train -m`` on the tiny world with one directory per run and the
automatic summary; a real three-trial Optuna sweep (the ``sweep`` extra); the summary's ordering rules on
hand-written run directories; the opt-in Optuna config.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dalle_lightning.cli import sweep_summary
from tests.conftest import CONF, run_app

TINY_DVAE = ["model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16", "data.batch_size=8", "data.num_workers=0",
             "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv"]


def test_two_point_multirun_writes_one_dir_per_run_and_a_summary(tiny_world: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import train

    sweep_dir = tmp_path / "sweep"
    shared = tiny_world / "dvae.pt"
    before = shared.stat().st_mtime_ns if shared.exists() else None
    # The dvae_grid sweep file (its own callback and per-run outputs); the command line narrows it to 2 runs.
    run_app(train.main, "-m", "stage=dvae", "+sweep=dvae_grid", f"paths.work_dir={tiny_world}", "trainer.max_steps=2",
            "+trainer.limit_train_batches=2", "trainer.limit_val_batches=1", *TINY_DVAE,
            "module.optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep_dir}")
    runs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert runs == ["0", "1"]
    written = {}
    for run in runs:
        blob = json.loads((sweep_dir / run / "metrics.json").read_text())
        assert (sweep_dir / run / "dvae.pt").is_file()  # each run's own model
        lr = next(o for o in blob["overrides"] if o.startswith("module.optimizer.lr="))
        written[float(lr.split("=")[1])] = blob["metrics"]["val/loss"]
    assert set(written) == {1e-3, 3e-3}
    assert (shared.stat().st_mtime_ns if shared.exists() else None) == before  # the shared artifact is untouched

    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["metric"] == "val/loss" and summary["mode"] == "min"
    assert summary["swept"] == ["module.optimizer.lr"]
    values = [row["value"] for row in summary["runs"]]
    assert values == sorted(written.values())
    assert {float(row["params"]["module.optimizer.lr"]): row["value"] for row in summary["runs"]} == written
    assert summary["best"]["value"] == min(written.values())
    assert (sweep_dir / "summary.txt").read_text().splitlines()[0].split() == ["rank", "run", "module.optimizer.lr", "val/loss"]


def _run(sweep: Path, name: str, overrides: list[str], metrics: dict | None) -> None:
    run_dir = sweep / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps({"overrides": overrides, "metrics": metrics}))


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    _run(sweep, "0", ["stage=dvae", "lr=1", "w=8"], {"val/loss": 0.5, "val/psnr": 20.0})
    _run(sweep, "1", ["stage=dvae", "lr=2", "w=8"], {"val/loss": 0.2, "val/psnr": 25.0})
    _run(sweep, "2", ["stage=dvae", "lr=3", "w=16"], None)  # crashed before writing metrics
    _run(sweep, "10", ["stage=dvae", "lr=4", "w=16"], {"val/loss": math.nan, "val/psnr": 30.0})
    return sweep


def test_summary_sorts_best_first_with_failed_and_nan_last(tmp_path: Path) -> None:
    s = sweep_summary.summarize(_sweep(tmp_path))
    assert s["metric"] == "val/loss" and s["swept"] == ["lr", "w"]
    assert [r["run"] for r in s["runs"][:2]] == ["1", "0"] and s["best"]["run"] == "1"
    assert {r["run"] for r in s["runs"][2:]} == {"2", "10"}
    assert next(r for r in s["runs"] if r["run"] == "2")["status"] == "failed"


def test_summary_follows_the_optuna_direction_and_an_explicit_metric(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path)
    (sweep / "multirun.yaml").write_text("objective: val/psnr\nhydra:\n  sweeper:\n    direction: maximize\n")
    s = sweep_summary.summarize(sweep)
    assert s["metric"] == "val/psnr" and s["mode"] == "max"
    assert [r["run"] for r in s["runs"][:3]] == ["10", "1", "0"]
    assert sweep_summary.summarize(sweep, metric="val/loss", mode="min")["best"]["run"] == "1"
    with pytest.raises(KeyError, match="val/acc"):
        sweep_summary.summarize(sweep, metric="val/acc")


def test_summary_command_prints_a_table_and_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sweep = _sweep(tmp_path)
    assert sweep_summary.main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "run", "lr", "w", "val/loss"] and lines[1].split()[:2] == ["1", "1"]
    assert (sweep / "summary.json").is_file()
    assert sweep_summary.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]


@pytest.mark.slow
def test_optuna_sweep_runs_three_trials_and_writes_the_summary(tiny_world: Path, tmp_path: Path) -> None:
    from dalle_lightning.cli import train

    sweep_dir = tmp_path / "optuna"
    tiny = [o for o in TINY_DVAE if not o.startswith("model.n_hid=")]
    # The real plugin and the real search space of conf/sweep/dvae_optuna.yaml, narrowed to 3 trials of tiny widths.
    # EMA is off: it starts averaging at step 100, so a 2-step run would otherwise save (and score) its initial weights.
    run_app(train.main, "-m", "stage=dvae", "+sweep=dvae_optuna", f"paths.work_dir={tiny_world}", "trainer.max_steps=2",
            "+trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "~callbacks.ema", *tiny,
            "hydra.sweeper.n_trials=3", "model.n_hid=choice(8,16)", f"hydra.sweep.dir={sweep_dir}")
    written = {}
    for run in sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        blob = json.loads((sweep_dir / run / "metrics.json").read_text())
        params = dict(o.split("=", 1) for o in blob["overrides"])
        assert 1e-4 <= float(params["module.optimizer.lr"]) <= 1e-2 and params["model.n_hid"] in {"8", "16"}
        written[run] = blob["metrics"]["val/loss"]
    assert len(written) == 3

    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["metric"] == "val/loss" and summary["mode"] == "min"  # the objective and Optuna's direction
    assert len(summary["runs"]) == 3 and all(row["status"] == "ok" for row in summary["runs"])
    assert {row["run"]: row["value"] for row in summary["runs"]} == written
    assert [row["value"] for row in summary["runs"]] == sorted(written.values())
    assert set(summary["swept"]) <= {"module.optimizer.lr", "model.n_hid"} and "module.optimizer.lr" in summary["swept"]
    # Optuna's own record of the study agrees on the best trial.
    optuna_best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert summary["best"]["value"] == pytest.approx(optuna_best.best_value, rel=1e-12)
    assert float(summary["best"]["params"]["module.optimizer.lr"]) == pytest.approx(
        optuna_best.best_params["module.optimizer.lr"], rel=1e-12)


def test_optuna_sweep_config_selects_the_plugin_and_its_search_space(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert compose("train", overrides=[f"paths.work_dir={tmp_path}"], return_hydra_config=True
                       ).hydra.runtime.choices["hydra/sweeper"] == "basic"  # opt-in: the default stays Hydra's own
        cfg = compose("train", overrides=["+sweep=dvae_optuna"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices["hydra/sweeper"] == "optuna"
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.hydra.sweeper.n_trials == 12
    assert dict(cfg.hydra.sweeper.params) == {"module.optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
                                              "model.n_hid": "choice(16, 32, 64)"}
    assert cfg.objective == "val/loss" and "sweep_summary" in cfg.hydra.callbacks
