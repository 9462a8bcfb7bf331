"""Exact resume on 2 simulated nodes x 2 devices (4 gloo processes): FSDP2 within a node, PowerSGD between nodes,
per-resblock fp16 gradient scales, sharded DCP checkpoints. Killed with SIGKILL on every rank at an arbitrary update
and resumed with ``resume=auto``, the run ends bit-identical to the uninterrupted one.

What must come back on every rank: the model and optimizer shards, PowerSGD's error buffers and Q, the resblock
scales, the EMA shards, the schedules, each rank's random states (the dVAE's Gumbel noise, the prior's caption
dropout) and each rank's place in the shared, epoch-seeded sample order (each rank keeps its own sample of every
group of 4). Each rank has 10 training samples: 3 batches of 4 per epoch, 2 updates of 2 accumulated micro-batches.

The processes are forked from this one (``run_distributed(start_method="fork")``), so they skip the imports, and
run the ``dalle-train`` app as an external launcher (torchrun, SLURM) would start it.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

import pytest
import torch

from tests.conftest import run_app
from tests.helpers.distributed import WorkerError, run_distributed
from tests.resume_utils import killer, max_dw, train_args
from tests.test_strategy_common import external_launch_env

SHARDED = ["strategy=sharded_powersgd", "strategy.devices_per_node=2", "trainer.devices=4", "precision=resblock16",
           "strategy.timeout=120", "trainer.accumulate_grad_batches=2", "callbacks.checkpoint.every_n_train_steps=3"]
TIMEOUT = 300.0


def _worker(rank: int, world_size: int, overrides: list[str]) -> None:
    from dalle_lightning.cli import train

    external_launch_env(rank)
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(TIMEOUT - 30)  # a rank that hangs shows where before it is killed
    # One copy of the run's Hydra files (every rank composes the same config into the same run directory).
    run_app(train.main, *overrides, *([] if rank == 0 else ["hydra.output_subdir=null"]))


def _train(work: Path, stage: str, name: str, *extra: str) -> None:
    # fp16 convolutions have no fast CPU kernels: the dVAE's branches compute in bf16 (scales are kept all the same)
    dtype = ["precision.dtype=bf16"] if stage == "dvae" else []
    run_distributed(_worker, 4, train_args(work, stage, name, *SHARDED, *dtype, *extra, batch_size=4),
                    timeout=TIMEOUT, start_method="fork")


def _train_killed(work: Path, stage: str, name: str, update: int, micro_batch: int) -> None:
    with pytest.raises(WorkerError, match="exit code -9"):
        _train(work, stage, name, *killer(update, micro_batch))


@pytest.mark.slow  # three 4-process runs
@pytest.mark.distributed
@pytest.mark.parametrize(("stage", "update", "micro_batch"), [("prior", 4, 1), ("dvae", 7, 0)],
                         ids=["prior-mid-window", "dvae-after-epoch-end"])
def test_sharded_powersgd_run_killed_and_resumed_ends_bit_identical(resume_work: Path, stage: str, update: int,
                                                                    micro_batch: int) -> None:
    """prior: checkpoint mid-epoch (update 3), killed half-way through the window after update 4.
    dVAE: checkpoint at an epoch's end (update 6), killed before the last micro-batch of the next epoch."""
    work = resume_work
    _train(work, stage, f"sharded-{stage}-uninterrupted")
    _train_killed(work, stage, f"sharded-{stage}-killed", update, micro_batch)
    assert (work / "runs" / stage / f"sharded-{stage}-killed" / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    _train(work, stage, f"sharded-{stage}-resumed", "resume=auto")
    dw = max_dw(work / f"sharded-{stage}-uninterrupted.pt", work / f"sharded-{stage}-resumed.pt")
    print(f"{stage} 2x2 PowerSGD, killed before micro-batch {micro_batch} after update {update}: max|dw|={dw}")
    assert dw == 0.0
