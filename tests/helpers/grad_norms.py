"""A test-only callback that logs, at every update, the norm of this rank's gradients as the optimizer will see
them: after the precision plugin has unscaled them (``on_before_optimizer_step`` runs after the unscale) and
before clipping. Under FSDP2 each rank holds its own shards (DTensors): the norm is over the local shards, so two
runs are compared rank by rank. Logged as ``test/grad_norm`` (rank 0's goes to the CSV log).

Passed on the command line as ``+callbacks.grad_norms._target_=tests.helpers.grad_norms.GradNorms``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class GradNorms(pl.Callback):
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object) -> None:
        total = torch.zeros((), dtype=torch.float64)
        for p in pl_module.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                total += g.detach().double().pow(2).sum().cpu()
        pl_module.log("test/grad_norm", total.sqrt().float(), on_step=True, on_epoch=False, rank_zero_only=True)
