"""Exact resume, single process: a run killed with SIGKILL at an arbitrary update and resumed from its last
checkpoint ends with the same weights, bit for bit, as the run that was never interrupted.

Every stage trains 12 updates of 2 accumulated micro-batches on 5 batches per epoch (windows of 2, 2 and 1), with a
checkpoint every 2 updates: checkpoints fall mid-epoch and at epoch ends, and the kills fall mid-epoch, mid
accumulation window and right before an epoch's first batch. What the runs draw at random: the dVAE's Gumbel noise,
the prior's caption dropout (torch), CLIP's dVAE reconstructions and hard negatives (its own generator), every
epoch's shuffle. A killed run writes no artifact; the resumed run writes the whole model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_app
from tests.resume_utils import killer, last_checkpoint, max_dw, train_args, train_killed

pytestmark = pytest.mark.usefixtures("one_thread")

CADENCE = ["trainer.accumulate_grad_batches=2", "callbacks.checkpoint.every_n_train_steps=2"]

# (stage, seed, kill points (update, micro-batch of the window that follows it), more overrides). Checkpoints at
# updates 4 and 8 fall mid-epoch, at 6 at an epoch's end; micro-batch 1 is half-way through a window, and the batch
# after update 9 starts an epoch. Loader workers each read their own part of the stream (and are started anew each
# epoch); the per-resblock fp16 scales grow at every update.
SLOW = pytest.mark.slow  # one case stays in `make test-fast`; the others run in the full suite
CASES = [
    pytest.param("dvae", 0, [(7, 1), (4, 1)], [], marks=SLOW),
    pytest.param("dvae", 1, [(9, 0)], [], marks=SLOW),
    pytest.param("clip", 0, [(7, 1)], [], marks=SLOW),
    pytest.param("clip", 1, [(4, 1)], [], marks=SLOW),
    pytest.param("prior", 0, [(7, 1), (4, 1)], [], marks=SLOW),
    pytest.param("prior", 1, [(9, 0)], []),
    pytest.param("prior", 2, [(7, 1)], ["data.num_workers=2"], marks=SLOW),
    pytest.param("prior", 3, [(4, 1)], ["precision=resblock16"], marks=SLOW),
]


def _train(work: Path, stage: str, name: str, seed: int, *extra: str) -> None:
    from dalle_lightning.cli import train

    run_app(train.main, *train_args(work, stage, name, f"seed={seed}", *CADENCE, *extra))


@pytest.mark.parametrize(("stage", "seed", "kills", "extra"), CASES, ids=[f"{c.values[0]}-seed{c.values[1]}" for c in CASES])
def test_killed_and_resumed_run_ends_bit_identical(resume_work: Path, stage: str, seed: int,
                                                   kills: list[tuple[int, int]], extra: list[str]) -> None:
    work = resume_work
    reference = f"{stage}-s{seed}-uninterrupted"
    _train(work, stage, reference, seed, *extra)
    for update, micro_batch in kills:
        killed, resumed = f"{stage}-s{seed}-killed{update}.{micro_batch}", f"{stage}-s{seed}-resumed{update}.{micro_batch}"
        train_killed(train_args(work, stage, killed, f"seed={seed}", *CADENCE, *extra, *killer(update, micro_batch)))
        assert not (work / f"{killed}.pt").exists()
        _train(work, stage, resumed, seed, *extra, f"resume={last_checkpoint(work, stage, killed)}")
        dw = max_dw(work / f"{reference}.pt", work / f"{resumed}.pt")
        print(f"{stage} seed={seed} {' '.join(extra)} killed before micro-batch {micro_batch} after update {update}: "
              f"max|dw|={dw}")
        assert dw == 0.0


@pytest.mark.slow
def test_resume_auto_twice_over_an_existing_artifact(resume_work: Path) -> None:
    """A resumed run killed again resumes again (its own checkpoints carry on), ``resume=auto`` finds the newest
    checkpoint, and an artifact already at ``output`` is replaced, not reused."""
    work, stage, seed = resume_work, "dvae", 2
    _train(work, stage, "twice-uninterrupted", seed)
    train_killed(train_args(work, stage, "twice-killed", f"seed={seed}", *CADENCE, *killer(4, 1)))
    train_killed(train_args(work, stage, "twice-killed-again", f"seed={seed}", *CADENCE, "resume=auto", *killer(10, 1)))
    (work / "twice-resumed.pt").write_bytes((work / "dvae.pt").read_bytes())  # an earlier artifact is in the way
    _train(work, stage, "twice-resumed", seed, "resume=auto")
    dw = max_dw(work / "twice-uninterrupted.pt", work / "twice-resumed.pt")
    print(f"dvae seed={seed} killed after updates 4 and 10, resumed twice with resume=auto: max|dw|={dw}")
    assert dw == 0.0
