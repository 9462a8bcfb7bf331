"""The prior's captioned sample grid at validation: the TensorBoard image event holds the saved PNG, whose tiles
are the module's own samples; a CSV run gets the PNG; a logger with ``log_image`` gets the grid and captions.
"""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from torch.utils.data import DataLoader

from dalle_lightning_callbacks.batches import take
from dalle_lightning_callbacks.captioned_grid import to_pil
from dalle_lightning_callbacks.sample_grid import SampleGrid
from dalle_lightning.lit.prior import PriorModule
from dalle_lightning.models.dvae import DiscreteVAE
from dalle_lightning.models.prior import DallePrior

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest

GRID, VOCAB, TEXT_LEN, N = 4, 16, 6, 6
CAPTIONS = [f"a {c} square" for c in ("red", "green", "blue", "white", "yellow", "purple")]


def module() -> PriorModule:
    torch.manual_seed(0)
    prior = DallePrior(text_vocab_size=30, text_len=TEXT_LEN, image_vocab_size=VOCAB, image_grid=GRID, n_layer=2,
                       n_head=2, d_head=8)
    dvae = DiscreteVAE(image_size=16, group_count=3, n_hid=8, n_blk_per_group=1, vocab_size=VOCAB, codebook_dim=8)
    return PriorModule(prior, functools.partial(torch.optim.AdamW, lr=1e-3), dvae=dvae, fid_seed=5)


def batches() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 30, (N, TEXT_LEN), generator=g)
    image = torch.randint(0, VOCAB, (N, GRID * GRID), generator=g)
    return [{"text": text[i:i + 4], "image": image[i:i + 4], "caption": CAPTIONS[i:i + 4]} for i in (0, 4)]


def fit(logger, callback: SampleGrid) -> PriorModule:
    """One update, then one validation over both batches; returns the trained module."""
    lit = module()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=2,
                         num_sanity_val_steps=0, logger=logger, callbacks=[callback], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
    data = DataLoader(batches(), batch_size=None)
    trainer.fit(lit, train_dataloaders=data, val_dataloaders=data)
    return lit


def test_grid_event_in_tensorboard_holds_the_samples_with_their_captions(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = SampleGrid(num_images=5, columns=3, scale=6)  # all 4 of the first batch and 1 of the second
    lit = fit(logger, callback)
    assert callback.last_path == os.path.join(logger.log_dir, "samples_step1.png")
    png = np.asarray(Image.open(callback.last_path).convert("RGB"))

    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert "val/samples" in events.Tags()["images"]
    (event,) = events.Images("val/samples")
    assert event.step == 1 and (event.width, event.height) == (png.shape[1], png.shape[0])
    logged = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    assert np.abs(logged.astype(int) - png.astype(int)).max() <= 1  # the event is the saved grid

    # The tiles are the module's seeded samples for those captions, drawn again here after training.
    first, second = batches()
    samples = torch.cat([lit.sample_images(first), lit.sample_images(take(second, 1))])
    tile, text_h, pad = 16 * 6, 12 + 6, 6  # 6x-upscaled 16-pixel images, one caption line each
    assert png.shape == (2 * (tile + text_h + pad) + pad, 3 * (tile + pad) + pad, 3)
    for i, sample in enumerate(samples):
        x, y = pad + (i % 3) * (tile + pad), pad + (i // 3) * (tile + text_h + pad)
        assert np.array_equal(png[y:y + tile, x:x + tile], np.asarray(to_pil(sample, 6))), i
        assert (png[y + tile + 3:y + tile + text_h, x:x + tile] < 128).any(), i  # its caption is written under it
    x, y = pad + 2 * (tile + pad), pad + tile + text_h + pad
    assert (png[y:y + tile, x:x + tile] == 255).all()  # no sixth tile


class ImageTaking(CSVLogger):
    """A logger with ``log_image`` (the interface of Weights & Biases' logger) that keeps what it is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.images: list[tuple[str, list, int, list]] = []

    def log_image(self, key: str, images: list, step: int | None = None, **kwargs) -> None:
        self.images.append((key, images, step, kwargs.get("caption")))


def test_csv_run_gets_the_png_and_image_loggers_get_grid_and_captions(tmp_path: Path) -> None:
    csv, taking = CSVLogger(str(tmp_path), name="csv"), ImageTaking(str(tmp_path), name="other")
    callback = SampleGrid(num_images=4, columns=2)
    fit([csv, taking], callback)
    assert callback.last_path == os.path.join(csv.log_dir, "samples_step1.png")  # the PNG beside the CSV metrics
    png = torch.from_numpy(np.asarray(Image.open(callback.last_path).convert("RGB")).copy()).permute(2, 0, 1)
    ((key, images, step, caption),) = taking.images
    assert key == "val/samples" and step == 1 and caption == [" | ".join(CAPTIONS[:4])]
    torch.testing.assert_close(images[0], png.float() / 255, atol=0, rtol=0)


def test_module_without_the_protocol_and_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_images=0"):
        SampleGrid(num_images=0)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match="sample_images"):
        SampleGrid().setup(trainer, pl.LightningModule(), "fit")
