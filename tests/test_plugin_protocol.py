"""The strategy <-> precision plugin contract is a checkable protocol, and the package exports both plugins."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import DoublePrecision, Precision
from torch.optim import Optimizer

import dalle_lightning_plugins
from dalle_lightning_plugins.protocol import UnscalingPrecision
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision


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
    assert dalle_lightning_plugins.ResblockScalingPrecision is ResblockScalingPrecision
    assert dalle_lightning_plugins.UnscalingPrecision is UnscalingPrecision
    exported = set(dalle_lightning_plugins.__all__)
    assert {"ShardedPowerSGDStrategy", "ResblockScalingPrecision", "UnscalingPrecision"} <= exported
