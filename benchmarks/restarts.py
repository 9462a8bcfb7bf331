"""A lost link or node under a restarting launcher: does the run come back by itself, what does it cost?

Two namespaces joined by a veth (``_two_hosts.py``), one ``torchrun --max-restarts=3 --rdzv-backend=c10d`` agent
in each (``_two_hosts.elastic_torchrun``), the prior under each strategy at 2 nodes x 1 and 2 nodes x 2, 300
updates with checkpoints every 50 and ``strategy.timeout=20``, as the issue's harness runs it. Each case runs
once without a failure and once with one at update 175 (the last checkpoint is update 150's):

- ``link_cut``: every rank holds at update 175 (``tests.pause_at.PauseAt``), the link goes down for 30 s;
- ``worker_killed``: node 1's first worker SIGKILLs itself in update 176 (``tests.kill_at.KillAt``).

One JSON line per case: both agents' exit codes, whether ``prior.pt`` equals the uninterrupted run's bit for bit,
the tracebacks the workers printed (and, apart, those of torchrun's agents),
the wall times, ``lost_s`` (the broken run's wall time less the uninterrupted run's: the failure's detection, the
restart, the updates redone) and the log lines each node printed beyond the uninterrupted run's.

    python benchmarks/restarts.py [--cases link_cut:sharded_powersgd:1,...] [--steps 300] [--rdzv-node 0|1]
        [--overrides K=V ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_spec = importlib.util.spec_from_file_location("_two_hosts", HERE / "_two_hosts.py")
assert _spec is not None and _spec.loader is not None
two_hosts = importlib.util.module_from_spec(_spec)
sys.modules["_two_hosts"] = two_hosts
_spec.loader.exec_module(two_hosts)

RDZV_NODE = 0  # the node whose agent hosts the rendezvous (--rdzv-node)
ALL_CASES = [f"{f}:{s}:{n}" for f in ("link_cut", "worker_killed") for s in ("sharded_powersgd", "local_steps")
             for n in (1, 2)]
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")
# torchrun's agent's own log lines ("E1128 00:30:26.008000 31279 .../torch/distributed/elastic/agent/...] ..."): at
# the very end of a run it sometimes logs a traceback of its exit barrier, when node 0's agent, which serves the
# barrier's store, leaves first (torch's teardown; seen once in the suite, after a successful run)
AGENT_LINE = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/")
AGENT_SITE = re.compile(r"\S+\.py:\d+\]")  # the agent's logging call site
CPP_FRAMES = ("frame #", "<omitting python frames>", "Exception raised from ")  # one torch warning's C++ stack


def inputs(work: Path) -> None:
    """The prior stage's inputs, small: a 64-image world, its tokenizer, a 2-update dVAE, the tokens."""
    py = [sys.executable, "-m"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "check": True, "cwd": ROOT}
    w = f"paths.work_dir={work}"
    subprocess.run([*py, "dalle_lightning.cli.data", w, "n_train=64", "n_val=16", "n_zeroshot=8", "shard_size=32"], **quiet)
    subprocess.run([*py, "dalle_lightning.cli.train", "stage=tokenizer", w], **quiet)
    subprocess.run([*py, "dalle_lightning.cli.train", "stage=dvae", w, "model.n_hid=8", "model.vocab_size=32",
                    "model.codebook_dim=16", "data.batch_size=8", "trainer.max_steps=2", "trainer.enable_progress_bar=false"],
                   **quiet)
    subprocess.run([*py, "dalle_lightning.cli.encode", w, "batch_size=32"], **quiet)


def launch(hosts: two_hosts.TwoHosts, work: Path, out: Path, strategy: str, per_node: int, run: Sequence[str],
           *overrides: str) -> list[subprocess.Popen]:
    """One agent per namespace, as a user starts them; run directories by ``${run_id:}`` under ``<out>/runs``."""
    out.mkdir(parents=True, exist_ok=True)
    port = 29400 + int.from_bytes(os.urandom(2), "little") % 1000
    torchrun = str(Path(sys.executable).parent / "torchrun")
    extra = ["strategy.powersgd_rank=2"] if strategy == "sharded_powersgd" else []
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}  # a caller's own launch settings stay out
    agents = []
    for node in (0, 1):
        argv = [torchrun, *two_hosts.elastic_torchrun(hosts, node, per_node, port, rdzv_node=RDZV_NODE)[1:],
                "-m", "dalle_lightning.cli.train",
                "stage=prior", f"paths.work_dir={work}", f"strategy={strategy}", f"trainer.devices={per_node}",
                "trainer.num_nodes=2", "model.n_layer=2", "model.n_head=2", "model.d_head=8", "data.batch_size=4",
                "callbacks.fid=null", "callbacks.sample_grid=null", "trainer.limit_val_batches=0", "data.shuffle_buffer=0",
                f"paths.runs={out}/runs", f"output={out}/prior.pt", *run, *extra, *overrides]
        agents.append(subprocess.Popen(hosts.command(node, argv, env), stdout=open(out / f"node{node}.log", "w"),
                                       stderr=subprocess.STDOUT, cwd=work, start_new_session=True, env=clean))
    return agents


def wait(agents: list[subprocess.Popen], timeout: float = 900) -> list[int]:
    deadline = time.monotonic() + timeout
    return [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in agents]


def log_lines(out: Path, teardown: bool = True) -> list[int]:
    """Lines per node's log, a C++ stack under a torch warning counted as its one line; without ``teardown``, less
    torchrun's own exit-barrier report (the agent's lines logged where it reports that barrier)."""
    counts = []
    for n in (0, 1):
        lines = [line for line in (out / f"node{n}.log").read_text().splitlines() if not line.startswith(CPP_FRAMES)]
        if not teardown:
            sites = {AGENT_SITE.search(line).group(0) for line in lines  # type: ignore[union-attr]
                     if AGENT_LINE.match(line) and "exit barrier" in line and AGENT_SITE.search(line)}
            lines = [line for line in lines if not (AGENT_LINE.match(line) and AGENT_SITE.search(line)
                                                   and AGENT_SITE.search(line).group(0) in sites)]  # type: ignore[union-attr]
        counts.append(len(lines))
    return counts


def same(a: Path, b: Path) -> bool:
    """Whether two model files (``prior.pt``) hold the same weights."""
    import torch

    from dalle_lightning.artifacts import read_file

    x, y = read_file(a)["state_dict"], read_file(b)["state_dict"]
    return set(x) == set(y) and all(torch.equal(x[k], v) for k, v in y.items())


def run_case(hosts: two_hosts.TwoHosts, work: Path, case: str, steps: int = 300, at: int = 175, every: int = 50,
             timeout: int = 20, *overrides: str) -> dict:
    """``case`` (``failure:strategy:devices_per_node``) without and with its failure at update ``at``, checkpoints
    every ``every`` updates, ``strategy.timeout=timeout``; ``overrides`` go to both runs. The result's ``logs``
    is the broken run's folder (``node0.log``, ``node1.log``)."""
    failure, strategy, per_node = case.split(":")
    per_node_n = int(per_node)
    base = work / case.replace(":", "-")
    run = [f"trainer.max_steps={steps}", f"callbacks.checkpoint.every_n_train_steps={every}",
           f"strategy.timeout={timeout}", *overrides]
    start = time.monotonic()
    straight_codes = wait(launch(hosts, work, base / "straight", strategy, per_node_n, run))
    straight_s = time.monotonic() - start
    start = time.monotonic()
    if failure == "link_cut":
        flag = base / "hold"
        agents = launch(hosts, work, base / "broken", strategy, per_node_n, run, f"+callbacks.pause.flag={flag}",
                        "+callbacks.pause._target_=tests.pause_at.PauseAt", f"+callbacks.pause.update={at}")
        while not flag.with_suffix(".paused").exists() and all(a.poll() is None for a in agents):
            time.sleep(0.1)
        hosts.set_link(False)
        flag.with_suffix(".go").touch()
        time.sleep(30)
        hosts.set_link(True)
    else:
        agents = launch(hosts, work, base / "broken", strategy, per_node_n, run, "+callbacks.kill._target_=tests.kill_at.KillAt",
                        f"+callbacks.kill.update={at}", f"+callbacks.kill.rank={per_node_n}", "+callbacks.kill.attempt=0")
    codes = wait(agents)
    broken_s = time.monotonic() - start
    text = "\n".join((base / "broken" / f"node{n}.log").read_text() for n in (0, 1))
    return {"case": case, "exit_codes": codes, "uninterrupted_exit_codes": straight_codes,
            "exact": (base / "broken" / "prior.pt").exists() and same(base / "broken" / "prior.pt", base / "straight" / "prior.pt"),
            # start_decision's one line: the restarted attempt continued this launch, none started it over
            "resumed": "continuing this launch from" in text and "starting afresh: restarted" not in text,
            "tracebacks": sum("Traceback" in line for line in text.splitlines() if not AGENT_LINE.match(line)),
            "agent_tracebacks": sum("Traceback" in line for line in text.splitlines() if AGENT_LINE.match(line)),
            "uninterrupted_s": round(straight_s, 1), "broken_s": round(broken_s, 1),
            "lost_s": round(broken_s - straight_s, 1), "failure_at_update": at, "last_checkpoint_update": at // every * every,
            "extra_log_lines_per_node": [b - s for b, s in zip(log_lines(base / "broken"), log_lines(base / "straight"))],
            "extra_log_lines_per_node_less_torchrun_teardown": [
                b - s for b, s in zip(log_lines(base / "broken", False), log_lines(base / "straight", False))],
            "logs": str(base / "broken")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(ALL_CASES), help="failure:strategy:devices_per_node, comma-separated")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=int, default=175, help="the update the failure comes at")
    parser.add_argument("--overrides", nargs="*", default=[], help="dalle-train overrides for both runs, e.g. "
                        "precision=resblock16 precision.dtype=bf16 (the demo's precision plugin)")
    parser.add_argument("--rdzv-node", type=int, choices=(0, 1), default=0,
                        help="the node whose torchrun agent hosts the rendezvous (1: not the one holding rank 0)")
    args = parser.parse_args()
    global RDZV_NODE
    RDZV_NODE = args.rdzv_node
    reason = two_hosts.unavailable()
    if reason:
        print(json.dumps({"skipped": reason}))
        return
    with tempfile.TemporaryDirectory() as tmp, two_hosts.TwoHosts() as hosts:
        hosts.shape(200)
        work = Path(tmp)
        inputs(work)
        for case in args.cases.split(","):
            result = run_case(hosts, work, case, args.steps, args.at, 50, 20, *args.overrides)
            print(json.dumps({**result, "overrides": args.overrides, "rdzv_node": args.rdzv_node}), flush=True)


if __name__ == "__main__":
    main()
