"""torch's own PowerSGD communication hook on a ``ddp`` run, on any device: the baseline a user would pick, which
``benchmarks/two_nodes.py`` (method ``hook``) compares the strategy against. A benchmark's helper, not installed.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only on CUDA and ignores it elsewhere, so on CPU
(gloo) the hook is registered here, on the DDP-wrapped model at fit start (after the strategy wrapped it):
``+callbacks.torch_powersgd._target_=benchmarks._torch_powersgd_hook.TorchPowerSGDHook
+callbacks.torch_powersgd.rank=4``, with the repository root on ``PYTHONPATH`` (``two_nodes.py`` puts it there
for the ``dalle-train`` runs it launches). ``start_iter`` defaults to 2 rather than torch's 1,000, which would leave
a short run uncompressed.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override


class TorchPowerSGDHook(pl.Callback):
    """Registers ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=rank, ...)`` at fit start."""

    def __init__(self, rank: int = 4, start_iter: int = 2, warm_start: bool = True,
                 error_feedback: bool = True) -> None:
        if rank < 1 or start_iter < 1:
            raise ValueError(f"rank={rank}, start_iter={start_iter}: expected positive integers "
                             "(torch needs start_iter >= 1)")
        self.rank, self.start_iter, self.warm_start, self.error_feedback = rank, start_iter, warm_start, error_feedback
        self._registered: set[int] = set()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise TypeError("TorchPowerSGDHook needs strategy=ddp (a DistributedDataParallel model), "
                            f"got {type(model).__name__}")
        if id(model) in self._registered:
            return  # DDP takes one hook per model
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start_iter,
            use_error_feedback=self.error_feedback, warm_start=self.warm_start,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        self._registered.add(id(model))
