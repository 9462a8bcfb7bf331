"""Per-rank memory of a stranger's model under ``ddp``, Lightning's ``ModelParallelStrategy`` and
``ShardedPowerSGDStrategy`` (issue 70, deliverable 1).

A stranger's MLP (``--blocks`` blocks of ``--width`` x ``--width`` linear layers with a ReLU, default 12 x 1536: 28M
parameters), Adam, trained for ``--steps`` steps on 2 CPU processes (gloo), each row in a fresh pair of processes.
glibc is told to map every allocation over 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_=65536``), so a freed tensor
leaves the resident set at once and the peak is what the process held, not what its allocator kept.

Per rank, in units of P (the model's fp32 bytes), above the resident memory after the imports:

* ``steps``: the peak over the training steps (the kernel's high-water mark, reset at the first batch's start and
  read at the fit's end, so Adam's state, made at the first step, is in it);
* ``fit``: the peak over the whole fit, from building the model to the module given back after it.

Rows: ``ddp``; ``model_parallel`` (Lightning's ``ModelParallelStrategy``, the user's ``configure_model`` calling
``fully_shard`` per block and on the root); the strategy at ``devices_per_node`` 2 (one node of 2: FSDP2 within it)
and 1 (two nodes of 1: PowerSGD, nothing sharded), with ``full_weights_after=True``; each plainly and, with
``_empty`` in its name, built under ``trainer.init_module(empty_init=True)``.

Usage: ``python benchmarks/memory.py [--blocks 12 --width 1536 --steps 3] [--rows ddp model_parallel ...]``; a
quick run: ``--blocks 4 --width 512``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("ddp", "ddp_empty", "model_parallel", "model_parallel_empty", "dpn2", "dpn2_empty", "dpn1", "dpn1_empty")
WORLD = 2


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """The kernel's high-water mark of the resident set (VmHWM) starts again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(row: str, blocks: int, width: int, steps: int, out: str) -> None:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "strategies"))
    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))

        def configure_model(self) -> None:
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.blocks(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Peaks(L.Callback):
        steps = 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 0:
                _reset_peak()

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            Peaks.steps = _status_bytes("VmHWM")

    kind, empty = row.removesuffix("_empty"), row.endswith("_empty")
    if kind == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    elif kind == "model_parallel":
        strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    else:
        strategy = ShardedPowerSGDStrategy(devices_per_node=int(kind[3:]), block_classes=[Block],
                                           full_weights_after=True, powersgd_rank=4)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * steps, width), torch.randn(8 * steps, width))
    loader = DataLoader(data, batch_size=8)
    base = _status_bytes("VmRSS")
    _reset_peak()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Peaks()])
    with trainer.init_module(empty_init=True) if empty else torch.device("cpu"):
        model = MLP()
    trainer.fit(model, loader)
    fit = _status_bytes("VmHWM")
    whole = all(not p.is_meta and p.device.type == "cpu" and type(p.data) is torch.Tensor for p in model.parameters())
    P = 4 * sum(p.numel() for p in model.parameters())
    Path(out).write_text(json.dumps({"steps": (Peaks.steps - base) / P, "fit": (fit - base) / P,
                                     "base_mib": base / 2**20, "P_mib": P / 2**20, "whole_after": whole}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(row: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = _free_port()
    procs, outs = [], []
    for rank in range(WORLD):
        out = tmp / f"{row}-{rank}.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "MALLOC_MMAP_THRESHOLD_": "65536",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--worker", row, "--blocks", str(args.blocks), "--width", str(args.width),
               "--steps", str(args.steps), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    errors = [p.communicate(timeout=args.timeout)[1] for p in procs]
    if any(p.returncode for p in procs):
        failed = next(e.strip().splitlines() for p, e in zip(procs, errors) if p.returncode and e.strip())
        return {"error": failed[-1], **({"traceback": failed[-40:]} if args.verbose else {})}
    ranks = [json.loads(o.read_text()) for o in outs]
    return {"steps": [round(r["steps"], 2) for r in ranks], "fit": [round(r["fit"], 2) for r in ranks],
            "whole_after": all(r["whole_after"] for r in ranks), "P_mib": round(ranks[0]["P_mib"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--verbose", action="store_true", help="a failed row's traceback too")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.blocks, args.width, args.steps, args.out)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = {row: _row(row, args, Path(tmp)) for row in args.rows}
    reference = {suffix: rows.get(f"model_parallel{suffix}", {}) for suffix in ("", "_empty")}
    for row, result in rows.items():
        ref = reference["_empty" if row.endswith("_empty") else ""]
        if "steps" in result and "steps" in ref:
            result["steps_vs_model_parallel"] = round(max(result["steps"]) / max(ref["steps"]), 2)
            result["fit_minus_whole_vs_model_parallel"] = round((max(result["fit"]) - 1) / max(ref["fit"]), 2)
    print(json.dumps({"model": f"{args.blocks} x Linear({args.width}, {args.width}) + ReLU, Adam",
                      "units": "P per rank above the RSS after imports", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
