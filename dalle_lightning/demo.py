"""``make demo``: the whole pipeline on the embedded shapes world, each step a real command-line call.

Steps: shapes world -> tokenizer -> dVAE -> token shards -> CLIP -> prior (and a short run of it under the Strategy
and the Precision plugin on 2 processes, timed against it) -> generated grid + caption accuracy. Each step reuses what an earlier run already wrote (pass ``force=true`` to retrain everything).
Prints each step's wall time and where its outputs are, and writes them to ``<out_dir>/demo.json``.

Usage: ``python -m dalle_lightning.demo [out_dir=outputs/demo] [force=true] [steps=data,tokenizer,dvae]
[experiment=auto]``; ``experiment`` sizes the training stages (``conf/experiment/``: ``shapes``, or ``shapes_long``,
the same pipeline trained longer); ``auto``, the default, is ``shapes_long`` where a GPU trains it and ``shapes`` on
the CPU. Every stage runs on one GPU where CUDA sees one (``trainer=auto``, ``device=auto``), on the CPU elsewhere;
the demo prints which.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from dalle_lightning.cli.common import CONF_DIR
from dalle_lightning.hardware import auto_precision, native_bf16, resolve_device
from dalle_lightning_plugins.io.atomic_files import write_json

# training updates per second, in metrics.json
TIMER = "+callbacks.step_timer._target_=dalle_lightning_callbacks.step_timer.StepTimer"
STEPS: dict[str, list[str]] = {
    "data": ["dalle_lightning.cli.data"],
    "tokenizer": ["dalle_lightning.cli.train", "stage=tokenizer"],
    "dvae": ["dalle_lightning.cli.train", "stage=dvae", TIMER],
    "encode": ["dalle_lightning.cli.encode"],
    "clip": ["dalle_lightning.cli.train", "stage=clip", TIMER],
    "prior": ["dalle_lightning.cli.train", "stage=prior", TIMER],
    # The same stage for a few updates under the project's Strategy and Precision plugin, on 2 processes (2 simulated
    # nodes of 1 device, PowerSGD between them, per-resblock bf16 scales, 16 per process: the prior's global batch),
    # so the demo exercises them end to end and reports their rate against the prior's. A side run, not the demo's
    # prior: trained that way, the prior reached val loss 0.635 instead of 0.514 at 1,700 updates, at 0.83 of the
    # single process's updates/s (docs/results.md).
    "prior_plugins": ["dalle_lightning.cli.train", "stage=prior", TIMER, "strategy=sharded_powersgd",
                      "strategy.devices_per_node=1", "trainer.devices=2", "precision=resblock16", "precision.dtype=bf16",
                      "data.batch_size=16", "trainer.max_steps=80", "callbacks.fid=null", "callbacks.sample_grid=null",
                      "output=${paths.work_dir}/prior_plugins.pt", "trainer.accelerator=cpu"],
    "generate": ["dalle_lightning.cli.generate"],
    # 50 + 50 fresh captions, best of up to 16: a fraction of the dalle-eval defaults' time (docs/results.md)
    "eval": ["dalle_lightning.cli.evaluate", "n_seen=50", "n_zeroshot=50", "candidates=[1,2,4,8,16]"],
}
FORCE_KEY = {"data": "force", "encode": "force", "generate": None, "eval": None}
# Where the CPU has no native bf16 (AVX2 only: bf16 products 100-160x slower than fp32, dalle_lightning/hardware.py),
# 16-bit branches would turn the side run's minute into an hour: it keeps the Strategy and trains in fp32.
EMULATED_BF16 = {"precision=resblock16": "precision=fp32", "precision.dtype=bf16": None}


def step_overrides(step: str, native_bf16: bool) -> tuple[str, list[str]]:
    """The module and overrides of a demo step on this machine (see ``EMULATED_BF16``)."""
    module, *overrides = STEPS[step]
    if not native_bf16:
        overrides = [EMULATED_BF16.get(o, o) for o in overrides if EMULATED_BF16.get(o, o) is not None]
    return module, overrides


def parse(argv: list[str]) -> dict[str, str]:
    args = {"out_dir": "outputs/demo", "force": "false", "steps": ",".join(STEPS), "experiment": "auto"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in args:
            raise SystemExit(f"error: unknown demo argument {item!r}; expected out_dir=..., force=true|false, "
                             "steps=a,b, experiment=NAME")
        args[key] = value
    experiments = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
    if args["experiment"] not in experiments + ["auto"]:
        raise SystemExit(f"error: experiment={args['experiment']!r} is not in conf/experiment; expected auto or one "
                         f"of {experiments}")
    unknown = [s for s in args["steps"].split(",") if s not in STEPS]
    if unknown:
        raise SystemExit(f"error: unknown demo step(s) {unknown}; expected some of {list(STEPS)}")
    return args


def experiment_for(requested: str, device: str) -> str:
    """``auto``: ``shapes_long`` where a GPU trains it (it has the time), ``shapes`` on the CPU; else as asked."""
    if requested != "auto":
        return requested
    return "shapes_long" if device.startswith("cuda") else "shapes"


def metrics_files(work: Path) -> set[Path]:
    return set(work.glob("runs/*/*/metrics.json"))


def training_rate(new_runs: set[Path]) -> float | None:
    """Updates per second of the training run a demo step just wrote (its metrics.json; validation excluded): the
    time per step, which the step's wall time mixes with start-up, validation and evaluation. None if it reused."""
    for run in sorted(new_runs):
        rate = json.loads(run.read_text()).get("metrics", {}).get("time/updates_per_s")
        if rate is not None:
            return round(float(rate), 2)
    return None


def waterfall_lines(work: Path) -> dict[str, str]:
    """Per split, the waterfall line of the demo's eval.json (empty when there is none): where the accuracy goes."""
    path = work / "eval.json"
    if not path.is_file():
        return {}
    from dalle_lightning.evaluation.waterfall import waterfall_line

    report = json.loads(path.read_text())
    return {split: waterfall_line(report[split]["waterfall"]) for split in ("seen", "zeroshot")
            if "waterfall" in report.get(split, {})}


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    work = Path(args["out_dir"]).resolve()
    force = args["force"].lower() == "true"
    timings: dict[str, float] = {}
    rates: dict[str, float] = {}
    native = native_bf16("cpu")
    device = resolve_device("auto")
    args["experiment"] = experiment_for(args["experiment"], device)
    where = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else "cpu"
    print(f"== device: {where}; experiment={args['experiment']}", flush=True)
    if not native and "prior_plugins" in args["steps"].split(","):
        print("== this CPU has no native bf16 (benchmarks/matmul_dtypes.py): every stage trains in fp32, and "
              "prior_plugins runs the Strategy without the Precision plugin", flush=True)
    for step in args["steps"].split(","):
        module, overrides = step_overrides(step, native)
        overrides.append(f"paths.work_dir={work}")
        if module == "dalle_lightning.cli.train":
            overrides.append(f"experiment={args['experiment']}")
        force_key = FORCE_KEY.get(step, "stage.force")
        if force and force_key:
            overrides.append(f"{force_key}=true")
        print(f"== {step}: python -m {module} {' '.join(overrides)}", flush=True)
        start, before = time.perf_counter(), metrics_files(work)
        result = subprocess.run([sys.executable, "-m", module, *overrides])
        timings[step] = round(time.perf_counter() - start, 1)
        if result.returncode != 0:
            raise SystemExit(f"error: demo step {step!r} failed with exit code {result.returncode}")
        rate = training_rate(metrics_files(work) - before)
        if rate is not None:
            rates[step] = rate
        print(f"== {step}: {timings[step]} s" + (f", {rate} updates/s" if rate is not None else ""), flush=True)
    summary = {"work_dir": str(work), "device": where, "experiment": args["experiment"], "wall_time_s": timings,
               "total_s": round(sum(timings.values()), 1), "updates_per_s": rates, "precision": auto_precision(device)}
    if "prior" in rates and "prior_plugins" in rates:
        # the plugins' prior against one process (precision=auto) at the same global batch, this run, this machine
        summary["prior_plugins_vs_one_process"] = round(rates["prior_plugins"] / rates["prior"], 3)
    for name in ("world", "tokenizer.json", "dvae.pt", "tokens", "clip.pt", "prior.pt", "prior_plugins.pt", "samples",
                 "eval.json", "eval_waterfall.png"):
        if (work / name).exists():
            summary.setdefault("outputs", {})[name] = str(work / name)
    grids = sorted(work.glob("runs/dvae/*/recon_*.png")) + sorted(work.glob("runs/dvae/*/**/recon_*.png"))
    if grids:
        summary.setdefault("outputs", {})["reconstruction_grid"] = str(grids[-1])
    waterfall = waterfall_lines(work)
    if waterfall:
        summary["waterfall"] = waterfall
    write_json(work / "demo.json", summary, sort_keys=False)
    print(json.dumps(summary, indent=2))
    for split, line in waterfall.items():
        print(f"waterfall, {split}: {line}")


if __name__ == "__main__":
    main()
