"""The step's flags (``dalle_lightning_plugins.compression.step_flags``), which both exchange paths and PowerSGD on its own
agree through: one collective answers whether any gradient anywhere is non-finite, which whole parameters some
rank used (zeros where another rank has a gradient, None where nobody has), and which embedding rows some rank
used; every rank gets the same answers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.compression.step_flags import RowSparse, agree_step_flags, finite_per_tensor, used_rows
from tests.helpers.distributed import run_distributed


def test_finite_per_tensor_against_isfinite() -> None:
    values = [torch.ones(3), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")]), torch.zeros(0),
              torch.full((4,), 3e38)]  # large but finite: the check itself must not overflow
    assert finite_per_tensor(values).tolist() == [bool(torch.isfinite(v).all()) for v in values]


def test_one_process_needs_no_collective() -> None:
    emb = nn.Parameter(torch.zeros(5, 2))
    emb.grad = torch.zeros(5, 2)
    emb.grad[3, 1] = 2.0
    unused = nn.Parameter(torch.zeros(2))
    flags = agree_step_flags([emb.grad], whole=[emb, unused], row_sparse=[RowSparse("emb", emb.grad, 0, 5, 5)])
    assert flags.finite and flags.rows["emb"].tolist() == [3] and flags.row_mask_bytes == 5
    assert unused.grad is None  # nobody used it
    emb.grad[0, 0] = float("nan")
    assert not agree_step_flags([emb.grad]).finite
    assert used_rows(torch.zeros(2, 3)).tolist() == [0, 0]


def _two_ranks(rank: int, world_size: int) -> dict:
    shared = nn.Parameter(torch.zeros(3))  # used on rank 0 only
    nobody = nn.Parameter(torch.zeros(3))
    emb = nn.Parameter(torch.zeros(6, 2))  # whole on both ranks
    emb.grad = torch.zeros(6, 2)
    emb.grad[1 + 3 * rank] = 1.0  # rank 0 uses row 1, rank 1 row 4
    half = torch.zeros(3, 2)  # rows 3 * rank .. 3 * rank + 2 of a 6-row table, as FSDP2 shards it over 2 ranks
    half[2 - rank] = 1.0  # rank 0 uses its row 2 (row 2 of the table), rank 1 its row 1 (row 4)
    if rank == 0:
        shared.grad = torch.ones(3)
    calls: list[str] = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(str(op))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    try:
        grads = [g for g in (shared.grad, emb.grad) if g is not None]
        first = agree_step_flags(grads, whole=[shared, nobody], row_sparse=[
            RowSparse("emb", emb.grad, 0, 6, 6), RowSparse("half", half, 3 * rank, 3, 6)])
        bad = torch.tensor([float("inf") if rank == 1 else 0.0])  # non-finite on rank 1 only
        second = agree_step_flags([bad])
    finally:
        dist.all_reduce = real
    return {"finite": (first.finite, second.finite), "rows": first.rows["emb"].tolist(), "calls": calls,
            "half": first.rows["half"].tolist(), "mask_bytes": first.row_mask_bytes,
            "shared": None if shared.grad is None else shared.grad.tolist(), "nobody": nobody.grad}


@pytest.mark.distributed
def test_two_ranks_agree_in_one_collective() -> None:
    results = run_distributed(_two_ranks, 2, timeout=120)
    for res in results:
        assert res["finite"] == (True, False)  # the second: rank 1's infinity skips both
        assert res["rows"] == [1, 4]  # the union of the used rows
        assert res["mask_bytes"] == 12  # both masks in the whole tables' rows
        assert len(res["calls"]) == 2 and all("MAX" in c for c in res["calls"])  # one collective per call
        assert res["nobody"] is None
    assert results[0]["shared"] == [1.0, 1.0, 1.0] and results[1]["shared"] == [0.0, 0.0, 0.0]
    # a row shard learns the rows used in its own part of the table, in its own row numbers: rows 2 and 4 of
    # the table are rank 0's row 2 and rank 1's row 1
    assert results[0]["half"] == [2] and results[1]["half"] == [1]
