"""Per-rank memory of a stranger's model under ``ddp``, Lightning's ``ModelParallelStrategy`` and
``ShardedPowerSGDStrategy`` (issue 70): host memory on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU.

A stranger's MLP (``--blocks`` blocks of ``--width`` x ``--width`` linear layers with a ReLU, default 12 x 1536: 28M
parameters), Adam, trained for ``--steps`` steps by ``--world`` processes, each row in fresh processes.

* ``--device cpu`` (default; 2 processes, gloo): the resident set. glibc is told to map every allocation over 64 KiB
  on its own (``MALLOC_MMAP_THRESHOLD_=65536``), so a freed tensor leaves the resident set at once and the peak is
  what the process held, not what its allocator kept.
* ``--device cuda`` (nccl; one process per GPU, 2 when two are visible, else 1): the caching allocator's
  ``torch.cuda.max_memory_allocated`` of the rank's device (the tensors' bytes, without what the allocator keeps
  reserved or NCCL's own buffers), after ``torch.cuda.reset_peak_memory_stats``. Without a CUDA device it says so
  in one line and exits 0. NCCL cannot run two ranks on one GPU, so one GPU measures a world of 1: nothing is
  sharded there, the rows compare what each strategy keeps beside the model.

Per rank, in units of P (the model's fp32 bytes), above the memory after the imports (on CUDA: none), and raw
(``*_bytes``: the high-water mark itself):

* ``steps``: the peak over the training steps (reset at the first batch's start and read at the fit's end, so
  Adam's state, made at the first step, is in it);
* ``fit``: the peak over the whole fit, from building the model to the module given back after it.

Rows: ``ddp``; ``model_parallel`` (Lightning's ``ModelParallelStrategy``, the user's ``configure_model`` calling
``fully_shard`` per block and on the root); the strategy at ``devices_per_node`` 2 (one node of 2: FSDP2 within it)
and 1 (nodes of 1: PowerSGD, nothing sharded), with ``full_weights_after=True``; each plainly and, with ``_empty``
in its name, built under ``trainer.init_module(empty_init=True)``; ``dpn2_undeclared`` names no block class (the
strategy's default units: the entries of the model's ``nn.ModuleList``, the blocks ``model_parallel`` shards). A row whose ``devices_per_node`` does not divide
the world is reported as skipped.

Usage: ``python benchmarks/memory.py [--device cpu|cuda] [--world N] [--blocks 12 --width 1536 --steps 3]
[--rows ddp model_parallel ...]``; a quick run: ``--blocks 4 --width 512``. Prints one JSON object; ``--lines``
prints a line per row as it ends and the object on one line (the GPU check's ``memory`` step), ``--concurrent``
runs the rows at once (each process's peak is its own: the rows do not see each other).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("ddp", "ddp_empty", "model_parallel", "model_parallel_empty", "dpn2", "dpn2_empty", "dpn1", "dpn1_empty",
        "dpn2_undeclared")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class _Meter:
    """This process's memory and its high-water mark: the resident set (VmRSS, VmHWM) on the CPU, the caching
    allocator's allocated bytes on this rank's CUDA device (``LOCAL_RANK``)."""

    def __init__(self, device: str) -> None:
        self.cuda = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else None
        if self.cuda is not None:
            torch.cuda.set_device(self.cuda)  # before anything else, so no rank makes a context on device 0

    def now(self) -> int:
        return _status_bytes("VmRSS") if self.cuda is None else torch.cuda.memory_allocated(self.cuda)

    def peak(self) -> int:
        return _status_bytes("VmHWM") if self.cuda is None else torch.cuda.max_memory_allocated(self.cuda)

    def reset(self) -> None:
        """The high-water mark starts again from the memory held now."""
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def name(self) -> str:
        return "cpu" if self.cuda is None else f"cuda ({torch.cuda.get_device_name(self.cuda)})"


def _skipped(row: str, world: int) -> str | None:
    """Why ``row`` cannot run on ``world`` processes, or None."""
    kind = row.removesuffix("_empty")
    if kind.startswith("dpn") and world % int(kind[3]):
        return f"devices_per_node {kind[3]} does not divide the world of {world}"
    return None


def _worker(row: str, args: argparse.Namespace) -> None:
    meter = _Meter(args.device)
    import lightning.pytorch as L
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "strategies"))
    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    width = args.width

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(args.blocks))  # as a transformer's layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

        def configure_model(self) -> None:
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Peaks(L.Callback):
        steps = 0

        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            if trainer.global_step == 0:
                meter.reset()

        def on_train_end(self, trainer: Any, *rest: Any) -> None:
            Peaks.steps = meter.peak()

    kind, empty = row.removesuffix("_empty"), row.endswith("_empty")
    if kind == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="nccl" if args.device == "cuda" else "gloo")
    elif kind == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1)
    else:
        declared = {} if kind.endswith("_undeclared") else {"block_classes": [Block]}  # else: its ModuleList's entries
        strategy = ShardedPowerSGDStrategy(devices_per_node=int(kind[3]), full_weights_after=True, powersgd_rank=4,
                                           **declared)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * args.steps, width), torch.randn(8 * args.steps, width))
    loader = DataLoader(data, batch_size=8)
    base = meter.now()
    meter.reset()
    trainer = L.Trainer(accelerator=args.device, devices=args.world, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                        callbacks=[Peaks()])
    with trainer.init_module(empty_init=True) if empty else torch.device("cpu"):
        model = MLP()
    trainer.fit(model, loader)
    fit = meter.peak()
    whole = all(not p.is_meta and p.device.type == "cpu" and type(p.data) is torch.Tensor for p in model.parameters())
    P = 4 * sum(p.numel() for p in model.parameters())
    Path(args.out).write_text(json.dumps({"steps": (Peaks.steps - base) / P, "fit": (fit - base) / P,
                                          "steps_bytes": Peaks.steps, "fit_bytes": fit, "base_bytes": base,
                                          "P_bytes": P, "whole_after": whole, "device": meter.name()}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(row: str, args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen], list[Path], float]:
    """``row``'s ``--world`` processes, started, and the moment they are due (``--timeout`` from now)."""
    due = time.monotonic() + args.timeout
    port = _free_port()
    procs, outs = [], []
    for rank in range(args.world):
        out = tmp / f"{row}-{rank}.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.world),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "MALLOC_MMAP_THRESHOLD_": "65536",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--worker", row, "--device", args.device, "--world", str(args.world),
               "--blocks", str(args.blocks), "--width", str(args.width), "--steps", str(args.steps), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    return procs, outs, due


def _collect(procs: list[subprocess.Popen], outs: list[Path], due: float, args: argparse.Namespace) -> dict[str, Any]:
    """The row's figures per rank once its processes end, or its error in one line."""
    try:
        errors = [p.communicate(timeout=max(0.1, due - time.monotonic()))[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        return {"error": f"over --timeout {args.timeout:g} s"}
    if any(p.returncode for p in procs):
        failed = next((e.strip().splitlines() for p, e in zip(procs, errors) if p.returncode and e.strip()),
                      [f"exit status {[p.returncode for p in procs]}"])
        return {"error": failed[-1], **({"traceback": failed[-40:]} if args.verbose else {})}
    ranks = [json.loads(o.read_text()) for o in outs]
    return {"steps": [round(r["steps"], 2) for r in ranks], "fit": [round(r["fit"], 2) for r in ranks],
            "steps_bytes": [r["steps_bytes"] for r in ranks], "fit_bytes": [r["fit_bytes"] for r in ranks],
            "whole_after": all(r["whole_after"] for r in ranks), "P_mib": round(ranks[0]["P_bytes"] / 2**20, 1),
            "P_bytes": ranks[0]["P_bytes"], "device": ranks[0]["device"]}


def _measure(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    """Every row, in order (started together with ``--concurrent``); with ``--lines`` each printed as it ends."""
    rows: dict[str, dict[str, Any]] = {}
    started: dict[str, tuple[list[subprocess.Popen], list[Path], float]] = {}
    for row in args.rows:
        reason = _skipped(row, args.world)
        if reason:
            rows[row] = {"skipped": reason}
        elif args.concurrent:
            started[row] = _start(row, args, tmp)
    for row in args.rows:
        if row not in rows:
            procs, outs, due = started[row] if row in started else _start(row, args, tmp)
            rows[row] = _collect(procs, outs, due, args)
        if args.lines:
            print(json.dumps({"row": row, **rows[row]}), flush=True)
    return {row: rows[row] for row in args.rows}


def _world(args: argparse.Namespace) -> int | None:
    """``--world``, or the default: 2 on the CPU, one process per visible GPU up to 2; None without CUDA."""
    if args.device == "cpu":
        return args.world or 2
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return None
    if args.world and args.world > count:
        raise ValueError(f"--world {args.world} with {count} CUDA device(s) visible; expected at most {count} "
                         "(NCCL runs one rank per GPU)")
    return args.world or min(2, count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=None, help="processes (default: 2 on the CPU; on CUDA one "
                        "per visible GPU, at most 2)")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a row may take from its start")
    parser.add_argument("--lines", action="store_true", help="a JSON line per row as it ends; the object on one line")
    parser.add_argument("--concurrent", action="store_true", help="run the rows at once")
    parser.add_argument("--verbose", action="store_true", help="a failed row's traceback too")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args)
        return
    try:
        if args.world is not None and args.world < 1:
            raise ValueError(f"--world {args.world}; expected 1 or more")
        args.world = _world(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.world is None:
        print(json.dumps({"skipped": "no CUDA device: torch.cuda.is_available() is False; the GPU memory rows "
                                     "were not measured"}), flush=True)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = _measure(args, Path(tmp))
    reference = {suffix: rows.get(f"model_parallel{suffix}", {}) for suffix in ("", "_empty")}
    for row, result in rows.items():
        ref = reference["_empty" if row.endswith("_empty") else ""]
        if "steps" in result and "steps" in ref:
            result["steps_vs_model_parallel"] = round(max(result["steps"]) / max(ref["steps"]), 2)
            result["fit_minus_whole_vs_model_parallel"] = round((max(result["fit"]) - 1) / max(ref["fit"]), 2)
    measure = ("torch.cuda.max_memory_allocated after reset_peak_memory_stats" if args.device == "cuda" else
               "peak RSS (VmHWM) above the RSS after imports")
    print(json.dumps({"model": f"{args.blocks} x Linear({args.width}, {args.width}) + ReLU, Adam",
                      "device": args.device, "world": args.world, "measure": measure,
                      "units": "P per rank (the model's fp32 bytes); *_bytes: the raw peak", "rows": rows},
                     indent=None if args.lines else 1), flush=True)


if __name__ == "__main__":
    main()
