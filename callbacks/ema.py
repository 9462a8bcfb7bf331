"""Lightning's ``EMAWeightAveraging`` that hands over the average only once there is one.

Before its first update (``update_starting_at_step``) the average model holds the weights it was built with, the
random initialisation. Lightning's callback nevertheless copies it into the model at the end of training and swaps
it in for validation and checkpoints: a run shorter than the start step validates, checkpoints and saves its
random initialisation as the trained model. This subclass does so only after the average has been updated at
least once; before that the trained (raw) weights stay in place, and the run says so.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class EMAOnceAveraged(EMAWeightAveraging):
    """``EMAWeightAveraging`` whose average replaces the weights (validation, checkpoints, the end of training)
    only once it has averaged at least one update."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._swapped = False

    def has_averaged(self) -> bool:
        """True once the average model has taken in at least one update."""
        model = self._average_model
        return model is not None and int(model.n_averaged) > 0

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.has_averaged():
            super().on_train_end(trainer, pl_module)
        else:
            rank_zero_info(f"EMA: no update averaged yet (update_starting_at_step={self.update_starting_at_step}, "
                           f"{trainer.global_step} updates run); keeping the trained weights")

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swapped = self.has_averaged()
        if self._swapped:
            super().on_validation_epoch_start(trainer, pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            super().on_validation_epoch_end(trainer, pl_module)
        self._swapped = False

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.has_averaged():
            super().on_save_checkpoint(trainer, pl_module, checkpoint)
