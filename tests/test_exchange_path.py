"""When a backward's gradients cross between nodes is decided in one place (``inter_node.exchange_path``): every
combination the strategy meets, against the rules its docstring states, and what the strategy's hooks do with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer

from dalle_lightning_plugins.compression.inter_node import ExchangePath, exchange_path

O, A, S, N = (ExchangePath.OVERLAPPED, ExchangePath.AFTER_BACKWARD, ExchangePath.IN_OPTIMIZER_STEP,
              ExchangePath.NOT_THIS_BACKWARD)


class Unscaling(Precision):
    """Per-block scales unscaled only in the optimizer step (the ``UnscalingPrecision`` protocol)."""

    def unscale_and_flag(self, optimizer: Optimizer) -> bool:
        return True

    def mark_nonfinite(self) -> None:
        pass


class GroupUnscaling(Unscaling):
    """...and able to unscale one bucket as it is sent (``GroupUnscalingPrecision``)."""

    def unscale_group(self, params: Sequence[Tensor]) -> None:
        pass


def _scaler() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize(
    ("precision", "can_overlap", "expected"),
    [
        (Precision(), True, O),
        (Precision(), False, A),
        (GroupUnscaling(), True, O),  # unscaled bucket by bucket as the backward sends them
        (GroupUnscaling(), False, S),  # no overlap: Lightning unscales in the step, so the exchange waits for it
        (Unscaling(), True, S),
        (Unscaling(), False, S),
        (_scaler(), True, S),  # Lightning's GradScaler unscales in the step
        (_scaler(), False, S),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, (bool, ExchangePath)) else str(v),
)
def test_the_last_micro_batch_of_an_automatic_step(precision: Precision, can_overlap: bool, expected: ExchangePath) -> None:
    assert exchange_path(synchronised=True, world_size=4, automatic_optimization=True, precision=precision,
                         can_overlap=can_overlap) is expected


@pytest.mark.parametrize("precision", [Precision(), GroupUnscaling(), Unscaling(), _scaler()], ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("can_overlap", [True, False])
def test_other_backwards(precision: Precision, can_overlap: bool) -> None:
    # A micro-batch that is not the last sends nothing, whatever else holds.
    for world_size in (1, 4):
        for automatic in (True, False):
            assert exchange_path(synchronised=False, world_size=world_size, automatic_optimization=automatic,
                                 precision=precision, can_overlap=can_overlap) is N
    # Manual optimisation (the step may follow several backwards) and one process: in the optimizer step.
    assert exchange_path(synchronised=True, world_size=4, automatic_optimization=False, precision=precision,
                         can_overlap=can_overlap) is S
    assert exchange_path(synchronised=True, world_size=1, automatic_optimization=True, precision=precision,
                         can_overlap=can_overlap) is S


@pytest.mark.parametrize("precision", [Precision(), GroupUnscaling()], ids=lambda p: type(p).__name__)
def test_a_unit_that_ran_on_no_rank_or_twice_waits_for_the_end_of_the_backward(precision: Precision) -> None:
    # An idle unit's gradients stay as they were; a unit run twice is reduce-scattered twice by FSDP2.
    expected = A if type(precision) is Precision else S
    assert exchange_path(synchronised=True, world_size=4, automatic_optimization=True, precision=precision,
                         can_overlap=True, every_unit_ran_once=False) is expected
