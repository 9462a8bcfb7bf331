"""The dVAE model, its losses, the LightningModule and the reconstruction-grid callback."""

from __future__ import annotations

import functools
import math
import os

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from torch.distributions import Categorical, Laplace, kl_divergence
from torch.utils.data import DataLoader

from dalle_lightning_callbacks.image_grid import ReconstructionGrid
from dalle_lightning.lit.dvae import CodebookPerplexity, DVAEModule
from dalle_lightning.models.dvae import Decoder, DiscreteVAE, Encoder
from dalle_lightning_plugins.protocol import find_resblocks

TINY = dict(image_size=32, vocab_size=16, n_hid=8, n_blk_per_group=1, group_count=4, codebook_dim=8)


def tiny(seed: int = 0, **overrides: int) -> DiscreteVAE:
    torch.manual_seed(seed)
    return DiscreteVAE(**{**TINY, **overrides})


def images(n: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def squares(n: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Two flat-coloured 8x8 squares on black per image: structure a tiny dVAE can learn in a few steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, 3, size, size)
    for i in range(n):
        for _ in range(2):
            r, c = torch.randint(0, size - 8, (2,), generator=g).tolist()
            x[i, :, r : r + 8, c : c + 8] = torch.rand(3, 1, 1, generator=g)
    return x


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_paper_config_parameter_counts_match_the_release() -> None:
    with torch.device("meta"):
        assert count(Encoder()) == 53_786_240
        assert count(Decoder()) == 43_829_766
        model = DiscreteVAE(image_size=256)
    assert model.grid_size == 32
    assert len(model.resblocks()) == 16
    assert model.encoder.blocks.group_1.block_1.post_gain == 1 / 64


def test_block_min_hidden_widens_only_the_narrow_residual_paths() -> None:
    """Widths 32, 64, 128, 256 have paths of 8, 16, 32, 64 channels; a floor of 32 widens the first two groups."""
    paper = DiscreteVAE(image_size=64, vocab_size=16, n_hid=32, n_blk_per_group=1, codebook_dim=16)
    wide = DiscreteVAE(image_size=64, vocab_size=16, n_hid=32, n_blk_per_group=1, codebook_dim=16, block_min_hidden=32)
    for coder in ("encoder", "decoder"):
        for g, expected in zip((1, 2, 3, 4), (32, 32, 32, 64) if coder == "encoder" else (64, 32, 32, 32)):
            for model, want in ((paper, 8 * 2 ** (g - 1) if coder == "encoder" else 8 * 2 ** (4 - g)), (wide, expected)):
                block = getattr(getattr(model, coder).blocks, f"group_{g}").block_1
                assert block.res_path.conv_2.in_channels == want
    assert count(wide) > count(paper)
    x = torch.rand(2, 3, 64, 64)
    assert wide.reconstruct(x).shape == x.shape
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=f"block_min_hidden={bad}; expected 0"):
            DiscreteVAE(image_size=64, block_min_hidden=bad)


def test_paper_init_statistics() -> None:
    conv = Encoder(n_hid=64, vocab_size=512).blocks.group_2.block_1.res_path.conv_2  # 3x3, 32 -> 32
    assert conv.weight.std().item() == pytest.approx(1 / math.sqrt(32 * 9), rel=0.05)
    assert torch.count_nonzero(conv.bias) == 0


def test_shapes_and_ranges() -> None:
    model = tiny()
    x = images()
    assert model.grid_size == 4
    assert model.encode(x).shape == (4, 16, 4, 4)
    idx = model.get_codebook_indices(x)
    assert idx.shape == (4, 4, 4) and idx.dtype == torch.long
    assert torch.equal(idx, model.encode(x).argmax(1))
    out = model.decode_indices(idx)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    assert torch.equal(model.reconstruct(x), out)


def test_index_decoding_equals_the_one_hot_convolution() -> None:
    model = tiny()
    idx = torch.randint(0, 16, (2, 4, 4))
    one_hot = F.one_hot(idx, 16).permute(0, 3, 1, 2).float()
    torch.testing.assert_close(model.decode_stats(idx), model.decoder(one_hot), atol=1e-5, rtol=1e-5)


def test_bad_sizes_and_codes_raise_one_line_errors() -> None:
    with pytest.raises(ValueError, match=r"image_size=60 .*factor 8"):
        DiscreteVAE(image_size=60, group_count=4)
    model = tiny()
    with pytest.raises(ValueError, match=r"\(2, 3, 16, 16\)"):
        model.encode(torch.rand(2, 3, 16, 16))
    with pytest.raises(ValueError, match="16"):
        model.decode_indices(torch.full((1, 4, 4), 16))
    with pytest.raises(ValueError, match="temperature=0"):
        model(images(), temperature=0.0)


def test_logit_laplace_nll_matches_torch_distributions() -> None:
    model = tiny()
    x = images(2)
    stats = torch.randn(2, 6, 32, 32)
    xm = 0.8 * x + 0.1
    # x' = sigmoid(y), y ~ Laplace(mu, b): density of x' is Laplace(logit x') / (x'(1 - x')).
    reference = -(Laplace(stats[:, :3], stats[:, 3:].exp()).log_prob(torch.logit(xm)) - torch.log(xm * (1 - xm)))
    torch.testing.assert_close(model.logit_laplace_nll(stats, x), reference.mean())


def test_forward_loss_is_nll_plus_weighted_kl_normalised_by_pixels() -> None:
    model = tiny()
    x = images()
    out = model(x, temperature=0.5, kl_weight=3.0)
    logits = out["logits"].permute(0, 2, 3, 1)
    uniform = Categorical(logits=torch.zeros(16))
    kl_total = kl_divergence(Categorical(logits=logits), uniform).sum() / x.shape[0]
    torch.testing.assert_close(out["kl"], kl_total / (3 * 32 * 32))
    torch.testing.assert_close(out["loss"], out["recon_loss"] + 3.0 * out["kl"])
    assert out["recon"].shape == x.shape


def test_gumbel_relaxation_carries_gradients_into_the_encoder() -> None:
    model = tiny()
    out = model(images(), temperature=1.0, kl_weight=0.0)  # no KL: the only path is through z
    out["loss"].backward()
    grad = model.encoder.blocks.input.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_hard_codes_decode_the_argmax_and_pass_gradients_straight_through() -> None:
    """``hard=True`` trains the decoder on the codes ``get_codebook_indices`` hands the prior (its reconstruction is
    the argmax decode, with no noise), while the encoder still gets a gradient through the softmax."""
    model = tiny()
    x = images()
    out = model(x, temperature=0.5, kl_weight=0.0, hard=True)
    with torch.no_grad():
        torch.testing.assert_close(out["recon"], model.decode_indices(model.get_codebook_indices(x)))
    out["loss"].backward()
    grad = model.encoder.blocks.input.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_hard_codes_handover_switches_at_its_share_of_the_run(tmp_path: str) -> None:
    from dalle_lightning_callbacks.schedules import HardCodesHandover

    seen: list[tuple[int, float]] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen.append((trainer.global_step, pl_module.hard_codes))

    module = DVAEModule(tiny(), optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    loader = DataLoader([{"image": t} for t in images(8)], batch_size=2)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[HardCodesHandover(at_fraction=0.75), Record()])
    trainer.fit(module, loader)
    assert [v for _, v in seen] == [0.0] * 6 + [1.0] * 2
    with pytest.raises(ValueError, match=r"at_fraction=1.5; expected the share of trainer.max_steps"):
        HardCodesHandover(at_fraction=1.5)


def test_gumbel_relaxation_samples_the_codes_distribution() -> None:
    """Gumbel-max: the argmax of the relaxed sample at any temperature is drawn from softmax(logits), as with
    ``F.gumbel_softmax``; and the noise stays finite."""
    from dalle_lightning.models.dvae import gumbel_softmax

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0]).view(1, 5, 1, 1).expand(40_000, 5, 1, 1).contiguous()
    z = gumbel_softmax(logits, tau=0.5, dim=1)
    assert torch.isfinite(z).all()
    torch.testing.assert_close(z.sum(dim=1), torch.ones(40_000, 1, 1))
    freq = torch.bincount(z.argmax(dim=1).flatten(), minlength=5).float() / 40_000
    expected = logits[0, :, 0, 0].softmax(0)
    assert (freq - expected).abs().max() < 0.01, (freq, expected)  # 4 standard errors at p = 0.64


def test_logits_stay_fp32_under_bf16_autocast() -> None:
    model = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images(), temperature=1.0, kl_weight=1.0)
    assert out["logits"].dtype == torch.float32 and torch.isfinite(out["loss"])


@pytest.mark.parametrize("seed", [0, 1])
def test_training_decreases_the_loss(seed: int) -> None:
    model = tiny(seed)
    x = squares(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(x, temperature=1.0, kl_weight=0.1)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_resblocks_are_the_residual_branches() -> None:
    model = tiny()
    blocks = model.resblocks()
    assert len(blocks) == 2 * 4 * 1
    assert blocks[0][0] == "encoder.blocks.group_1.block_1.res_path"
    lit = DVAEModule(model, optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    names = [name for name, _ in find_resblocks(lit)]
    assert names == ["model." + name for name, _ in blocks]


def test_codebook_perplexity() -> None:
    metric = CodebookPerplexity(8)
    metric.update(torch.tensor([[0, 0], [1, 1]]))
    metric.update(torch.tensor([2, 2, 3, 3]))
    assert metric.compute().item() == pytest.approx(4.0)
    metric.reset()
    metric.update(torch.tensor([5, 5, 5]))
    assert metric.compute().item() == pytest.approx(1.0)


def loader(n: int = 6) -> DataLoader:
    data = [{"image": img, "text": f"caption {i}"} for i, img in enumerate(images(n))]
    return DataLoader(data, batch_size=3)


def test_lightning_module_runs_logs_and_writes_the_grid(tmp_path: str) -> None:
    model = tiny()
    lit = DVAEModule(
        model,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        kl_weight=0.5,
    )
    grid = ReconstructionGrid(num_images=4, nrow=3, dirpath=str(tmp_path / "grids"))
    trainer = pl.Trainer(
        fast_dev_run=True, accelerator="cpu", callbacks=[grid], default_root_dir=str(tmp_path),
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader())
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/recon_loss", "train/kl", "val/loss", "val/mse", "val/psnr", "val/perplexity"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    # fast_dev_run: one training step, one validation batch of 3 images.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(5e-4)
    x = loader().dataset
    x = torch.stack([d["image"] for d in x[:3]])
    recon = lit.reconstruct(x)
    assert metrics["val/mse"].item() == pytest.approx(F.mse_loss(recon, x).item(), rel=1e-4)
    assert metrics["val/psnr"].item() == pytest.approx(10 * math.log10(1 / metrics["val/mse"].item()), rel=1e-4)
    codes = lit.get_codebook_indices(x)
    p = torch.bincount(codes.flatten(), minlength=16).double() / codes.numel()
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    assert metrics["val/perplexity"].item() == pytest.approx(math.exp(entropy.item()), rel=1e-4)

    # The PNG: 3 originals over their 3 reconstructions (the first validation batch holds 3 images).
    path = tmp_path / "grids" / "recon_epoch0.png"
    assert path.exists() and grid.last_path == str(path)
    png = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255
    assert png.shape == (3, 2 * 34 + 2, 3 * 34 + 2)
    torch.testing.assert_close(png[:, 2:34, 2:34], x[0], atol=1 / 255, rtol=0)
    torch.testing.assert_close(png[:, 36:68, 36:68], recon[1], atol=1 / 255, rtol=0)


def test_grid_is_logged_to_tensorboard(tmp_path: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lit = DVAEModule(tiny(), optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=2, num_sanity_val_steps=0, accelerator="cpu",
        logger=logger, callbacks=[ReconstructionGrid(num_images=5)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
    )
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader())
    assert os.path.exists(os.path.join(logger.log_dir, "recon_epoch0.png"))  # default dirpath: trainer.log_dir
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    assert "val/reconstructions" in events.Tags()["images"]
    png = Image.open(os.path.join(logger.log_dir, "recon_epoch0.png"))
    assert png.size == (5 * 34 + 2, 2 * 34 + 2)  # 5 images collected over two batches of 3


def test_grid_callback_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_images=0"):
        ReconstructionGrid(num_images=0)


def test_kl_weight_rises_then_falls_over_its_share_of_the_run() -> None:
    from types import SimpleNamespace

    from dalle_lightning_callbacks.schedules import KLWeightAnnealing

    schedule = KLWeightAnnealing(beta=6.6, steps=10, fall_at_fraction=0.5, final=0.0)
    module = SimpleNamespace(kl_weight=0.0)
    schedule.setup(SimpleNamespace(max_steps=100, global_step=0), module, "fit")  # type: ignore[arg-type]
    values = [schedule.value(s) for s in (0, 5, 10, 49, 50, 75, 100)]
    assert values == pytest.approx([0.0, 3.3, 6.6, 6.6, 6.6, 3.3, 0.0])
    paper = KLWeightAnnealing(beta=6.6, steps=10)  # fall_at_fraction=1: constant after the warm-up
    paper.setup(SimpleNamespace(max_steps=100, global_step=0), module, "fit")  # type: ignore[arg-type]
    assert paper.value(100) == pytest.approx(6.6)
    with pytest.raises(ValueError, match=r"fall_at_fraction=2.0; expected the share"):
        KLWeightAnnealing(fall_at_fraction=2.0)
