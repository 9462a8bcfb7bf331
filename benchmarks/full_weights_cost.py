"""What whole weights after ``fit`` cost (``ShardedPowerSGDStrategy(full_weights_after=...)``, issue 61).

Two gloo processes on this machine, one node of 2 devices (FSDP2 shards every block), the project's prior trained
for 2 updates with AdamW, then the stage's end: with ``full_weights_after=True`` every sharded parameter is
gathered into a whole plain one on each rank (as ``ddp`` leaves a module), with ``False`` the shards stay.
``"auto"`` on a model it judges too large for a rank's memory is the third row: its cost is the decision (one
all-reduce of a flag); the threshold is lowered for that row (``FULL_WEIGHTS_MEMORY_SHARE``), since a model that
really exceeds half of this machine's memory per rank would not train on 2 CPU cores in minutes.

Per row and rank: seconds spent in the stage end (``WholeWeights.leave``, from the strategy's teardown), the process's resident memory just
before and after it, and its peak resident memory (``ru_maxrss``) over the whole run. Sizes: the demo's prior
(``conf/model/prior_shapes.yaml`` at the demo's vocabularies) and a 150M-parameter one (width 1024, 12 layers).

Usage: ``python benchmarks/full_weights_cost.py [--sizes demo large]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # DallePrior kwargs; "demo": the prior `make demo` trains (1.42M parameters)
    "demo": dict(text_vocab_size=351, text_len=20, image_vocab_size=512, image_grid=8, n_layer=6, n_head=4,
                 d_head=32, conv_kernel=5),
    "large": dict(text_vocab_size=16384, text_len=32, image_vocab_size=8192, image_grid=8, n_layer=12, n_head=16,
                  d_head=64, conv_kernel=5),
}
ROWS = ("whole", "kept", "auto_kept")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, port: int, size: str, row: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from dalle_lightning.lit.prior import PriorModule
    from dalle_lightning.models.prior import DallePrior
    from dalle_lightning_plugins.strategies import whole_weights
    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    torch.manual_seed(0)
    kwargs = SIZES[size]
    model = DallePrior(**kwargs, attn_impl="sparse", compile=False)
    params = sum(p.numel() for p in model.parameters())
    module = PriorModule(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), caption_dropout=0.0)
    n_image = kwargs["image_grid"] ** 2
    g = torch.Generator().manual_seed(rank)
    data = [{"text": torch.randint(0, kwargs["text_vocab_size"], (1, kwargs["text_len"]), generator=g)[0],
             "image": torch.randint(0, kwargs["image_vocab_size"], (1, n_image), generator=g)[0]} for _ in range(4)]
    if row == "auto_kept":
        whole_weights.FULL_WEIGHTS_MEMORY_SHARE = 1e-12  # the model "does not fit": auto keeps the shards
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, full_weights_after={"whole": True, "kept": False,
                                                                                "auto_kept": "auto"}[row])
    timing: dict[str, float] = {}
    leave = strategy.whole_weights.leave  # the end of the stage, timed where the strategy's teardown calls it

    def timed_leave(*args: Any, **kwargs: Any) -> Any:
        timing["rss_before_mib"] = _rss_mib()
        start = time.perf_counter()
        model = leave(*args, **kwargs)
        timing["end_of_stage_s"] = time.perf_counter() - start
        timing["rss_after_mib"] = _rss_mib()
        return model

    strategy.whole_weights.leave = timed_leave  # type: ignore[method-assign]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, precision="32-true")
    start = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=1))
    dtensors = sum(type(p).__name__ == "DTensor" for p in module.parameters())
    out.put((rank, {"params": params, "fit_s": round(time.perf_counter() - start, 2),
                    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "dtensors_after_fit": dtensors, **{k: round(v, 3) for k, v in timing.items()}}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: str, row: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, size, row, out)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return {f"rank{r}": ranks[r] for r in sorted(ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    results = {f"{size}/{row}": run(size, row) for size in args.sizes for row in ROWS}
    print(json.dumps({"machine": f"{os.cpu_count()} cores", "torch": torch.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
