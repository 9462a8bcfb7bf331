"""Compile the validation graphs at start-up, log how many graphs each compiled region has, and say when one
recompiles late.

Why: a compiled region (``model.compile``) compiles one graph per dtype, grad mode, train/eval mode and shape that
dynamo did not make dynamic. A new shape hours into a run (a validation or FID batch of a new size) costs a compile
and, at the limit, runs eagerly from then on (:mod:`dalle_lightning.models.recompiles`).

- Start-up: the batch dimension is dynamic from the first call, so a training batch, the last partial batch and a
  validation batch of another size share one graph per mode; the training graphs compile at the first update.
  The validation graphs (eval mode, inference mode, the precision's validation context) would compile at the first
  validation, possibly hours in: where the model compiles and the run validates, this callback turns on Lightning's
  sanity check for ``warm_up_batches`` batches (when it is off), so that they compile before the first update, in
  the real validation loop. Lightning runs it on a copy of the random generators' states (``isolate_rng``), so
  the training draws are those of a run without it, and skips it on a resumed run. The FID and sample-grid
  callbacks draw nothing during it: the sampling graphs (prefill, decode) still compile at the first validation.
- Logs: ``compile/graphs/<region>`` (e.g. ``compile/graphs/prior.MlpBranch._body``) and ``compile/limit_hits``, at
  each validation, at each epoch's end and at the end of training (rank 0: every rank compiles the same graphs),
  kept in ``totals`` for the run's summary. Only regions that compiled are logged: a run that does not compile
  logs nothing.
- Late recompiles: once the first training epoch (with its validation, its last partial batch and the samples the
  validation callbacks draw) is over, the start-up is over (:func:`dalle_lightning.models.recompiles.settle`): a
  region that compiles a graph after that prints one line, once.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from dalle_lightning.models.recompiles import graphs_per_region, limit_hits, settle
from dalle_lightning.models.regions import wants_compiled

log = logging.getLogger(__name__)


def compiles(module: nn.Module) -> bool:
    """Whether any region of ``module`` (a submodule with a ``compile_mode``) runs compiled where its weights are."""
    for m in module.modules():
        mode = getattr(m, "compile_mode", None)
        weight = next(m.parameters(), None)
        if mode is not None and weight is not None and wants_compiled(mode, weight):
            return True
    return False


class CompiledGraphs(pl.Callback):
    """Compiles the validation graphs at start-up, logs ``compile/graphs/<region>`` and ``compile/limit_hits``, and
    ends the start-up after the first epoch. ``warm_up_batches=0`` leaves the sanity check as the trainer has it."""

    def __init__(self, warm_up_batches: int = 1) -> None:
        if warm_up_batches < 0:
            raise ValueError(f"warm_up_batches={warm_up_batches}; expected a number of validation batches >= 0")
        self.warm_up_batches = warm_up_batches
        self.totals: dict[str, float] = {}  # the last metrics logged (rank 0), for the run's summary
        self._added_sanity_check = False

    def _log(self, trainer: pl.Trainer) -> None:
        graphs = graphs_per_region()
        # The counts are the process's: a run that does not compile, after one that did (a multirun), logs nothing.
        if not graphs or not trainer.is_global_zero or not compiles(trainer.lightning_module):
            return
        metrics: dict[str, Any] = {f"compile/graphs/{name}": float(n) for name, n in graphs.items()}
        metrics["compile/limit_hits"] = float(limit_hits())
        self.totals = metrics
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settle(False)  # a new fit in the same process starts up again
        self._added_sanity_check = False
        if self.warm_up_batches and trainer.num_sanity_val_steps == 0 and compiles(pl_module):
            trainer.num_sanity_val_steps = self.warm_up_batches  # read by the trainer right after this hook
            self._added_sanity_check = True
            log.info("compiling the validation graphs before the first update (%d sanity-check batch(es))",
                     self.warm_up_batches)

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._added_sanity_check:
            trainer.num_sanity_val_steps = 0  # as the user set it: a later fit of this trainer decides again

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer)
        settle()  # after the first epoch: a graph compiled from now on is one the start-up did not foresee

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer)
