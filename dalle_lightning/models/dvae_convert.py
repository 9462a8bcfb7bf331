"""Load OpenAI's released dVAE (``dall_e`` package: ``encoder.pkl`` / ``decoder.pkl``) into :class:`DiscreteVAE`.

Our module tree mirrors theirs name for name; the only difference is that their ``Conv2d`` calls its
parameters ``w``/``b`` where ``nn.Conv2d`` says ``weight``/``bias``. Users holding the released weight files
can thus start from the paper's dVAE (build ``DiscreteVAE(image_size=256)`` with the default widths).

The release pickles whole ``dall_e`` modules, so it cannot load as plain tensors; it is read with torch's restricted
unpickler (``weights_only=True``) allowing, for this one load, exactly the classes those modules are made of
(:data:`OPENAI_CLASSES`: ``dall_e``'s Encoder, Decoder, their blocks and Conv2d, and the torch containers and layers
they hold) besides torch's own tensor rebuilds. The unpickler creates those objects without calling their
constructors and only sets their attributes; any other global is refused in one line naming the file and the global.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping

import torch
from torch import nn

from dalle_lightning.models.dvae import DiscreteVAE
from dalle_lightning.safe_files import UnsafeFile, read_data

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


# (module, class) names of what OpenAI's encoder.pkl and decoder.pkl are made of, besides tensors and containers.
OPENAI_CLASSES: tuple[tuple[str, str], ...] = (
    ("dall_e.encoder", "Encoder"), ("dall_e.encoder", "EncoderBlock"),
    ("dall_e.decoder", "Decoder"), ("dall_e.decoder", "DecoderBlock"), ("dall_e.utils", "Conv2d"),
    ("torch.nn", "Sequential"), ("torch.nn", "ReLU"), ("torch.nn", "MaxPool2d"), ("torch.nn", "Upsample"),
    ("torch.nn", "Identity"),
)


def openai_classes() -> list[type]:
    """The classes of :data:`OPENAI_CLASSES` that import here (``dall_e``'s only where OpenAI's package is installed:
    a plain state dict needs none of them)."""
    classes = []
    for module, name in OPENAI_CLASSES:
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError:
            continue
    return classes


def _read_state(path: str | os.PathLike[str]) -> Mapping[str, torch.Tensor]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"OpenAI dVAE file {os.fspath(path)!r} does not exist; expected encoder.pkl or decoder.pkl")
    allowed = ", ".join(f"{m}.{n}" for m, n in OPENAI_CLASSES[:5])
    fix = f"OpenAI's release holds only {allowed} modules and tensors; use the files OpenAI published"
    try:
        obj = read_data(path, "OpenAI dVAE file", fix,
                        "encoder.pkl or decoder.pkl of the dall_e release, or a state dict", allowed=openai_classes())
    except UnsafeFile as exc:
        if "global dall_e." in str(exc) and importlib.util.find_spec("dall_e") is None:
            raise ModuleNotFoundError(f"reading {os.fspath(path)!r} needs OpenAI's package (dall_e missing); install "
                                      "it with `pip install dall-e`") from None
        raise
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
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
