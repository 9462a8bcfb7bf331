"""The sharding strategies run forward and backward once per step, before the inter-node average, and hand the
optimizer a closure that returns that result. An optimizer that evaluates its closure again (a line search, LBFGS;
sharpness-aware minimisation) would get the first evaluation's gradients as if fresh: it is refused in one line, never
stepped on stale values. LBFGS at setup: ``tests/test_module_patterns.py`` (``line_search``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from dalle_lightning_plugins.strategies.optimizer_step import AveragedStep, refuse_reevaluating_optimizers


class StepOnly(Precision):
    """A precision plugin whose step is the optimizer's own, without Lightning's hooks (no Trainer here)."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return optimizer.step(closure, **kwargs)


def _strategy_step(averaged: AveragedStep, optimizer: torch.optim.Optimizer, closure: Any, module: Any,
                   reduce: Any) -> Any:
    """The order ``ShardedPowerSGDStrategy.optimizer_step`` calls the parts in, the average by ``reduce``."""
    result = averaged.run_closure(closure, module)
    finite = averaged.unscale(optimizer, StepOnly(), result, module)
    if averaged.due(finite):
        averaged.averaged(reduce())
    return averaged.update(optimizer, result, module, StepOnly(), finite)


class TwoEvaluations(torch.optim.SGD):
    """Evaluates the closure twice per step, as sharpness-aware minimisation does (ascend, then descend)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        closure()
        return super().step(closure)


def _step(optimizer: torch.optim.Optimizer) -> Any:
    runs = []

    def closure() -> torch.Tensor:  # the forward and backward Lightning hands the strategy
        runs.append(1)
        return torch.tensor(1.0)

    out = _strategy_step(AveragedStep(), optimizer, closure, None, lambda: True)
    return out, len(runs)


def test_one_evaluation_steps_with_the_backward_that_ran() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    out, runs = _step(torch.optim.SGD([weight], lr=0.5))
    assert runs == 1 and out.item() == 1.0 and weight.tolist() == [0.5, 0.5]


def test_a_second_evaluation_is_one_line_not_stale_gradients() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="TwoEvaluations.step evaluated its closure a second time") as raised:
        _step(TwoEvaluations([weight], lr=0.5))
    assert "\n" not in str(raised.value)
    assert weight.tolist() == [1.0, 1.0]  # no update taken on the stale gradients


def test_lbfgs_is_refused_in_one_line() -> None:
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="ShardedPowerSGDStrategy: configure_optimizers returned LBFGS") as raised:
        refuse_reevaluating_optimizers([torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), lbfgs],
                                       "ShardedPowerSGDStrategy")
    assert "\n" not in str(raised.value) and "strategy='ddp'" in str(raised.value)


def test_steps_after_one_backward_share_its_inter_node_average() -> None:
    """Manual optimization: one ``manual_backward``, then two optimizers step (or one twice). ``ddp`` averages the
    gradients once, in the backward; so does the strategy, in the first step, not once per step (which compressed
    and error-fed every gradient again). The next backward's gradients are averaged again."""
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizers = [torch.optim.SGD([first], lr=0.5), torch.optim.SGD([second], lr=0.5)]
    averaged, reductions = AveragedStep(), []

    def reduce() -> bool:
        reductions.append(1)
        return True

    for _ in range(2):
        first.grad, second.grad = torch.ones(2), torch.ones(2)
        averaged.averaged(None)  # as the strategy's backward leaves it when the step is to average
        for optimizer in optimizers:
            _strategy_step(averaged, optimizer, lambda: None, SimpleNamespace(automatic_optimization=False), reduce)
    assert len(reductions) == 2, "one inter-node average per backward"
    assert first.tolist() == second.tolist() == [0.0, 0.0]  # every optimizer stepped on each backward's gradients
