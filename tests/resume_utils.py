"""Kill-and-resume runs of ``dalle-train`` for the exact-resume tests: a tiny pipeline, each stage's tiny overrides,
a run killed with SIGKILL at a chosen update, and the comparison of two artifacts.

The pipeline is small enough that epochs are short (40 training samples: 5 batches of 8 single-process, 3 batches
of 4 per rank on 4 ranks), so 12 updates cross several epoch boundaries and validations.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import torch

from tests.conftest import _save_dvae, run_app
from tests.helpers.fork_safety import autograd_survives_fork

N_TRAIN, N_VAL = 40, 16
STEPS = 12

STAGES = {
    "dvae": ["stage=dvae", "model.n_hid=8", "model.vocab_size=32", "model.codebook_dim=16", "~callbacks.recon_grid",
             "callbacks.ema.update_starting_at_step=4", "callbacks.kl_weight.steps=5"],
    "clip": ["stage=clip"],  # reconstructions by the pipeline's dVAE, hard negatives: both draw at random
    "prior": ["stage=prior", "model.n_layer=2", "model.n_head=2", "model.d_head=8", "module.caption_dropout=0.5",
              "callbacks.ema.update_starting_at_step=4", "~callbacks.fid", "~callbacks.sample_grid"],
}
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.limit_val_batches=1",
         "callbacks.checkpoint.save_top_k=0"]  # keep last.ckpt only


def build_work(work: Path) -> Path:
    """World shards, a tokenizer, a (random, tiny) dVAE and the token shards it encodes: every stage can train."""
    from dalle_lightning.cli import data, encode, train

    run_app(data.main, f"paths.work_dir={work}", f"n_train={N_TRAIN}", f"n_val={N_VAL}", "n_zeroshot=4", "shard_size=20")
    run_app(train.main, "stage=tokenizer", f"paths.work_dir={work}")
    _save_dvae(work / "dvae.pt", seed=0)
    run_app(encode.main, f"paths.work_dir={work}", "batch_size=16", "num_workers=0")
    return work


def train_args(work: Path, stage: str, name: str, *extra: str, batch_size: int = 8) -> list[str]:
    """Overrides of one run: its own Hydra run directory and artifact (``<work>/<name>.pt``)."""
    return [*STAGES[stage], f"paths.work_dir={work}", f"trainer.max_steps={STEPS}", f"data.batch_size={batch_size}",
            *QUIET,
            f"hydra.run.dir={work / 'runs' / stage / name}", f"output={work / name}.pt", *extra]


def killer(update: int, micro_batch: int) -> list[str]:
    return ["+callbacks.killer._target_=tests.kill_at.KillAt", f"+callbacks.killer.update={update}",
            f"+callbacks.killer.micro_batch={micro_batch}"]


def last_checkpoint(work: Path, stage: str, name: str) -> Path:
    return work / "runs" / stage / name / "checkpoints" / "last.ckpt"


def _train_then_exit(overrides: list[str], threads: int) -> None:
    from dalle_lightning.cli import train

    # A spawned child: this process's thread count (the same arithmetic), and the platform's own start method for
    # its DataLoader workers (multiprocessing makes a spawned child's default "spawn"), as a user's process has.
    torch.set_num_threads(threads)
    mp.set_start_method("fork", force=True)

    try:
        run_app(train.main, *overrides)
    finally:
        os._exit(3)  # reached only if the killer never fired


def train_killed(overrides: list[str]) -> None:
    """Train in a forked child (this process's imports, no start-up cost) that must die by SIGKILL
    (``tests/helpers/fork_safety.py``: a spawned one where forking is unsafe)."""
    # forked (this process's imports) unless a compile test ran here before: then a fresh interpreter
    start = "fork" if autograd_survives_fork() else "spawn"
    child = mp.get_context(start).Process(target=_train_then_exit, args=(overrides, torch.get_num_threads()))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL, f"the run was not killed (exit code {child.exitcode})"


def max_dw(a: Path, b: Path) -> float:
    """Largest absolute difference between two artifacts' weights (they must hold the same tensors)."""
    from dalle_lightning.artifacts import read_file

    sa, sb = read_file(a)["state_dict"], read_file(b)["state_dict"]
    assert set(sa) == set(sb)
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)
