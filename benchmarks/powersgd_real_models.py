"""PowerSGD on the project's own models: exactness at full rank and the loss curve at the default rank (JSON).

2 simulated nodes x 2 devices (4 gloo processes on 127.0.0.1), fp32, SGD.

- ``exact``: the largest relative parameter error of the dVAE and the prior after 3 updates at full PowerSGD
  rank against the same updates in one process on the full batch (the test asserts < 1e-5).
- ``curve``: the prior trained ``--steps`` updates (AdamW, the stage's betas) on a learnable token task (each image token is a fixed
  function of the caption) at PowerSGD rank 4 (the default) and at full rank (exact data parallelism); the
  mean training loss over all ranks every ``--every`` updates, and the final ratio of the two.

Usage: ``python benchmarks/powersgd_real_models.py [--steps 300] [--every 25]``
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tests.helpers.distributed import run_distributed  # noqa: E402
from tests.test_strategy_common import external_launch_env, trainer  # noqa: E402
from tests.test_strategy_exact_models import (  # noqa: E402
    WORLD,
    Dicts,
    _worker as exact_worker,
    reference,
    relative_errors,
)

BATCH, TEXT_LEN, GRID, VOCAB = 8, 6, 4, 16


def task(n: int) -> Dicts:
    """Captions of random words; image token j is (word j mod 6 + j) mod 16: learnable, not memorisable."""
    g = torch.Generator().manual_seed(3)
    text = torch.randint(1, 20, (n, TEXT_LEN), generator=g)
    j = torch.arange(GRID * GRID)
    image = (text[:, j % TEXT_LEN] + j) % VOCAB
    return Dicts(text=text, image=image)


def _curve_worker(rank: int, world_size: int, steps: int, powersgd_rank: int) -> list[float]:
    import lightning.pytorch as L

    from dalle_lightning.lit.prior import PriorModule
    from dalle_lightning.models.prior import DallePrior
    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.values.append(float(outputs["loss"]))

    external_launch_env(rank)
    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=20, text_len=TEXT_LEN, image_vocab_size=VOCAB, image_grid=GRID, n_layer=2,
                       n_head=2, d_head=16)
    module = PriorModule(model, functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.96)), caption_dropout=0.0)
    data = task(steps * BATCH * WORLD)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(rank, len(data), WORLD)), batch_size=BATCH)
    losses = Losses()
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=powersgd_rank, min_compression=0.0)
    trainer(strategy, max_steps=steps, precision="32-true", callbacks=[losses]).fit(module, loader)
    return losses.values


def curve(steps: int, powersgd_rank: int) -> list[float]:
    per_rank = run_distributed(_curve_worker, WORLD, steps, powersgd_rank, timeout=3600)
    return [sum(values) / len(values) for values in zip(*per_rank)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()

    start = time.perf_counter()
    results = run_distributed(exact_worker, WORLD, timeout=600)
    exact = {}
    for name in ("dvae", "prior", "prior_one_node"):
        errors = relative_errors(results[0][name], reference(name.split("_")[0]))
        exact[name] = {"max_relative_error": max(errors.values()), "worst": max(errors, key=errors.get)}

    low, full = curve(args.steps, 4), curve(args.steps, 10_000)
    window = max(1, args.every)
    smooth = lambda xs, i: sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1])  # noqa: E731
    points = [{"update": i + 1, "rank_4": round(smooth(low, i), 4), "full_rank": round(smooth(full, i), 4)}
              for i in range(window - 1, args.steps, window)]
    print(json.dumps({
        "mesh": "2 nodes x 2 devices (gloo)",
        "exact": exact,
        "curve": points,
        "final_loss_ratio_rank4_over_exact": round(points[-1]["rank_4"] / points[-1]["full_rank"], 4),
        "wall_time_s": round(time.perf_counter() - start, 1),
    }, indent=2))


if __name__ == "__main__":
    main()
