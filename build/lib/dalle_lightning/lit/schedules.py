"""Learning-rate schedules built from config (``_partial_: true``), stepped every optimizer update."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, final_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up to the optimizer's lr over ``warmup_steps``, then cosine decay to ``final_ratio * lr``.

    The paper warms the prior up linearly over 5,000 updates; short runs decay by cosine rather than by
    halving on plateaus, which needs a validation signal at every step.
    """
    if warmup_steps < 0 or total_steps <= 0:
        raise ValueError(f"warmup_steps={warmup_steps}, total_steps={total_steps}: expected >= 0 and > 0")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        t = min(1.0, (step - warmup_steps) / span)
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return LambdaLR(optimizer, factor)


def optimizers_from_factories(params, optimizer_factory, scheduler_factory=None):  # noqa: ANN001, ANN201
    """``configure_optimizers`` for the config convention: an optimizer partial and an optional scheduler
    partial, the scheduler stepped every update (Lightning's ``interval="step"``)."""
    optimizer = optimizer_factory(params)
    if scheduler_factory is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler_factory(optimizer), "interval": "step"}}
