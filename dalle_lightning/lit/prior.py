"""LightningModule for the stage-two prior: caption dropout for super-conditioning, optimiser and schedule wiring.

Batches are ``{"text": LongTensor[B, T] (0 = padding), "image": LongTensor[B, N]}`` (dVAE codes, raster order),
optionally with ``"caption": list[str]``.

Given a dVAE (``dvae=``, a module or the path of a saved one), the module also speaks the protocol of
``dalle_lightning_callbacks.fid.FIDCallback``: ``fid_generate`` samples image tokens for a validation batch's captions and decodes
them, ``fid_real`` decodes the batch's real codes (so FID compares like with like: both through the same
decoder), and ``fid_captions`` hands over the caption strings for the contrastive score. The same samples and
captions serve ``dalle_lightning_callbacks.sample_grid.SampleGrid`` (``sample_images``, ``sample_captions``), so the grid logged at
a validation shows images drawn as the FID's are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn
from typing_extensions import override

from dalle_lightning.artifacts import load_frozen
from dalle_lightning.lit.clipping import FusedOptimizerClipping
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.generation.cast import precision_dtype
from dalle_lightning.generation.sampling import sample_image_tokens


def drop_captions(text: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Replace each caption by all-padding with probability ``p``: the prior also learns the unconditional
    distribution, which super-conditioning subtracts at sampling time (``cond_scale``)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"caption_dropout={p}; expected a probability in [0, 1]")
    if p == 0.0:
        return text
    device = generator.device if generator is not None else text.device
    drop = (torch.rand(text.shape[0], generator=generator, device=device) < p).to(text.device)
    return text.masked_fill(drop.unsqueeze(1), 0)


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay for matrices only: decaying gains, biases and the start vector pulls them toward 0 for no
    regularisation benefit (embeddings are matrices and are decayed, as in the paper's AdamW)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class PriorModule(FusedOptimizerClipping):
    """Trains a :class:`DallePrior` on token batches; logs ``{train,val}/{loss,text_loss,image_loss}``."""

    def __init__(
        self,
        model: DallePrior,
        optimizer: Callable[[Iterable], torch.optim.Optimizer],
        scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
        caption_dropout: float = 0.1,
        dvae: nn.Module | str | Path | None = None,
        fid_temperature: float = 1.0,
        fid_top_k: int | None = None,
        fid_seed: int = 0,
    ):
        super().__init__()
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout={caption_dropout}; expected a probability in [0, 1]")
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.caption_dropout = caption_dropout
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler", "dvae"])
        # Frozen and kept out of the module tree: not trained, not checkpointed, not sharded or scaled.
        self._dvae: list[nn.Module] = []
        if dvae is not None:
            self._dvae.append(load_frozen(dvae))
        self.fid_temperature, self.fid_top_k, self.fid_seed = fid_temperature, fid_top_k, fid_seed

    def resblocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"model.{name}", module) for name, module in self.model.resblocks()]

    @override
    def forward(self, text: torch.Tensor, image: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.model(text, image)

    def _step(self, batch: dict[str, torch.Tensor], stage: str, caption_dropout: float) -> torch.Tensor:
        out = self.model(drop_captions(batch["text"], caption_dropout), batch["image"])
        batch_size = batch["text"].shape[0]
        for name, value in out.items():
            self.log(
                f"{stage}/{name}", value, prog_bar=name == "loss" and stage != "train", batch_size=batch_size,
                sync_dist=stage != "train"
            )
        return out["loss"]

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", self.caption_dropout)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val", 0.0)

    # ------------------------------------------------------------------ FIDCallback protocol
    def _decoder(self) -> nn.Module:
        if not self._dvae:
            raise RuntimeError("PriorModule has no dVAE to decode images; pass dvae=<path of dvae.pt> for FID")
        return self._dvae[0].to(self.device)

    def sampling_dtype(self) -> torch.dtype | None:
        """The compute dtype of the trainer's precision (``bf16-mixed``: bf16, ``32-true``: fp32; see
        :func:`~dalle_lightning.generation.cast.precision_dtype`), None outside a trainer: the weights' own."""
        trainer = self._trainer
        return None if trainer is None else precision_dtype(trainer.precision)

    @torch.no_grad()
    def fid_generate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Images sampled for the batch's captions (seeded per call, so evaluations are comparable), in the
        training precision's compute dtype (:meth:`sampling_dtype`), as gpt-fast samples: a whole model is cast once
        per call into a copy sampled without autocast, and a sharded one is sampled as it is, under autocast
        (:func:`~dalle_lightning.generation.cast.sampling_model`). The callbacks call this outside the precision
        plugin's forward context, so without it a bf16-mixed run would sample in fp32."""
        generator = torch.Generator(device=self.device).manual_seed(self.fid_seed)
        dtype = self.sampling_dtype()
        sixteen = dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(self.device.type, dtype=dtype if sixteen else None, enabled=sixteen):
            tokens = sample_image_tokens(
                self.model, batch["text"], temperature=self.fid_temperature, top_k=self.fid_top_k, generator=generator
            )
        return self._decode(tokens)

    @torch.no_grad()
    def fid_real(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's real images as the prior sees them: its dVAE codes, decoded."""
        return self._decode(batch["image"])

    def fid_captions(self, batch: dict[str, object]) -> list[str]:
        captions = batch.get("caption")
        if not isinstance(captions, (list, tuple)):
            raise KeyError("token batch has no 'caption' strings; write token shards with dalle-encode (it keeps txt)")
        return list(captions)

    # ------------------------------------------------------------------ SampleGrid protocol
    def sample_images(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Images sampled for the batch's captions, seeded as for FID."""
        return self.fid_generate(batch)

    def sample_captions(self, batch: dict[str, object]) -> list[str]:
        return self.fid_captions(batch)

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        grid = self.model.image_grid
        return self._decoder().decode_indices(tokens.reshape(-1, grid, grid)).float().clamp(0, 1)

    @override
    def configure_optimizers(self):
        optimizer = self.optimizer_factory(param_groups(self.model))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
