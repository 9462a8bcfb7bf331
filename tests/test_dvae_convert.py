"""OpenAI's ``dall_e`` Encoder/Decoder state dicts load into our DiscreteVAE and give the same outputs."""

from __future__ import annotations

import attr
import pytest
import torch
import torch.nn.functional as F

from dalle_lightning.models.dvae import DiscreteVAE, map_pixels
from dalle_lightning.models.dvae_convert import (
    convert_openai_state_dict,
    infer_openai_config,
    load_openai_files,
    load_openai_state_dicts,
)

dall_e = pytest.importorskip("dall_e")

SMALL = dict(n_hid=16, vocab_size=64)


def openai_small() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Randomly initialised OpenAI modules at a small config. Their attrs validators demand n_hid >= 64 and
    vocab_size >= 512 (sizes for the release, not requirements of the architecture), so switch them off."""
    torch.manual_seed(0)
    with attr.validators.disabled():
        enc = dall_e.Encoder(**SMALL)
        dec = dall_e.Decoder(**SMALL, n_init=8)
    # Their init gives every bias 0; make the biases random so a mis-mapped bias cannot pass unnoticed.
    for module in (enc, dec):
        for name, p in module.named_parameters():
            if name.endswith(".b"):
                p.data.normal_()
    return enc.eval(), dec.eval()


def ours_small() -> DiscreteVAE:
    return DiscreteVAE(image_size=64, codebook_dim=8, **SMALL).eval()


def test_converted_model_reproduces_openai_outputs() -> None:
    enc, dec = openai_small()
    model = load_openai_state_dicts(ours_small(), enc.state_dict(), dec.state_dict())
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        their_logits = enc(map_pixels(x))
        torch.testing.assert_close(model.encode(x), their_logits, atol=1e-5, rtol=1e-5)
        idx = their_logits.argmax(1)
        assert torch.equal(model.get_codebook_indices(x), idx)

        one_hot = F.one_hot(idx, 64).permute(0, 3, 1, 2).float()
        their_stats = dec(one_hot)
        torch.testing.assert_close(model.decoder(one_hot), their_stats, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.decode_stats(idx), their_stats, atol=1e-5, rtol=1e-5)
        soft = torch.softmax(their_logits, dim=1)  # a relaxed sample, as in training
        torch.testing.assert_close(model.decoder(soft), dec(soft), atol=1e-5, rtol=1e-5)

        their_images = dall_e.unmap_pixels(torch.sigmoid(their_stats[:, :3]))
        torch.testing.assert_close(model.reconstruct(x), their_images, atol=1e-5, rtol=1e-5)


def test_paper_config_maps_key_for_key() -> None:
    meta = torch.device("meta")
    enc, dec = dall_e.Encoder(device=meta), dall_e.Decoder(device=meta)
    with meta:
        model = DiscreteVAE(image_size=256)
    for theirs, ours in ((enc, model.encoder), (dec, model.decoder)):
        converted = convert_openai_state_dict(theirs.state_dict(), ours)
        assert converted.keys() == ours.state_dict().keys()
        assert len(converted) == len(theirs.state_dict())
    assert "blocks.group_1.block_1.res_path.conv_1.weight" in model.encoder.state_dict()
    assert "blocks.output.conv.weight" in model.decoder.state_dict()
    inferred = infer_openai_config(enc.state_dict(), dec.state_dict())
    assert inferred == dict(vocab_size=8192, n_hid=256, n_blk_per_group=2, group_count=4, codebook_dim=128, channels=3)


def test_mismatched_config_is_a_clear_error() -> None:
    enc, dec = openai_small()
    wrong_width = DiscreteVAE(image_size=64, codebook_dim=8, n_hid=32, vocab_size=64)
    with pytest.raises(ValueError, match=r"encoder: shape mismatch for 'blocks.input.w'"):
        load_openai_state_dicts(wrong_width, enc.state_dict(), dec.state_dict())
    more_blocks = DiscreteVAE(image_size=64, codebook_dim=8, n_blk_per_group=3, **SMALL)
    with pytest.raises(ValueError, match="lacks"):
        load_openai_state_dicts(more_blocks, enc.state_dict(), dec.state_dict())


def test_pickled_release_files_load(tmp_path) -> None:
    enc, dec = openai_small()
    torch.save(enc, tmp_path / "encoder.pkl")  # the release pickles whole dall_e modules
    torch.save(dec.state_dict(), tmp_path / "decoder.pkl")  # a plain state dict works too
    model = load_openai_files(ours_small(), tmp_path / "encoder.pkl", tmp_path / "decoder.pkl")
    torch.testing.assert_close(model.decoder.blocks.input.weight, dec.blocks.input.w)
    torch.testing.assert_close(model.encoder.blocks.output.conv.bias, enc.blocks.output.conv.b)
    with pytest.raises(FileNotFoundError, match="missing.pkl"):
        load_openai_files(ours_small(), tmp_path / "missing.pkl", tmp_path / "decoder.pkl")
