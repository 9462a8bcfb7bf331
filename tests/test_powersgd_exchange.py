"""The cost-saving form of the PowerSGD exchange gives the textbook numbers with fewer collectives.

- The factors are computed transposed (P^T = Q^T M^T, Q'^T = P^T M) and written straight into the gradient:
  checked against the formulas of the paper's algorithm written out by hand.
- P's of one shape share one batched QR: checked against one QR per matrix.
- ``dense_with_p`` sends the uncompressed gradients in P's all-reduce: the same averages, one collective fewer.
- The strategy agrees on unused parameters and the skip decision in one collective: a synchronised step of
  ``ShardedPowerSGDStrategy`` at one device per node without overlap issues three all-reduces (flags, dense + P,
  Q'); the overlapped exchange is ``tests/test_exchange_overlap.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dalle_lightning_plugins.compression.householder import orthogonalize, orthogonalize_all
from dalle_lightning_plugins.compression.powersgd import PowerSGD
from tests.helpers.distributed import run_distributed


def test_orthogonalize_all_matches_one_qr_per_matrix() -> None:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen) for s in [(6, 2), (6, 2), (9, 3), (6, 2), (4, 4)]]
    ps.append(torch.zeros(6, 2))  # rank-deficient: filled by eps * I, in the batch as alone
    for got, p in zip(orthogonalize_all(ps), ps):
        torch.testing.assert_close(got, orthogonalize(p), atol=1e-6, rtol=0)


def test_low_rank_step_matches_the_textbook_formulas() -> None:
    """One replica's arithmetic (no process group: the means are the local values) against the formulas."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"a": (12, 5), "b": (12, 5), "conv": (7, 2, 3), "wide": (3, 10)}
    psgd = PowerSGD(None, rank=2)
    errors = {n: 0.1 * torch.randn(s[0], int(torch.tensor(s[1:]).prod()), generator=gen) for n, s in shapes.items()}
    for name, e in errors.items():
        psgd._error_buffer(name, e.shape, e.device).copy_(e)
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    expected_grad, expected_error = {}, {}
    for name, g in grads.items():
        m = g.reshape(g.shape[0], -1) + errors[name]
        q = psgd._fixed_q(name, m.shape[1], 2, m.device)
        p = orthogonalize(m @ q)
        approx = p @ (m.T @ p).T
        expected_grad[name], expected_error[name] = approx.view(g.shape), m - approx
    sent = psgd._reduce_low_rank([psgd.form(n, g, 2, staged=False) for n, g in grads.items()])
    for name, g in grads.items():
        torch.testing.assert_close(g, expected_grad[name], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(psgd._error[name], expected_error[name], atol=1e-5, rtol=1e-5)
    assert sent == 4 * sum(2 * (s[0] + int(torch.tensor(s[1:]).prod())) for s in shapes.values())


def _dense_with_p(rank: int, world_size: int) -> dict:
    calls: list[int] = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(tensor.numel())
        return real(tensor, op=op, group=group, async_op=async_op)

    out: dict = {}
    for fused in (False, True):
        gen = torch.Generator().manual_seed(10 + rank)
        grads = [("w", torch.randn(8, 6, generator=gen)), ("bias", torch.randn(5, generator=gen)),
                 ("emb", torch.randn(4, 3, generator=gen))]
        psgd = PowerSGD(None, rank=2, min_compression=0.0, dense_with_p=fused)
        calls.clear()
        dist.all_reduce = counting
        try:
            assert psgd.reduce(grads, uncompressed={"emb"})
        finally:
            dist.all_reduce = real
        out[fused] = {"grads": {n: g for n, g in grads}, "calls": list(calls), "sent": psgd.stats.bytes_sent_last_step}
    return out


@pytest.mark.distributed
def test_dense_gradients_ride_in_the_p_all_reduce() -> None:
    for res in run_distributed(_dense_with_p, 2):
        apart, fused = res[False], res[True]
        assert apart["calls"] == [1, 5 + 12, 8 * 2, 6 * 2]  # flag, dense, P, Q'
        assert fused["calls"] == [1, 5 + 12 + 8 * 2, 6 * 2]  # flag, dense + P, Q'
        assert fused["sent"] == apart["sent"]
        for name, g in apart["grads"].items():
            torch.testing.assert_close(fused["grads"][name], g, atol=1e-6, rtol=0)


def _strategy_step_collectives(rank: int, world_size: int) -> dict:
    from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, token_dataset, trainer
    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    strategy = ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=1, overlap=False)  # rank 1: every matrix compressed
    calls: list[tuple[int, str]] = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tensor.numel(), str(op)))
        return real(tensor, op=op, group=group, async_op=async_op)

    original = strategy.reduce_gradients

    def counted() -> bool:
        calls.clear()
        dist.all_reduce = counting
        try:
            return original()
        finally:
            dist.all_reduce = real

    strategy.reduce_gradients = counted  # type: ignore[method-assign]
    trainer(strategy, devices=2, max_steps=2).fit(module, loader(token_dataset(), rank, world_size=2))
    return {"calls": calls, "skipped": strategy.powersgd.stats.skipped_steps}


@pytest.mark.distributed
def test_strategy_step_at_one_device_per_node_has_three_all_reduces() -> None:
    for res in run_distributed(_strategy_step_collectives, 2, timeout=120):
        ops = [op for _, op in res["calls"]]
        assert len(res["calls"]) == 3, res["calls"]
        assert "MAX" in ops[0] and all("SUM" in op for op in ops[1:])
        assert res["skipped"] == 0
