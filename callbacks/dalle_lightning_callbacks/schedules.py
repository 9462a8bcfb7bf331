"""Cosine schedules for scalar hyper-parameters that live on the LightningModule as attributes.

The dVAE's Gumbel temperature and KL weight change every update (paper: tau 1 -> 1/16 over 150k updates,
beta 0 -> 6.6 over the first 5k). Keeping them in callbacks, not in ``training_step``, lets any module take
part: the protocol is just a float attribute whose name is configured (``temperature``, ``kl_weight``, ...).
A module whose attribute is None does not use that hyper-parameter (a dVAE without the Gumbel relaxation): the
schedule then sets and logs nothing, and says so once.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


def cosine(step: int, start: float, end: float, steps: int) -> float:
    """Cosine interpolation from ``start`` (step 0) to ``end`` (step >= ``steps``); constant afterwards."""
    if steps <= 0 or step >= steps:
        return end
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def step_budget(trainer: pl.Trainer) -> int:
    """The run's ``max_steps``, or 0 when it has none (-1 or unset): a schedule placed by a share of the run."""
    return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0


class CosineAttributeSchedule(pl.Callback):
    """Sets ``pl_module.<attribute>`` from a cosine schedule before every training batch and logs it.

    The value depends only on ``trainer.global_step`` (optimizer updates), so a resumed run continues the
    schedule where it stopped, and gradient accumulation does not stretch it.
    """

    def __init__(self, attribute: str, start: float, end: float, steps: int, log_name: str | None = None) -> None:
        if steps < 0:
            raise ValueError(f"steps={steps} is negative; expected the number of updates the schedule spans (>= 0)")
        self.attribute = attribute
        self.start = float(start)
        self.end = float(end)
        self.steps = int(steps)
        self.log_name = log_name or f"schedule/{attribute}"
        self.active = True

    def value(self, step: int) -> float:
        return cosine(step, self.start, self.end, self.steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not hasattr(pl_module, self.attribute):
            raise AttributeError(
                f"{type(pl_module).__name__} has no attribute {self.attribute!r}; "
                f"{type(self).__name__} expects the module to define it as a float"
            )
        self.active = getattr(pl_module, self.attribute) is not None
        if not self.active:
            rank_zero_info(f"{type(self).__name__}: {type(pl_module).__name__}.{self.attribute} is None (not used by "
                           f"this model); the schedule does nothing")
            return
        setattr(pl_module, self.attribute, self.value(trainer.global_step))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> None:
        if not self.active:
            return
        value = self.value(trainer.global_step)
        setattr(pl_module, self.attribute, value)
        pl_module.log(self.log_name, value, on_step=True, on_epoch=False, prog_bar=False, rank_zero_only=True)


class TemperatureAnnealing(CosineAttributeSchedule):
    """Gumbel-softmax temperature, cosine from 1 to 1/16 (the paper's schedule, which beat linear decay)."""

    def __init__(self, start: float = 1.0, end: float = 1.0 / 16, steps: int = 150_000, attribute: str = "temperature") -> None:
        super().__init__(attribute, start, end, steps, log_name="schedule/temperature")


class KLWeightAnnealing(CosineAttributeSchedule):
    """KL weight beta, cosine from 0 to ``beta`` over a warm-up, then constant (paper: 6.6 over 5,000 updates).

    ``fall_at_fraction < 1`` adds a second cosine from ``beta`` down to ``final`` between that share of
    ``trainer.max_steps`` and its end: without the pull towards the uniform prior q(z|x) sharpens, so the codes
    the decoder trains on at the end approach the argmax codes the prior is given.
    """

    def __init__(self, beta: float = 6.6, steps: int = 5_000, start: float = 0.0, attribute: str = "kl_weight",
                 fall_at_fraction: float = 1.0, final: float = 0.0) -> None:
        if not 0.0 <= fall_at_fraction <= 1.0:
            raise ValueError(f"fall_at_fraction={fall_at_fraction}; expected the share of trainer.max_steps where "
                             f"the KL weight starts to fall, in [0, 1]")
        super().__init__(attribute, start, beta, steps, log_name="schedule/kl_weight")
        self.fall_at_fraction = float(fall_at_fraction)
        self.final = float(final)
        self._fall = (0, 0)  # (first update of the fall, its length); none until setup knows max_steps

    @override
    def value(self, step: int) -> float:
        first, length = self._fall
        if length and step >= first:
            return cosine(step - first, self.end, self.final, length)
        return super().value(step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        total = step_budget(trainer)
        if total and self.fall_at_fraction < 1.0:
            first = max(round(self.fall_at_fraction * total), self.steps)
            self._fall = (first, max(total - first, 1))
        super().setup(trainer, pl_module, stage)


class HardCodesHandover(CosineAttributeSchedule):
    """Hands a relaxed model over to hard codes for the last part of training: ``pl_module.hard_codes`` is 0 before
    ``at_fraction * trainer.max_steps`` updates and 1 from there on.

    A dVAE trained only on relaxed samples ends with a diffuse q(z|x) whose argmax code (what the prior is given)
    the decoder never saw during training; with hard codes and a straight-through gradient the decoder and the
    encoder learn the codes that will be used. ``at_fraction=1`` never hands over (the paper's relaxation).
    """

    def __init__(self, at_fraction: float = 1.0, attribute: str = "hard_codes") -> None:
        if not 0.0 <= at_fraction <= 1.0:
            raise ValueError(f"at_fraction={at_fraction}; expected the share of trainer.max_steps after which codes "
                             f"are hard, in [0, 1]")
        super().__init__(attribute, 0.0, 1.0, 0, log_name="schedule/hard_codes")
        self.at_fraction = float(at_fraction)

    @override
    def value(self, step: int) -> float:
        return 1.0 if step >= self.steps else 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        total = step_budget(trainer)
        # at_fraction=1, or a run without a step budget: the handover never comes
        self.steps = round(self.at_fraction * total) if total and self.at_fraction < 1.0 else 2**62
        super().setup(trainer, pl_module, stage)
