"""Load OpenAI's released dVAE (``dall_e`` package: ``encoder.pkl`` / ``decoder.pkl``) into :class:`DiscreteVAE`.

Our module tree mirrors theirs name for name; the only difference is that their ``Conv2d`` calls its
parameters ``w``/``b`` where ``nn.Conv2d`` says ``weight``/``bias``. Users holding the released weight files
can thus start from the paper's dVAE (build ``DiscreteVAE(image_size=256)`` with the default widths).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from dalle_lightning.models.dvae import DiscreteVAE

_SUFFIXES = {".w": ".weight", ".b": ".bias"}


def convert_openai_state_dict(theirs: Mapping[str, torch.Tensor], ours: nn.Module, what: str = "module") -> dict[str, torch.Tensor]:
    """Rename a ``dall_e`` Encoder/Decoder state dict to ``ours``' names, checking keys and shapes.

    Raises ``ValueError`` naming the first offending key, so a config that does not match the weights
    (other n_hid, vocabulary, blocks per group) fails before anything is loaded.
    """
    expected = ours.state_dict()
    converted: dict[str, torch.Tensor] = {}
    for key, value in theirs.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{what}: unexpected key {key!r} in the OpenAI state dict; expected names ending in .w or .b")
        name = key[: -len(suffix)] + _SUFFIXES[suffix]
        if name not in expected:
            raise ValueError(f"{what}: OpenAI key {key!r} has no counterpart {name!r}; the model config does not match the weights")
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{what}: shape mismatch for {key!r}: OpenAI {tuple(value.shape)}, ours {tuple(expected[name].shape)}; "
                f"the model config does not match the weights"
            )
        converted[name] = value
    missing = sorted(set(expected) - set(converted))
    if missing:
        raise ValueError(f"{what}: OpenAI state dict lacks {len(missing)} of our parameters, first {missing[0]!r}; the model config does not match the weights")
    return converted


def load_openai_state_dicts(
    model: DiscreteVAE, encoder_state: Mapping[str, torch.Tensor], decoder_state: Mapping[str, torch.Tensor]
) -> DiscreteVAE:
    """Copy the weights of OpenAI's Encoder and Decoder (their ``state_dict()``) into ``model``, in place."""
    enc = convert_openai_state_dict(encoder_state, model.encoder, "encoder")
    dec = convert_openai_state_dict(decoder_state, model.decoder, "decoder")
    model.encoder.load_state_dict(enc, strict=True)
    model.decoder.load_state_dict(dec, strict=True)
    return model


def _read_state(path: str | os.PathLike[str]) -> Mapping[str, torch.Tensor]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"OpenAI dVAE file {os.fspath(path)!r} does not exist; expected encoder.pkl or decoder.pkl")
    try:
        # The release pickles whole ``dall_e`` modules, so full unpickling is needed: load trusted files only.
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"unpickling {os.fspath(path)!r} needs OpenAI's package ({err.name} missing); install it with `pip install dall-e`"
        ) from err
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise ValueError(f"{os.fspath(path)!r} holds a {type(obj).__name__}; expected a pickled dall_e module or a state dict")


def load_openai_files(
    model: DiscreteVAE, encoder_path: str | os.PathLike[str], decoder_path: str | os.PathLike[str]
) -> DiscreteVAE:
    """Load the released ``encoder.pkl`` and ``decoder.pkl`` (or plain state-dict files) into ``model``."""
    return load_openai_state_dicts(model, _read_state(encoder_path), _read_state(decoder_path))


def infer_openai_config(
    encoder_state: Mapping[str, torch.Tensor], decoder_state: Mapping[str, torch.Tensor]
) -> dict[str, int]:
    """The :class:`DiscreteVAE` keyword arguments (all but ``image_size``) that fit OpenAI state dicts,
    read off their shapes, e.g. ``DiscreteVAE(image_size=256, **infer_openai_config(enc, dec))``."""
    try:
        enc_in, enc_out = encoder_state["blocks.input.w"], encoder_state["blocks.output.conv.w"]
        dec_in = decoder_state["blocks.input.w"]
    except KeyError as err:
        raise ValueError(f"key {err.args[0]!r} missing; expected state dicts of dall_e Encoder and Decoder") from err
    groups = {k.split(".")[1] for k in encoder_state if k.startswith("blocks.group_")}
    blocks = {k.split(".")[2] for k in encoder_state if k.startswith("blocks.group_1.block_")}
    return dict(
        vocab_size=enc_out.shape[0],
        n_hid=enc_in.shape[0],
        n_blk_per_group=len(blocks),
        group_count=len(groups),
        codebook_dim=dec_in.shape[0],
        channels=enc_in.shape[1],
    )
