"""The strategy <-> precision plugin contract is a checkable protocol, and the package exports both plugins."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import DoublePrecision, Precision
from torch.optim import Optimizer

import strategies
from strategies.protocol import UnscalingPrecision
from strategies.resblock_precision import ResblockScalingPrecision


class DuckPrecision(Precision):
    """A stranger's plugin: takes part by defining the two methods, without importing the protocol."""

    def unscale_and_flag(self, optimizer: Optimizer) -> bool:
        return True

    def mark_nonfinite(self) -> None:
        pass


def test_resblock_precision_satisfies_the_protocol_and_lightnings_own_plugins_do_not() -> None:
    assert isinstance(ResblockScalingPrecision("bf16"), UnscalingPrecision)
    assert isinstance(DuckPrecision(), UnscalingPrecision)
    assert not isinstance(Precision(), UnscalingPrecision)
    assert not isinstance(DoublePrecision(), UnscalingPrecision)


def test_the_package_exports_the_strategy_the_precision_plugin_and_the_protocol() -> None:
    assert strategies.ResblockScalingPrecision is ResblockScalingPrecision
    assert strategies.UnscalingPrecision is UnscalingPrecision
    assert {"ShardedPowerSGDStrategy", "ResblockScalingPrecision", "UnscalingPrecision"} <= set(strategies.__all__)
