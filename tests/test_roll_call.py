"""The roll call after an error (``strategies/roll_call.py``): ranks of a node gather only when every one of them is
at its teardown, and all of them take the same answer, early or late. Real ``torch.distributed`` stores (a TCP
store served on this host, one client per rank, as the ranks of a run reach the rendezvous store), a thread per rank.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dalle_lightning_plugins.strategies.roll_call import RollCall


@pytest.fixture()
def stores() -> list[dist.Store]:
    server = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, 3, False, timeout=timedelta(seconds=10)) for _ in range(2)]
    return [dist.PrefixStore("default_pg/", s) for s in (server, *clients)]  # as init_process_group wraps it


def _answer_in_thread(call: RollCall, store: dist.Store, after_s: float, out: dict[int, tuple[bool, float]],
                      i: int) -> threading.Thread:
    def run() -> None:
        time.sleep(after_s)
        start = time.monotonic()
        out[i] = (call.all_here(store), time.monotonic() - start)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _stage(stores: list[dist.Store], arrivals: list[float | None], wait_s: float) -> dict[int, tuple[bool, float]]:
    """One stage of ``len(arrivals)`` ranks; rank i reaches its teardown after ``arrivals[i]`` seconds, or never."""
    calls = [RollCall(wait_s=wait_s) for _ in arrivals]
    for call in calls:
        call.begin(list(range(len(arrivals))))
    for call in calls[1:]:  # in one process each begin is a new stage; each rank's process counts this one alike
        call.key = calls[0].key
    out: dict[int, tuple[bool, float]] = {}
    threads = [_answer_in_thread(call, stores[i], after, out, i)
               for i, (call, after) in enumerate(zip(calls, arrivals)) if after is not None]
    for thread in threads:
        thread.join(timeout=30)
    return out


def test_every_rank_here_gathers_at_once(stores: list[dist.Store]) -> None:
    out = _stage(stores, [0.0, 0.05, 0.1], wait_s=5.0)
    assert all(here for here, _ in out.values()), out
    assert max(seconds for _, seconds in out.values()) < 2.0, out  # no rank waits out the bound


def test_a_rank_that_never_comes_leaves_every_other_alone_after_the_bound(stores: list[dist.Store]) -> None:
    out = _stage(stores, [0.0, 0.0, None], wait_s=0.5)
    assert [here for here, _ in out.values()] == [False, False], out
    assert all(0.45 <= seconds < 3.0 for _, seconds in out.values()), out


def test_a_rank_that_comes_after_its_peers_gave_up_restores_alone_too(stores: list[dist.Store]) -> None:
    # ranks 0 and 1 give up after 0.3 s; rank 2 comes at 1 s: it counts itself in, so the count is whole, but
    # its peers' answer stands, or rank 2 would start a gather no peer joins
    out = _stage(stores, [0.0, 0.0, 1.0], wait_s=0.3)
    assert [out[i][0] for i in range(3)] == [False, False, False], out


def test_a_rank_that_gave_up_as_the_last_came_follows_the_gather(stores: list[dist.Store]) -> None:
    # once the count is whole every rank reads "gather", whatever its own clock said: nobody is left out of it
    out = _stage(stores, [0.0, 0.25, 0.25], wait_s=2.0)
    assert [out[i][0] for i in range(3)] == [True, True, True], out


def test_begin_keys_each_stage_and_node_apart() -> None:
    first, second, other_node = RollCall(), RollCall(), RollCall()
    first.begin([0, 1])
    second.begin([1, 0])
    other_node.begin([2, 3])
    assert first.key != second.key  # a later stage (a new Trainer's too) never reads an earlier decision
    assert first.key is not None and first.key.endswith("/0") and second.key.endswith("/0")  # the node: its first rank
    assert other_node.key is not None and other_node.key.endswith("/2")
    assert first.size == other_node.size == 2


def test_no_store_or_no_stage_means_alone(stores: list[dist.Store]) -> None:
    assert RollCall().all_here(stores[0]) is False  # begin never ran: a stage at one device per node
    nobody = RollCall()
    nobody.begin([])
    assert nobody.all_here(stores[0]) is False
    call = RollCall(wait_s=0.1)
    call.begin([0])
    assert call.all_here(stores[0]) is True  # a node of one is always all here
    assert call.all_here(stores[0]) is False  # once per stage
