"""Exponential moving average of the parameters that also works on sharded (FSDP2 / DTensor) parameters.

Lightning's ``EMAWeightAveraging`` keeps a deep copy of the whole LightningModule (an ``AveragedModel``) made in
``setup``, before a strategy shards the model, and copies it into the live parameters with ``copy_``. Under
FSDP2 the live parameters are DTensors holding a shard each, so the copy fails (``got mixed torch.Tensor and
DTensor``), and a full copy per rank defeats the sharding. This subclass keeps Lightning's callback, its
arguments and its schedule (``should_update``: ``update_starting_at_step``, ``update_every_n_steps``, ...), and
replaces the storage: one tensor per parameter, of the parameter's own kind (a DTensor shard where the
parameter is sharded), updated in place on local shards with a foreach ``lerp``. That is the paper's memory
budget, too: the EMA of 12B parameters sharded like the parameters.

Behaviour (the same sharded or not):

- the first update copies the parameters; each later one does ``ema += (1 - decay) * (param - ema)``;
- validation runs on the averaged weights (swapped in and out around each validation epoch);
- at the end of training the averaged weights become the model's *only if an average was ever taken*; a run
  shorter than ``update_starting_at_step`` keeps its trained weights instead of its initialisation
  (``averaged`` says which). A fit resumed from a checkpoint that had already reached ``max_steps`` runs no
  training loop (Lightning skips its start and end hooks): the average is handed over at the end of that fit;
- checkpoints hold the average under ``ema_state_dict`` (parameter name -> tensor; a sharding strategy saves
  DTensors in its sharded format) and a resumed run continues it.

Buffers are not averaged (the project's models have no running statistics).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from dalle_lightning_callbacks.sharding import local, reshard

EMA_STATE_KEY = "ema_state_dict"


class EMA(EMAWeightAveraging):
    """Lightning's EMA callback with per-parameter (and per-shard) storage. Same arguments; see the module doc."""

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay={decay}, expected a value in [0, 1]")
        super().__init__(
            decay=decay,
            update_every_n_steps=update_every_n_steps,
            update_starting_at_step=update_starting_at_step,
            update_starting_at_epoch=update_starting_at_epoch,
        )
        self.decay = float(decay)
        self._names: list[str] = []
        self._average: list[Tensor] | None = None
        self.updates = 0  # averaging updates taken; 0 means the parameters were never averaged
        self._handed_over = False  # the end of training of this fit has put the average into the model

    @property
    def averaged(self) -> bool:
        return self._average is not None and self.updates > 0

    # ---------------------------------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Nothing to copy yet: the average is made from the live (possibly sharded) parameters at the first
        update, after the strategy has set the model up."""

    def _params(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Tensor]:
        reshard(trainer, pl_module)  # FSDP2 units back on their shards: edit the originals, not gathered copies
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        if self._names and names != self._names:
            raise ValueError(f"the model's parameters changed since the EMA began ({len(self._names)} -> {len(names)})")
        self._names = names
        return [p for _, p in named]

    @torch.no_grad()
    def _update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = self._params(trainer, pl_module)
        if self._average is None or self.updates == 0:
            self._average = [p.detach().clone() for p in params]
        else:
            torch._foreach_lerp_([local(a) for a in self._average], [local(p) for p in params], 1.0 - self.decay)
        self.updates += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1  # as Lightning's callback: zero-based index of the update just taken
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._update(trainer, pl_module)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self._update(trainer, pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handed_over = False

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._handed_over:  # no training loop ran: resumed from a checkpoint that had finished
            self.on_train_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handed_over = True
        if not self.averaged:
            rank_zero_info(
                f"EMA: no average was taken in {trainer.global_step} updates (update_starting_at_step="
                f"{self.update_starting_at_step}); the model keeps its trained weights"
            )
            return
        with torch.no_grad():
            for a, p in zip(self._average or [], self._params(trainer, pl_module)):
                if hasattr(a, "full_tensor") and not hasattr(p, "full_tensor"):
                    # on_fit_end: the strategy left the module whole after the stage (full_weights_after); collective
                    p.copy_(a.full_tensor())
                else:
                    local(p).copy_(local(a))

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.averaged and trainer.state.fn == "fit":
            self._swap(trainer, pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.averaged and trainer.state.fn == "fit":
            self._swap(trainer, pl_module)

    @torch.no_grad()
    def _swap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for a, p in zip(self._average or [], self._params(trainer, pl_module)):
            a_local, p_local = local(a), local(p)
            tmp = a_local.clone()
            a_local.copy_(p_local)
            p_local.copy_(tmp)

    # ---------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch,
                "updates": self.updates}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = int(state_dict.get("latest_update_step", 0))
        self._latest_update_epoch = int(state_dict.get("latest_update_epoch", -1))
        self.updates = int(state_dict.get("updates", 0))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The average goes beside the model's own state (not over it), keyed by parameter name."""
        if self.averaged:
            checkpoint[EMA_STATE_KEY] = dict(zip(self._names, (a.detach().clone() for a in self._average or [])))

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(EMA_STATE_KEY)
        if not state:
            return
        params = dict(pl_module.named_parameters())
        self._names = [n for n, p in params.items() if p.requires_grad]  # frozen parameters are not averaged
        missing = sorted(set(self._names) - set(state))
        if missing:
            raise KeyError(
                f"checkpoint EMA has no entry for parameter(s) {missing[:3]}; expected one per trainable parameter"
            )
        self._average = [state[n].detach().clone().to(params[n].device) for n in self._names]
