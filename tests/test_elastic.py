"""What a restarted worker needs (``dalle_lightning_plugins/environments/elastic.py``, ``dalle_lightning/run/resume.py``,
``dalle_lightning/run/start_decision.py``), each against what it must do: a round's store that an earlier round's
leftover address cannot hijack, one checkpoint every rank holds, checkpoints ordered by their own step and agreed on
by their path relative to the work directory. Which launch continues: ``tests/test_launch_identity.py``; lost
peers against bugs: ``tests/test_peer_loss.py``. The whole, under ``torchrun --max-restarts`` between two
namespaces, is in ``tests/test_two_namespaces.py``."""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dalle_lightning.run.resume import checkpoint_step, launch_checkpoints, newest_complete
from dalle_lightning.run.start_decision import decide_start, record_launch
from dalle_lightning_plugins.environments import elastic
from dalle_lightning_plugins.environments.launch_identity import this_launch
from tests.helpers.distributed import run_distributed


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("leftover", ["dead_port", "other_store"])
def test_a_round_store_ignores_what_an_earlier_round_left(leftover: str) -> None:
    """torchrun's agents keep one store over every round; the earlier round's published store is dead (its rank 0
    is gone) or its port now serves something else. The non-zero rank must wait for this round's, whichever
    starts first."""
    timeout = timedelta(seconds=20)
    agents = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timeout)
    other = None
    if leftover == "dead_port":
        agents.set(elastic.ROUND_KEY, f"{_dead_port()}:oldtoken")
    else:
        other = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
        other.set(elastic.TOKEN_KEY, "someone-else")
        agents.set(elastic.ROUND_KEY, f"{other.port}:oldtoken")
    stores: dict[int, dist.Store] = {}

    def rank(r: int) -> None:
        stores[r] = elastic.round_store("127.0.0.1", agents.port, r, 2, timeout)

    late_leader = threading.Timer(0.5, rank, args=(0,))  # rank 1 reads the leftover first
    follower = threading.Thread(target=rank, args=(1,))
    follower.start()
    late_leader.start()
    follower.join(30)
    late_leader.join(30)
    assert set(stores) == {0, 1}
    stores[0].set("hello", "from rank 0")
    assert stores[1].get("hello") == b"from rank 0"  # one store: this round's
    assert stores[1].get(elastic.TOKEN_KEY) == stores[0].get(elastic.TOKEN_KEY) != b"someone-else"


def _agree(rank: int, world_size: int, lists: list[list[str]]) -> str | None:
    return elastic.agree_on_checkpoint(lists[rank])


def test_ranks_agree_on_the_newest_checkpoint_they_all_hold() -> None:
    behind = [["c3", "c2", "c1"], ["c2", "c1"]]  # rank 1 does not see c3 (yet): both take c2
    assert run_distributed(_agree, 2, behind) == ["c2", "c2"]
    assert run_distributed(_agree, 2, [["c1"], ["c2"]]) == [None, None]
    assert elastic.agree_on_checkpoint(["c2", "c1"]) == "c2"  # one process: its newest


def _checkpoint(run: Path, name: str, step: int, mtime: int) -> Path:
    """A complete checkpoint file of update ``step`` whose file time says ``mtime`` (a copy without ``-p``, a
    client's clock)."""
    path = run / "checkpoints" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_checkpoints_are_ordered_by_their_own_step_not_by_file_time(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "prior"
    older = runs / "2026-11-28_07-00-00_aaaa"
    _checkpoint(older, "step=30.ckpt", 30, mtime=1_700_000_900)  # copied last: the newest file time of all
    run = runs / "2026-11-28_08-00-00_bbbb"  # began later: resume=auto's run
    _checkpoint(run, "step=20.ckpt", 20, mtime=1_700_000_500)
    _checkpoint(run, "step=10.ckpt", 10, mtime=1_700_000_800)  # an older update with a newer file time
    assert checkpoint_step(run / "checkpoints" / "step=20.ckpt") == 20
    assert newest_complete([older, run])[0] == run / "checkpoints" / "step=20.ckpt"
    # one launch's attempts continue each other: across its directories the highest step is the newest
    assert [step for _, step in launch_checkpoints([older, run])] == [30, 20, 10]


def _decide_on_mount(rank: int, world_size: int, mounts: list[str]) -> tuple[str, str | None]:
    """A requeued job's rank on a node that mounts the work directory at ``mounts[rank]``."""
    work = Path(mounts[rank])
    cfg = OmegaConf.create({"paths": {"runs": str(work / "runs"), "work_dir": str(work)}, "stage": {"name": "prior"},
                            "resume": None})
    requeued = this_launch({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"})
    decision = decide_start(cfg, None, None, None, ["stage=prior"], requeued)
    return decision.kind, decision.checkpoint


def test_nodes_that_mount_the_work_dir_at_different_paths_agree_on_the_checkpoint(tmp_path: Path) -> None:
    node0 = tmp_path / "mnt" / "shared"
    run = node0 / "runs" / "prior" / "2026-11-28_08-00-00_aaaa"
    run.mkdir(parents=True)
    record_launch(run, this_launch({"SLURM_JOB_ID": "9"}), ["stage=prior"])  # the job's first start, then killed
    _checkpoint(run, "last.ckpt", 8, mtime=1_700_000_000)
    node1 = tmp_path / "data" / "shared"
    node1.parent.mkdir()
    node1.symlink_to(node0)  # the same file system, another mount point
    got = run_distributed(_decide_on_mount, 2, [str(node0), str(node1)], start_method="fork")
    assert got == [("continue", str(run / "checkpoints" / "last.ckpt")),
                   ("continue", str(node1 / "runs" / "prior" / run.name / "checkpoints" / "last.ckpt"))]


def test_a_second_group_in_one_process_takes_the_new_store() -> None:
    """Two fits in one torchrun process: the first round's store still answers (its leader object lives), and its
    token is still published when a follower asks; the follower waits for the new one."""
    timeout = timedelta(seconds=20)
    agents = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timeout)
    kept: list[dict[int, dist.Store]] = []  # the first round's leader keeps serving
    for _ in range(2):
        stores: dict[int, dist.Store] = {}
        kept.append(stores)

        def rank(r: int) -> None:
            stores[r] = elastic.round_store("127.0.0.1", agents.port, r, 2, timeout)

        follower = threading.Thread(target=rank, args=(1,))
        follower.start()
        late_leader = threading.Timer(0.5, rank, args=(0,))
        late_leader.start()
        follower.join(30)
        late_leader.join(30)
        assert stores[1].get(elastic.TOKEN_KEY) == stores[0].get(elastic.TOKEN_KEY)
    assert kept[0][0].get(elastic.TOKEN_KEY) != kept[1][0].get(elastic.TOKEN_KEY)
