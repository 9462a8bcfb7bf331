"""What a restarted worker needs (``dalle_lightning_plugins/elastic.py``, ``dalle_lightning/cli/resume.py``), each
against what it must do: launch ids from the launchers' own environment, a round's store that an earlier round's
leftover address cannot hijack, one checkpoint every rank holds, the runs of this launch only, and a lost peer
that ends in one line. The whole, under ``torchrun --max-restarts`` between two namespaces, is in
``tests/test_two_namespaces.py``."""

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

from dalle_lightning.cli.common import lost_peer
from dalle_lightning.cli.resume import LAUNCH_FILE, launch_runs, record_launch, restart_checkpoint
from dalle_lightning_plugins import elastic
from tests.helpers.distributed import run_distributed


def test_launch_ids_name_the_agent_the_rendezvous_and_the_job() -> None:
    torchrun = {"TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_ab12/none_cd34/attempt_2/1/error.json",
                "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"}
    (agent,) = elastic.launch_ids(torchrun)
    assert agent == f"torchelastic:{socket.gethostname()}:/tmp/torchelastic_ab12/none_cd34"  # attempt-free
    again = dict(torchrun, TORCHELASTIC_ERROR_FILE="/tmp/torchelastic_ab12/none_cd34/attempt_3/0/error.json")
    assert elastic.launch_ids(again) == [agent]  # the next restart, another local rank: the same launch
    assert elastic.launch_ids(dict(torchrun, TORCHELASTIC_RUN_ID="job7"))[1] == "rdzv:job7"
    assert elastic.launch_ids({"SLURM_JOB_ID": "99", "SLURM_RESTART_COUNT": "1"}) == ["slurm:99"]
    assert elastic.launch_ids({"SLURM_JOB_ID": "99", "SLURM_ARRAY_JOB_ID": "98", "SLURM_ARRAY_TASK_ID": "3"}) == ["slurm:98_3"]
    assert elastic.launch_ids({}) == []  # a plain run, or Lightning's own launcher: nothing restarts it
    assert elastic.restart_count(torchrun) == 2 and elastic.restart_count({}) == 0


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


def _run(runs: Path, name: str, ids: list[str] | None, finished: bool = False, steps: tuple[int, ...] = ()) -> Path:
    run = runs / "prior" / name
    (run / "checkpoints").mkdir(parents=True)
    if ids is not None:
        record_launch(run, ids)
    for step in steps:  # written in order, an update a second apart: resume=auto orders by modification time
        path = run / "checkpoints" / f"step={step}.ckpt"
        torch.save({"global_step": step}, path)
        os.utime(path, (1_700_000_000 + step, 1_700_000_000 + step))
    if finished:
        (run / "metrics.json").write_text("{}")
    return run


def test_a_restart_continues_its_own_launch_only(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    ours = ["torchelastic:host:/tmp/torchelastic_a/none_b"]
    mine = _run(runs, "1-first-attempt", ours, steps=(10, 20))
    _run(runs, "0-earlier-launch", ["torchelastic:host:/tmp/torchelastic_z/none_y"], steps=(10, 20, 30, 40))
    _run(runs, "2-plain-run", None, steps=(50,))  # newer, but no restarting launcher made it
    _run(runs, "3-finished", ours, finished=True, steps=(60,))  # ours, but it ended: never continued
    cfg = OmegaConf.create({"paths": {"runs": str(runs)}, "stage": {"name": "prior"}})
    assert launch_runs((runs / "prior").glob("*"), ours) == [mine]

    new_dir = _run(runs, "4-second-attempt", None)
    chosen = restart_checkpoint(cfg, None, new_dir, None, ours)
    assert chosen == str(mine / "checkpoints" / "step=20.ckpt")
    assert OmegaConf.load(new_dir / LAUNCH_FILE)["ids"] == ours  # a third attempt finds this one too

    # one SLURM job's second run of another command is not a restart of the first
    job = ["slurm:77"]
    _run(runs, "6-job-first-run", None, steps=(10,))
    record_launch(runs / "prior" / "6-job-first-run", job, ["stage=prior", "trainer.max_steps=10"])
    assert launch_runs((runs / "prior").glob("*"), job, ["stage=prior", "trainer.max_steps=99"]) == []
    assert launch_runs((runs / "prior").glob("*"), job, ["stage=prior", "trainer.max_steps=10", "resume=auto"]) == [
        runs / "prior" / "6-job-first-run"]

    # a launch's first start (no run of it yet) goes on with what resume= asked for; no launcher: nothing changes
    fresh = ["torchelastic:host:/tmp/torchelastic_new/none_c"]
    assert restart_checkpoint(cfg, None, _run(runs, "5-new-launch", None), None, fresh) is None
    assert restart_checkpoint(cfg, "given.ckpt", None, None, []) == "given.ckpt"


def test_lost_peers_are_told_from_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    ours = RuntimeError("node 0 (rank 0): the inter-node gradient exchange with node(s) [1] failed after 8.0 s")
    assert lost_peer(ours)
    assert lost_peer(dist.DistNetworkError("connect failed"))
    wrapped = RuntimeError("could not save")
    wrapped.__cause__ = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv")
    assert lost_peer(wrapped)
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))  # a bug keeps its traceback
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not lost_peer(ours)  # one process has no peer


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
