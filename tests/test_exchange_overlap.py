"""The overlapped exchange (``dalle_lightning_plugins.compression.exchange``) against the end-of-backward path it replaces.

2 processes, 2 nodes x 1 device (gloo), the tiny residual model of ``tests/test_strategy_common.py``:

- at low rank the overlapped run lands on the end-of-backward run's weights within fp32 rounding, and at full
  rank on exact data parallelism (one process, the full batch);
- the P all-reduces of the resblocks are issued during the backward, before the step waits;
- a non-finite gradient on one rank skips the update on both and leaves every error buffer as it was;
- an embedding is sent only in the rows some rank used, and a branch only one rank takes still averages;
- ``compression`` picks the rank that saves that share of bytes; setting it with a rank is an error.
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dalle_lightning_plugins.compression.powersgd import rank_for_compression, saved_share
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, reference_sgd, token_dataset, trainer

LR, STEPS = 0.5, 3


def _fit(rank: int, overlap: bool, powersgd_rank: int, module: L.LightningModule | None = None,
         callbacks: list | None = None, steps: int = STEPS, bucket_cap_mb: float = 1.0,
         ) -> tuple[dict[str, torch.Tensor], ShardedPowerSGDStrategy]:
    torch.manual_seed(0)
    module = module or TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    strategy = ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=powersgd_rank, min_compression=0.0,
                                       overlap=overlap, bucket_cap_mb=bucket_cap_mb)
    trainer(strategy, devices=2, max_steps=steps, callbacks=callbacks or []).fit(
        module, loader(token_dataset(), rank, world_size=2))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, strategy


def _paths(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    low_on, s_on = _fit(rank, True, 1)
    low_off, s_off = _fit(rank, False, 1)
    full_on, _ = _fit(rank, True, 12)
    return {"low_on": low_on, "low_off": low_off, "full_on": full_on, "rank": rank,
            "sent_on": s_on.powersgd.stats.bytes_sent_last_step, "sent_off": s_off.powersgd.stats.bytes_sent_last_step}


@pytest.mark.distributed
def test_overlap_equals_the_end_of_backward_path_and_full_rank_is_exact() -> None:
    results = run_distributed(_paths, 2, timeout=180)
    reference = reference_sgd(STEPS, LR, 2)
    for res in results:
        for name, value in res["low_off"].items():
            torch.testing.assert_close(res["low_on"][name], value, atol=1e-5, rtol=0, msg=name)
            torch.testing.assert_close(res["full_on"][name], reference[name], atol=1e-5, rtol=0, msg=name)
        # the embedding goes by used rows (at most the 8 tokens of a batch of 2 x 4 per rank, of 11 rows)
        assert res["sent_on"] < res["sent_off"]
    for name, value in results[0]["low_on"].items():
        assert torch.equal(value, results[1]["low_on"][name])  # replicas agree exactly


def _issued_during_backward(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    events: list[str] = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        events.append(f"{'async' if async_op else 'sync'}:{op}")
        return real(tensor, op=op, group=group, async_op=async_op)

    class Marks(L.Callback):
        def on_before_backward(self, *args) -> None:
            events.append("backward")
            dist.all_reduce = counting

        def on_after_backward(self, *args) -> None:
            dist.all_reduce = real

    strategy_box: list[ShardedPowerSGDStrategy] = []

    class Finish(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            strategy = trainer.strategy
            finish = strategy.inter_node.exchange.finish

            def marked() -> bool:
                events.append("finish")
                return finish()

            strategy.inter_node.exchange.finish = marked
            strategy_box.append(strategy)

    _fit(rank, True, 1, callbacks=[Marks(), Finish()], steps=1, bucket_cap_mb=0.0)  # one bucket per block
    return {"events": events}


@pytest.mark.distributed
def test_the_blocks_p_all_reduces_start_during_the_backward() -> None:
    for res in run_distributed(_issued_during_backward, 2, timeout=120):
        events = res["events"]
        start, finish = events.index("backward"), events.index("finish")
        during = events[start + 1:finish]
        after = events[finish + 1:]
        # every block's P and the root's (the head: it waits only for the blocks' P's, issued in bucket order)
        # before the step waits, and the Q's whose P had arrived
        assert len(during) >= 4 and all(e == "async:RedOpType.SUM" for e in during), events
        assert after[0] == "sync:RedOpType.MAX", events  # then the flags
        # P and Q' for each block and the root's head, then the embedding's used rows, after the flags, in one
        assert sum(e.startswith("async") for e in events) == 3 * 2 + 2 + 1, events
        assert after[-1] == "async:RedOpType.SUM" and after.count("async:RedOpType.SUM") >= 1, events


class NaNOnRank1AtStep(L.Callback):
    """Makes rank 1's loss NaN at one step, after recording every error buffer."""

    def __init__(self, step: int) -> None:
        self.step, self.before, self.after = step, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.before = {k: v.clone() for k, v in trainer.strategy.powersgd._error.items()}
            if trainer.global_rank == 1:
                with torch.no_grad():
                    pl_module.model.blocks[0].fc1.weight[0, 0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step or (trainer.global_step == self.step + 1 and not self.after):
            self.after = {k: v.clone() for k, v in trainer.strategy.powersgd._error.items()}


def _nonfinite(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    marks = NaNOnRank1AtStep(step=1)
    _, strategy = _fit(rank, True, 1, module=module, callbacks=[marks], steps=2)
    return {"before": marks.before, "after": marks.after, "skipped": strategy.powersgd.stats.skipped_steps}


@pytest.mark.distributed
def test_a_nonfinite_gradient_skips_everywhere_and_leaves_the_error_buffers() -> None:
    for res in run_distributed(_nonfinite, 2, timeout=120):
        assert res["skipped"] == 1
        assert res["before"] and res["before"].keys() == res["after"].keys()
        for name, value in res["before"].items():
            assert torch.equal(res["after"][name], value), name


class OneRankBranch(nn.Module):
    """A branch only rank 0 takes (its parameters get no gradient on rank 1): that bucket goes after the flags."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyResNet()
        self.extra = nn.Linear(6, 6)

    def resblocks(self) -> list[nn.Module]:
        return [*self.net.blocks, self.extra]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.net.embed(tokens)
        for block in self.net.blocks:
            x = x + block(x)
        if dist.get_rank() == 0:
            x = x + self.extra(x)
        return self.net.head(x)


def _unused(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        module = TinyModule(OneRankBranch(), functools.partial(torch.optim.SGD, lr=LR))
        out[overlap], _ = _fit(rank, overlap, 1, module=module)
    return out


@pytest.mark.distributed
def test_a_branch_one_rank_skips_averages_as_without_overlap() -> None:
    for res in run_distributed(_unused, 2, timeout=120):
        for name, value in res[False].items():
            torch.testing.assert_close(res[True][name], value, atol=1e-5, rtol=0, msg=name)


def test_compression_picks_the_rank_that_saves_that_share() -> None:
    shapes = [(128, 512), (512, 128), (128, 128), (128, 384)]
    r = rank_for_compression(shapes, 0.86, min_compression=2.0)
    assert saved_share(shapes, r, 2.0) >= 0.86 > saved_share(shapes, r + 1, 2.0)
    with pytest.raises(ValueError, match="compression=0.9999"):
        rank_for_compression(shapes, 0.9999, min_compression=2.0)
    with pytest.raises(ValueError, match="both given"):
        ShardedPowerSGDStrategy(powersgd_rank=4, compression=0.9)
    with pytest.raises(ValueError, match="compression=1.5"):
        ShardedPowerSGDStrategy(compression=1.5)


def _scaled(rank: int, world_size: int) -> dict:
    from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision
    from tests.test_strategy_precision import PoisonedModule

    external_launch_env(rank)
    out: dict = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        plugin = ResblockScalingPrecision("bf16")
        finished: list[bool] = []

        class CountFinish(L.Callback):
            def setup(self, trainer, pl_module, stage) -> None:
                exchange = trainer.strategy.inter_node.exchange
                if exchange is not None:
                    finish = exchange.finish
                    exchange.finish = lambda: finished.append(True) or finish()

        strategy = ShardedPowerSGDStrategy(devices_per_node=world_size // 2, powersgd_rank=1, min_compression=0.0,
                                           overlap=overlap)
        module = PoisonedModule(rank)
        trainer(strategy, devices=world_size, max_steps=3, plugins=[plugin], callbacks=[CountFinish()]).fit(
            module, loader(token_dataset(), rank, world_size=world_size))
        out[overlap] = {
            "weights": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for n, p in module.named_parameters()},
            "log2": plugin.scales.log2.tolist(), "skipped": plugin.scales.skipped, "finished": len(finished),
            "error_max": max(float(e.abs().max()) for e in strategy.powersgd._error.values()),
        }
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4], ids=["2x1", "2x2"])
def test_per_block_scales_unscale_each_bucket_as_it_is_sent(world_size: int) -> None:
    """ResblockScalingPrecision at one and two devices per node: the overlapped path runs (each bucket unscaled
    by the plugin as it is sent), an overflow on rank 0 skips the update and backs off only its block, the error
    buffers hold unscaled values, and the weights match the end-of-backward path."""
    growth = math.log2(2 ** (1 / 1000))
    for res in run_distributed(_scaled, world_size, timeout=240):
        on, off = res[True], res[False]
        assert on["finished"] == 3 and off["finished"] == 0  # every step overlapped, and none without overlap
        for r in (on, off):
            assert r["skipped"] == 1
            assert r["log2"] == pytest.approx([13 + 2 * growth, 12.5 + 2 * growth, 13 + 2 * growth])
        assert on["error_max"] < 10.0, on["error_max"]  # a scaled gradient would leave ~2**13 times more
        for name, value in off["weights"].items():
            torch.testing.assert_close(on["weights"][name], value, atol=1e-5, rtol=0, msg=name)
