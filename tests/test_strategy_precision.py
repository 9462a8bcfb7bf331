"""The sharding strategy and the per-resblock precision plugin together (2 simulated nodes x 2 devices).

The plugin must unscale before PowerSGD and own the skip decision:
* step 0: rank 0 alone overflows inside block 1. Every rank skips the update (parameters unchanged), only block
  1's scale backs off, and PowerSGD never runs (its error feedback must not absorb an Inf or a scaled gradient);
* step 1: finite. PowerSGD sees unscaled gradients (a scaled one would be ~2**15 times larger), and at full
  rank the update equals one exact data-parallel SGD step from the initial parameters on step 1's full batch,
  within the error of the bf16 branches.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from tests.helpers.distributed import run_distributed
from tests.helpers.grad_poison import inf_grad
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, loss_fn, token_dataset, trainer

from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

LR, BATCH, WORLD = 0.5, 2, 4


class PoisonedModule(TinyModule):
    """Block 1 overflows in backward on rank 0 at step 0 only: the other ranks see finite gradients."""

    def __init__(self, rank: int) -> None:
        super().__init__(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
        self.rank = rank
        block = self.model.blocks[1]
        block.register_forward_hook(self._poison)

    def _poison(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if self.rank == 0 and self.trainer.global_step == 0 and torch.is_grad_enabled():
            return inf_grad(output)
        return output


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = PoisonedModule(rank)
    initial = {f"model.{k}": v.detach().clone() for k, v in module.model.state_dict().items()}
    plugin = ResblockScalingPrecision("bf16")
    # The end-of-backward path, whose PowerSGD.reduce is recorded here; tests/test_exchange_overlap.py compares the
    # overlapped one with it under the same plugin.
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=12, min_compression=0.0, overlap=False)
    seen: list[float] = []

    def record(reduce: Any, named: Any, **kwargs: Any) -> bool:
        seen.append(max(float(g.abs().max()) for _, g in named))
        return reduce(named, **kwargs)

    trainer_ = trainer(strategy, max_steps=2, plugins=[plugin])
    strategy_setup = strategy.setup_environment

    def setup_environment() -> None:  # wrap PowerSGD.reduce once it exists, to record what it is given
        strategy_setup()
        strategy.powersgd.reduce = functools.partial(record, strategy.powersgd.reduce)  # type: ignore[method-assign]

    strategy.setup_environment = setup_environment  # type: ignore[method-assign]
    trainer_.fit(module, loader(token_dataset(), rank, BATCH))
    return {
        "initial": initial,
        "full": strategy.full_state_dict(),
        "log2": plugin.scales.log2.tolist(),
        "skipped": plugin.scales.skipped,
        "psgd_steps": strategy.powersgd.stats.steps,
        "psgd_skipped": strategy.powersgd.stats.skipped_steps,
        "seen_max_abs": seen,
        "replicas": plugin.scales.replicas,
    }


def _reference(initial: dict[str, Tensor]) -> dict[str, Tensor]:
    """One fp32 SGD step from the initial parameters on step 1's full batch (items 8..15, all four ranks)."""
    model = TinyResNet()
    model.load_state_dict({k.removeprefix("model."): v for k, v in initial.items()})
    tokens, targets = token_dataset().tensors
    idx = torch.arange(BATCH * WORLD, 2 * BATCH * WORLD)
    loss_fn(model, tokens[idx], targets[idx]).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_overflow_backs_off_its_block_and_powersgd_sees_unscaled_gradients() -> None:
    results = run_distributed(_worker, WORLD, timeout=180)
    growth = math.log2(2 ** (1 / 1000))
    for r in results:
        assert r["replicas"] == 1  # the strategy averages gradients: M = 1
        assert r["skipped"] == 1
        # step 0 skipped (block 1 backed off by sqrt(2)), step 1 applied (every block grew once)
        assert r["log2"] == pytest.approx([13 + growth, 12.5 + growth, 13 + growth])
        assert r["psgd_steps"] == 1 and r["psgd_skipped"] == 0  # PowerSGD ran only on the finite step
        assert len(r["seen_max_abs"]) == 1 and r["seen_max_abs"][0] < 10.0, r["seen_max_abs"]  # unscaled

    reference = _reference(results[0]["initial"])
    full = results[0]["full"]
    assert set(full) == set(reference)
    for name, want in reference.items():
        torch.testing.assert_close(full[name], want, atol=2e-2, rtol=0, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# Which precisions reach the strategy: Lightning's connector is not patched (the strategy is a ParallelStrategy, not a
# ModelParallelStrategy), so the strategy itself refuses what it never trained in, when Lightning hands it the plugin.


def _trainer_error(strategy: Any, **kwargs: Any) -> str:
    import lightning.pytorch as L

    try:
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **kwargs)
    except Exception as error:  # noqa: BLE001 - the type is part of what is compared
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_refused_plugin_is_refused_however_it_comes() -> None:
    """``precision="64-true"`` and ``plugins=[DoublePrecision()]`` are one line each; a user's own plugin is not."""
    from lightning.pytorch.plugins.precision import DoublePrecision

    for kwargs in ({"precision": "64-true"}, {"plugins": [DoublePrecision()]}):
        message = _trainer_error(ShardedPowerSGDStrategy(devices_per_node=2), **kwargs)
        assert message.startswith("ValueError: ShardedPowerSGDStrategy does not support Trainer(precision='64-true')")
        assert "\n" not in message and "'16-mixed'" in message
    assert _trainer_error(ShardedPowerSGDStrategy(devices_per_node=2), plugins=[ResblockScalingPrecision("bf16")]) \
        == "no error"
    assert _trainer_error("local_steps", precision="64-true").startswith(
        "ValueError: LocalStepsStrategy does not support Trainer(precision='64-true')")


def test_transformer_engine_as_under_ddp_or_refused() -> None:
    """Without the transformer_engine package Lightning fails to make its plugin before any strategy sees it, with
    the same error as under ddp; with it, the strategy refuses it in one line."""
    ours = _trainer_error(ShardedPowerSGDStrategy(devices_per_node=2), precision="transformer-engine")
    ddp = _trainer_error("ddp", precision="transformer-engine")
    if ddp.startswith("ModuleNotFoundError"):
        assert ours == ddp
    else:
        assert ours.startswith("ValueError: ShardedPowerSGDStrategy does not support") and "\n" not in ours
