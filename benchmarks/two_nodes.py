"""The demo's prior on 2 nodes x 1 or 2 processes over a real, rate-limited link, as JSON: where the strategy pays.

Two network namespaces on this host joined by a veth pair (``benchmarks/_two_hosts.py``), each end capped with
``tc tbf`` at the rates given; one ``torchrun`` agent per namespace (``--nnodes=2``), gloo bound to the veth end,
one thread per process, running ``dalle-train stage=prior experiment=shapes`` on the demo's artifacts (``make
demo``'s out_dir). Before the runs of each rate a bulk TCP transfer checks what the link really carries.
``--per-node 2`` starts 2 processes per namespace (``trainer.devices=2``): gloo binds to the veth end, so the
traffic between the processes of one node goes to the node's own address, through the namespace's loopback,
and only the traffic between nodes crosses the shaped link.

Methods (``--methods``), each at PowerSGD rank ``--rank`` where it compresses:

- ``ddp``: Lightning's ``ddp``;
- ``hook``: ``ddp`` with torch's ``powerSGD_hook`` (``benchmarks/_torch_powersgd_hook.py``: start at update 2, warm
  start; the runs get the repository root on ``PYTHONPATH``, so that its ``_target_`` imports wherever they start);
- ``strategy``: ``ShardedPowerSGDStrategy`` at ``devices_per_node=1`` (the exchange overlapped with the backward);
- ``strategy_end``: the same with ``strategy.overlap=false`` (the whole exchange after the backward);
- ``strategy_auto``: the same with ``strategy.overlap=auto`` (the default: both paths timed on the first updates,
  the faster kept);
- ``local``: :class:`LocalStepsStrategy` (``conf/strategy/local_steps.yaml``: the nodes synchronised every
  ``sync_every`` updates, DiLoCo), e.g. ``local:sync_every=20,outer_lr=0.7``;
- ``hsdp``: hybrid sharding without compression as a Lightning user would run it: ``ModelParallelStrategy``
  and ``fully_shard`` over its 2-D mesh in ``configure_model`` (``benchmarks/_hsdp_prior.py``).

``strategy``, ``strategy_end`` and ``strategy_auto`` run at ``devices_per_node`` = ``--per-node``.

``rates`` mode (default): per rate and method, ``--runs`` runs of ``--steps`` updates without validation,
interleaved (method a, b, c, a, b, c, ...): updates/s (``StepTimer``, after 10 warm-up updates), bytes node 0 put
on its link per update (``LinkBytes``: headers included, the same count for every method) and the strategy's own
count of gradient bytes, and the share of the step spent waiting on the link, for every method the same way:
(shaped step time - unshaped step time) / shaped step time, from the medians. A run that fails is reported with
the last line of its error.

``--time-to-loss``: per rate and setting (``--settings``: method:override,... e.g. ``strategy:powersgd_rank=32``),
one run of ``--ttl-steps`` updates validating every 10 on the same 4 batches; the target is ``ddp``'s validation
loss after ``--target-step`` updates, and each setting's figure the training seconds (validation excluded) until its
validation loss first reaches it (``null``: not within the run, the cap). ``--target-from REPORT`` takes ``ddp``'s
curve from an earlier report of the same shape and schedule instead of running it again.

Usage: ``python benchmarks/two_nodes.py [outputs/demo] [--rates 0 1000 200 50] [--runs 3] [--steps 60]``;
``python benchmarks/two_nodes.py outputs/demo --time-to-loss --rates 0 200 --settings ddp
strategy:powersgd_rank=4 ...``.
Rate 0 means unshaped. Needs root (namespaces); takes minutes per rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_two_hosts", HERE / "_two_hosts.py")
assert _spec is not None and _spec.loader is not None
two_hosts = importlib.util.module_from_spec(_spec)
sys.modules["_two_hosts"] = two_hosts
_spec.loader.exec_module(two_hosts)

# torch's PowerSGD hook, a module of this folder: importable as benchmarks.<module> from the repository root, which
# launch_env() puts on the runs' PYTHONPATH.
HOOK = "benchmarks._torch_powersgd_hook.TorchPowerSGDHook"
HSDP_MODULE = "benchmarks._hsdp_prior.HSDPPriorModule"
TIMER = ["+callbacks.step_timer._target_=dalle_lightning_callbacks.step_timer.StepTimer",
         "+callbacks.step_timer.skip=10"]
LINK = ["+callbacks.link_bytes._target_=dalle_lightning_callbacks.link_bytes.LinkBytes",
        "+callbacks.link_bytes.skip=10"]
BASE = ["stage=prior", "experiment=shapes", "callbacks.fid=null", "callbacks.sample_grid=null",
        # no checkpoints at all: with callbacks.checkpoint=null Lightning still adds its own, saving at every epoch's
        # end, and under the strategies each rank's state (error buffers; local steps' weights) then crosses the link
        "callbacks.checkpoint=null", "+trainer.enable_checkpointing=false", "trainer.num_nodes=2",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        *TIMER, *LINK]
NO_VAL = ["trainer.limit_val_batches=0"]
VALIDATE = ["+trainer.val_check_interval=10", "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=4"]


STRATEGY_OVERLAP = {"strategy": "true", "strategy_end": "false", "strategy_auto": "auto"}


def method_overrides(method: str, rank: int, per_node: int = 1) -> list[str]:
    devices = [f"trainer.devices={per_node}"]
    if method == "ddp":
        return [*devices, "strategy=auto", "strategy.name=ddp"]
    if method == "hsdp":
        return [*devices, "strategy=auto", "~strategy.name",
                "+strategy._target_=lightning.pytorch.strategies.ModelParallelStrategy",
                "+strategy.data_parallel_size=2", f"+strategy.tensor_parallel_size={per_node}",
                f"module._target_={HSDP_MODULE}"]
    if method == "hook":
        return [*devices, "strategy=auto", "strategy.name=ddp", f"+callbacks.torch_powersgd._target_={HOOK}",
                f"+callbacks.torch_powersgd.rank={rank}"]
    if method == "local":
        return [*devices, "strategy=local_steps", f"strategy.devices_per_node={per_node}", "strategy.checkpoint_format=full"]
    if method in STRATEGY_OVERLAP:
        return [*devices, "strategy=sharded_powersgd", f"strategy.devices_per_node={per_node}",
                "strategy.checkpoint_format=full",
                f"strategy.powersgd_rank={rank}", f"strategy.overlap={STRATEGY_OVERLAP[method]}"]
    raise SystemExit(f"error: method {method!r}, expected ddp, hook, hsdp, local, {', '.join(STRATEGY_OVERLAP)}")


def setting_overrides(setting: str, rank: int, per_node: int = 1) -> list[str]:
    """``method`` or ``method:key=value,key=value`` (keys of the strategy or the hook's callback)."""
    method, _, extra = setting.partition(":")
    overrides = method_overrides(method, rank, per_node)
    prefix = "+callbacks.torch_powersgd." if method == "hook" else "strategy."
    for item in filter(None, extra.split(",")):
        key = item.split("=")[0]
        overrides = [o for o in overrides if not o.lstrip("+").startswith(prefix.lstrip("+") + key + "=")]
        if key == "compression":
            overrides = [o for o in overrides if not o.startswith("strategy.powersgd_rank=")]
        overrides.append(prefix + item)
    return overrides


def launch_env() -> dict[str, str]:
    """What each run's ``torchrun`` gets besides this process's environment: one thread, unbuffered output, and the
    repository root first on ``PYTHONPATH``, so that ``benchmarks.<module>`` targets (:data:`HOOK`) import in the
    workers whatever the current directory."""
    path = [str(HERE.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path)}


def run(hosts: Any, work: Path, overrides: list[str], steps: int, scratch: Path,
        timeout: float = 900, per_node: int = 1) -> dict[str, Any]:
    """One 2-node ``dalle-train`` run; node 0's metrics.json figures and timeline, or the error that ended it."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    paths = [f"paths.{key}={work / name}" for key, name in
             (("world", "world"), ("tokens", "tokens"), ("tokenizer", "tokenizer.json"), ("dvae", "dvae.pt"),
              ("clip", "clip.pt"))]
    port = 29400 + int.from_bytes(os.urandom(2), "little") % 1000
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = launch_env()
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")}
    agents = []
    for node in (0, 1):
        argv = [torchrun, "--nnodes=2", f"--nproc-per-node={per_node}", f"--node-rank={node}",
                f"--master-addr={two_hosts.ADDRESSES[0]}", f"--master-port={port}", "-m", "dalle_lightning.cli.train",
                *BASE, f"trainer.max_steps={steps}", *paths, f"output={run_dir / 'prior.pt'}",
                f"hydra.run.dir={run_dir / f'node{node}'}", *overrides]
        log = open(run_dir / f"node{node}.log", "w")
        agents.append((subprocess.Popen(hosts.command(node, argv, env), stdout=log, stderr=subprocess.STDOUT,
                                        env=clean, cwd=Path.cwd()), log))
    deadline = time.monotonic() + timeout
    for agent, log in agents:
        try:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
        log.close()
    text = (run_dir / "node0.log").read_text()
    if any(agent.returncode != 0 for agent, _ in agents) or not (run_dir / "node0" / "metrics.json").exists():
        # the worker's own exception line (``[rank0]: RuntimeError: ...``), not torchrun's summary after it
        errors = [line for node in (0, 1) for line in (run_dir / f"node{node}.log").read_text().splitlines()
                  if re.search(r"\b\w*(Error|Exception): ", line) and "ChildFailedError" not in line]
        return {"error": (errors[0] if errors else f"exit codes {[a.returncode for a, _ in agents]}")[-300:]}
    metrics = json.loads((run_dir / "node0" / "metrics.json").read_text())["metrics"]
    out: dict[str, Any] = {k: float(v) for k, v in metrics.items()
                           if k.startswith(("time/", "powersgd/", "strategy/", "local_steps/", "link/", "val/loss", "replica"))}
    for line in text.splitlines():
        if line.startswith('{"timeline"'):
            out["timeline"] = json.loads(line)["timeline"]
    return out


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def rates_mode(args: argparse.Namespace, hosts: Any, work: Path, scratch: Path) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for rate in args.rates:
        hosts.shape(rate or None)
        measured = hosts.measure_mbit()
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        for _ in range(args.runs):
            for method in args.methods:
                runs[method].append(run(hosts, work, setting_overrides(method, args.rank, args.per_node) + NO_VAL,
                                        args.steps, scratch, per_node=args.per_node))
        entry: dict[str, Any] = {"measured_mbit": round(measured, 1)}
        for method, results in runs.items():
            ok = [r for r in results if "error" not in r]
            entry[method] = {
                "updates_per_s": spread([r["time/updates_per_s"] for r in ok]),
                "link_bytes_per_update": spread([r["link/tx_bytes_per_update"] for r in ok
                                                 if "link/tx_bytes_per_update" in r]),
                "gradient_bytes_per_rank": spread([r["powersgd/inter_node_bytes_per_rank"] for r in ok
                                                   if "powersgd/inter_node_bytes_per_rank" in r]),
                "local_steps_bytes_per_update": spread([r["local_steps/inter_node_bytes_per_update"] for r in ok
                                                        if "local_steps/inter_node_bytes_per_update" in r]),
                "exchange_ms_per_step": spread([r["strategy/reduce_ms_per_step"] for r in ok
                                                if "strategy/reduce_ms_per_step" in r]),
                "failed": [r["error"] for r in results if "error" in r],
            }
        table["unshaped" if not rate else f"{rate}mbit"] = entry
    unshaped = table.get("unshaped")
    if unshaped:
        for key, entry in table.items():
            for method in args.methods:
                shaped, base = entry[method]["updates_per_s"], unshaped[method]["updates_per_s"]
                if shaped and base:
                    # (shaped step - unshaped step) / shaped step = 1 - shaped rate / unshaped rate
                    entry[method]["link_wait_share"] = round(1 - shaped["median"] / base["median"], 4)
                    entry[method]["of_unshaped"] = round(shaped["median"] / base["median"], 4)
    return table


def time_to_loss_mode(args: argparse.Namespace, hosts: Any, work: Path, scratch: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for rate in args.rates:
        hosts.shape(rate or None)
        measured = hosts.measure_mbit()
        entry: dict[str, Any] = {"measured_mbit": round(measured, 1)}
        earlier = _ddp_curve(args.target_from) if args.target_from else None
        results = {s: run(hosts, work, setting_overrides(s, args.rank, args.per_node) + VALIDATE, args.ttl_steps,
                          scratch, per_node=args.per_node)
                   for s in [*([] if earlier else ["ddp"]), *[s for s in args.settings if s != "ddp"]]}
        if earlier:
            results = {"ddp": earlier, **results}
        ddp = results["ddp"].get("timeline", [])
        target = next((p["loss"] for p in ddp if p["step"] == args.target_step), None)
        entry["target_loss"] = target
        for setting, result in results.items():
            timeline = result.get("timeline", [])
            reached = next((p for p in timeline if target is not None and p["loss"] <= target), None)
            at_target_step = next((p["loss"] for p in timeline if p["step"] == args.target_step), None)
            entry[setting] = {
                "seconds_to_target": reached["train_s"] if reached else None,
                "updates_to_target": reached["step"] if reached else None,
                f"val_loss_at_{args.target_step}": at_target_step,
                "vs_ddp_loss": round(at_target_step / target - 1, 4) if at_target_step and target else None,
                "updates_per_s": result.get("time/updates_per_s"),
                "error": result.get("error"),
                "timeline": timeline,
            }
        ddp_time = entry["ddp"]["seconds_to_target"]
        for setting in results:
            t = entry[setting]["seconds_to_target"]
            entry[setting]["time_vs_ddp"] = round(t / ddp_time, 4) if t and ddp_time else None
        report["unshaped" if not rate else f"{rate}mbit"] = entry
    return report


def _ddp_curve(path: Path) -> dict[str, Any]:
    """``ddp``'s loss curve from an earlier ``--time-to-loss`` report of the same shape and schedule (its curve does
    not depend on the link, and it is the same run after run: 0.7466 at update 400 at 2 x 1 in every run)."""
    entry = next(iter(json.loads(path.read_text())["time_to_loss"].values()))["ddp"]
    return {"timeline": entry["timeline"], "time/updates_per_s": entry["updates_per_s"], "from": str(path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("work_dir", type=Path, nargs="?", default=Path("outputs/demo"),
                        help="the demo's out_dir (world, tokens, tokenizer, dvae); default outputs/demo")
    parser.add_argument("--rates", type=float, nargs="+", default=[0, 1000, 200, 50],
                        help="Mbit/s each way; 0: unshaped")
    parser.add_argument("--methods", nargs="+", default=["ddp", "hook", "strategy", "strategy_end"],
                        help="methods, or settings as in --settings (strategy:reshard_after_forward=false)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank of the hook and the strategy")
    parser.add_argument("--per-node", type=int, default=1, help="processes per node (namespace): 1 or 2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--time-to-loss", action="store_true")
    parser.add_argument("--settings", nargs="+", default=["strategy:powersgd_rank=4", "strategy:powersgd_rank=32"])
    parser.add_argument("--ttl-steps", type=int, default=600, help="updates per time-to-loss run (the cap)")
    parser.add_argument("--target-step", type=int, default=400, help="ddp's update whose val loss is the target")
    parser.add_argument("--target-from", type=Path, default=None,
                        help="take ddp's curve from this earlier --time-to-loss report instead of running it again")
    parser.add_argument("--no-slow-start-after-idle", action="store_true",
                        help="net.ipv4.tcp_slow_start_after_idle=0 in both namespaces: TCP keeps its window over idle "
                             "gaps (a sync every H updates leaves the link idle in between)")
    args = parser.parse_args()
    work = args.work_dir.resolve()
    missing = [n for n in ("world", "tokens", "tokenizer.json", "dvae.pt") if not (work / n).exists()]
    if missing:
        raise SystemExit(f"error: {work} has no {', '.join(missing)}; run `make demo` (or pass its out_dir) first")
    reason = two_hosts.unavailable()
    if reason:
        raise SystemExit(f"error: {reason}")
    report: dict[str, Any] = {"work_dir": str(work), "rank": args.rank, "per_node": args.per_node, "cpu": _cpu(),
                              "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as scratch, two_hosts.TwoHosts() as hosts:
        if args.no_slow_start_after_idle:
            for ns in hosts.names:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                               check=True)
            report["tcp_slow_start_after_idle"] = 0
        if args.time_to_loss:
            report.update(ttl_steps=args.ttl_steps, target_step=args.target_step,
                          time_to_loss=time_to_loss_mode(args, hosts, work, Path(scratch)))
        else:
            report.update(steps=args.steps, runs=args.runs, rates=rates_mode(args, hosts, work, Path(scratch)))
    print(json.dumps(report, indent=1))


def _cpu() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    return "native bf16 (avx512_bf16)" if "avx512_bf16" in flags else "AVX2, bf16 emulated"


if __name__ == "__main__":
    main()
