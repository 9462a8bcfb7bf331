"""The prior as a whole: paper-scale shape on meta, causality, sparse == dense, loss, overfitting, Lightning."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from dalle_lightning.lit.prior import PriorModule, drop_captions
from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins.protocol import find_resblocks

TINY = dict(text_vocab_size=40, text_len=7, image_vocab_size=24, image_grid=5, n_layer=4, n_head=2, d_head=8)


def tiny(seed: int = 0, **overrides) -> DallePrior:
    torch.manual_seed(seed)
    return DallePrior(**{**TINY, **overrides})


def batch(b: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, TINY["text_vocab_size"], (b, TINY["text_len"]), generator=g)
    text[:, 5:] = 0  # short captions: padded tail
    image = torch.randint(0, TINY["image_vocab_size"], (b, TINY["image_grid"] ** 2), generator=g)
    return text, image


def test_paper_scale_on_meta():
    with torch.device("meta"):
        model = DallePrior(
            text_vocab_size=16384, text_len=256, image_vocab_size=8192, image_grid=32, n_layer=64, n_head=62, d_head=64
        )
    n_params = sum(p.numel() for p in model.parameters())
    assert 11.7e9 <= n_params <= 12.3e9, n_params
    assert model.d_model == 3968 and model.text_emb.num_embeddings == 16384 + 256
    kinds = model.attention_types()
    assert (kinds.count("row"), kinds.count("column"), kinds.count("conv")) == (47, 16, 1)
    assert kinds[:4] == ["row", "column", "row", "row"] and kinds[-1] == "conv"


def test_resblocks_are_named_branches():
    model = tiny()
    names = [name for name, _ in find_resblocks(model)]
    assert names == [f"layers.{i}.{b}" for i in range(4) for b in ("attn", "mlp")]
    lit_names = [name for name, _ in find_resblocks(PriorModule(model, torch.optim.AdamW))]
    assert lit_names == [f"model.{n}" for n in names]
    assert all(hasattr(m, "ln") for _, m in model.resblocks())  # each branch has its own pre-LayerNorm


def test_padding_embedding_is_per_position():
    model = tiny()
    text = torch.zeros(1, 7, dtype=torch.long)
    emb = model.embed_text(text)[0]
    for i in range(7):
        want = model.text_emb.weight[TINY["text_vocab_size"] + i] + model.text_pos.weight[i]
        torch.testing.assert_close(emb[i], want)


@pytest.mark.parametrize("impl", ["sparse", "dense"])
def test_no_position_sees_a_later_token(impl):
    model = tiny(attn_impl=impl).eval()
    text, image = batch()
    t_logits, i_logits = model.logits(text, image[:, :-1])
    for j in (0, 6, 12, 23):  # image token j feeds the logits predicting image tokens j+1 ..
        changed = image.clone()
        changed[:, j] = (changed[:, j] + 1) % TINY["image_vocab_size"]
        t2, i2 = model.logits(text, changed[:, :-1])
        assert t2.equal(t_logits) and i2[:, : j + 1].equal(i_logits[:, : j + 1])
        assert not torch.allclose(i2[:, j + 1], i_logits[:, j + 1])
    for j in (0, 3, 6):  # caption token j feeds the logits of caption tokens j+1 ..
        changed = text.clone()
        changed[:, j] = (changed[:, j] + 1) % TINY["text_vocab_size"]
        t2, _ = model.logits(changed, image[:, :-1])
        assert t2[:, : j + 1].equal(t_logits[:, : j + 1])


def test_sparse_model_equals_dense_model_with_gradients():
    text, image = batch()
    grads = []
    for impl in ("sparse", "dense"):
        model = tiny(attn_impl=impl)
        loss = model(text, image)["loss"]
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-6, rtol=0)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_loss_is_weighted_and_normalised_per_kind():
    model = tiny().eval()
    text, image = batch(b=2)
    out = model(text, image)
    t_logits, i_logits = model.logits(text, image[:, :-1])
    # Hand computation: sum of -log p over each kind's tokens, divided by that kind's count.
    t_nll = -sum(t_logits[b, i].log_softmax(-1)[text[b, i]] for b in range(2) for i in range(7))
    i_nll = -sum(i_logits[b, j].log_softmax(-1)[image[b, j]] for b in range(2) for j in range(25))
    text_loss, image_loss = t_nll / (2 * 7), i_nll / (2 * 25)
    torch.testing.assert_close(out["text_loss"], text_loss)
    torch.testing.assert_close(out["image_loss"], image_loss)
    torch.testing.assert_close(out["loss"], text_loss / 8 + 7 * image_loss / 8)
    assert i_logits.shape == (2, 25, TINY["image_vocab_size"]) and t_logits.shape == (2, 7, TINY["text_vocab_size"])


def test_logits_are_fp32_under_bf16_autocast():
    model = tiny()
    text, image = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t_logits, i_logits = model.logits(text, image[:, :-1])
        loss = model(text, image)["loss"]
    assert t_logits.dtype == i_logits.dtype == torch.float32
    assert torch.isfinite(loss)


def test_bad_inputs_are_named():
    model = tiny()
    text, image = batch()
    with pytest.raises(ValueError, match=r"expected \[batch, 7\]"):
        model(text[:, :5], image)
    with pytest.raises(ValueError, match="text ids"):
        model(text + 100, image)
    with pytest.raises(ValueError, match=r"expected \[batch, 25\]"):
        model(text, image[:, :10])
    with pytest.raises(ValueError, match="attn_impl='magic'"):
        tiny(attn_impl="magic")
    with pytest.raises(ValueError, match="attn_pattern"):
        tiny(attn_pattern="row,row")


def test_tiny_model_overfits_a_handful_of_sequences():
    model = tiny(n_layer=2, n_head=4, d_head=16)
    text, image = batch(b=4, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = model(text, image)["loss"]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = model(text, image)
    # The first caption token follows the same start vector in every sequence, so its loss cannot go below the
    # entropy of the first tokens in the batch; everything after it is memorisable.
    counts = torch.unique(text[:, 0], return_counts=True)[1].float()
    floor = -(counts / 4 * (counts / 4).log()).sum().item() / TINY["text_len"]
    assert first > 2.5 and final["image_loss"].item() < 0.05, final
    assert floor - 1e-3 < final["text_loss"].item() < floor + 0.05, (final, floor)


def test_drop_captions():
    text, _ = batch(b=400)
    assert drop_captions(text, 0.0) is text
    assert not drop_captions(text, 1.0).any()
    dropped = drop_captions(text, 0.25, torch.Generator().manual_seed(0))
    rows = (dropped == 0).all(dim=1)
    assert 0.15 < rows.float().mean() < 0.35
    assert dropped[~rows].equal(text[~rows])
    with pytest.raises(ValueError, match="caption_dropout=1.5"):
        drop_captions(text, 1.5)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.text, self.image = batch(b=8, seed=5)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"text": self.text[i], "image": self.image[i]}


def test_lightning_fast_dev_run(tmp_path):
    module = PriorModule(
        tiny(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.045),
        scheduler=functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: min(1.0, (s + 1) / 10)),
        caption_dropout=0.5,
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4)
    trainer = pl.Trainer(
        fast_dev_run=True, accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(module, loader, loader)
    assert "train/loss" in trainer.callback_metrics and "val/image_loss" in trainer.callback_metrics
    assert any(not p.equal(before[n]) for n, p in module.named_parameters())
    groups = trainer.optimizers[0].param_groups
    assert groups[0]["weight_decay"] == 0.045 and groups[1]["weight_decay"] == 0.0


def test_fid_protocol_decodes_samples_and_real_codes_with_the_dvae():
    """``fid_generate`` = the seeded sampler's tokens through the dVAE; ``fid_real`` = the batch's codes through it."""
    from dalle_lightning.models.dvae import DiscreteVAE
    from dalle_lightning.generation.sampling import sample_image_tokens

    torch.manual_seed(0)
    dvae = DiscreteVAE(image_size=40, group_count=4, n_hid=8, n_blk_per_group=1, vocab_size=24, codebook_dim=8)
    module = PriorModule(tiny(), functools.partial(torch.optim.AdamW), dvae=dvae, fid_seed=3)
    text, image = batch()
    data = {"text": text, "image": image, "caption": ["a", "b", "c"]}
    grid = TINY["image_grid"]

    real = module.fid_real(data)
    with torch.no_grad():
        assert torch.equal(real, dvae.decode_indices(image.reshape(-1, grid, grid)).clamp(0, 1))
        tokens = sample_image_tokens(module.model, text, generator=torch.Generator().manual_seed(3))
        expected = dvae.decode_indices(tokens.reshape(-1, grid, grid)).clamp(0, 1)
    fake = module.fid_generate(data)
    assert fake.shape == (3, 3, 40, 40) and torch.equal(fake, expected)
    assert torch.equal(module.fid_generate(data), fake)  # every evaluation draws the same way
    assert module.fid_captions(data) == ["a", "b", "c"]
    assert not any(n.startswith("_dvae") or "dvae" in n for n, _ in module.named_parameters())  # not trained

    with pytest.raises(KeyError, match="caption"):
        module.fid_captions({"text": text, "image": image})
    with pytest.raises(RuntimeError, match="dvae"):
        PriorModule(tiny(), functools.partial(torch.optim.AdamW)).fid_real(data)
