"""The stages' fused AdamW clips gradients exactly as the per-op AdamW does, under Lightning's mixed precision.

Lightning's ``MixedPrecision`` refuses to clip for a fused optimizer; the modules' ``FusedOptimizerClipping`` clips
the true gradients instead. Reference: the same updates with ``foreach`` AdamW, which Lightning clips itself.
A clip far below the gradient norm makes clipping decide the update, and a run without clipping shows it did.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from tests.test_strategy_exact_models import Dicts

STEPS = 3


def train_prior(precision: str, optimizer: str, clip: float | None) -> dict[str, torch.Tensor]:
    from dalle_lightning.lit.prior import PriorModule
    from dalle_lightning.models.prior import DallePrior

    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=20, text_len=6, image_vocab_size=16, image_grid=4, n_layer=2, n_head=2, d_head=8)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, **{optimizer: True})
    module = PriorModule(model, adamw, caption_dropout=0.0)
    g = torch.Generator().manual_seed(1)
    data = Dicts(text=torch.randint(0, 20, (STEPS * 4, 6), generator=g),
                 image=torch.randint(0, 16, (STEPS * 4, 16), generator=g))
    # 16-bit with a GradScaler, set up by hand: Lightning maps precision="16-mixed" to bf16 on CPU.
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    kind = {"plugins": [scaled]} if precision == "16-mixed" else {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", devices=1, **kind, max_steps=STEPS, gradient_clip_val=clip,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, DataLoader(data, batch_size=4))
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fused_adamw_clips_like_foreach(precision: str) -> None:
    fused = train_prior(precision, "fused", clip=1e-3)
    foreach = train_prior(precision, "foreach", clip=1e-3)
    unclipped = train_prior(precision, "fused", clip=None)
    assert largest_difference(fused, foreach) < 1e-5, "the fused step did not see the clipped, unscaled gradients"
    assert largest_difference(fused, unclipped) > 1e-3
