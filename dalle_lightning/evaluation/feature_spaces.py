"""The feature spaces ``dalle-eval`` measures in, each under the name its scores carry.

A distance or a contrastive score means something only beside values measured in the same space, and the project's
own CLIP (``clip=``, trained by ``dalle-train stage=clip`` on whatever data the pipeline saw) is a different space
from one run to the next; an open_clip model with published weights (``open_clip={model: ViT-B-32, pretrained:
/w/b32.pt}``) is a fixed one, and, unlike the project's CLIP, it is not the reranker whose choice it would judge.
So each space has a name that goes into every score measured in it: ``clip`` for the project's CLIP,
``openclip_<architecture>`` (lower case, ``_`` for other characters: ``openclip_vit_b_32``) for an open_clip model.

Both are used through :class:`~dalle_lightning.generation.rerank.Reranker` (``embed_images``, ``embed_texts``: unit-
norm embeddings of [0, 1] images resized to the model's input, and of captions). Weights are read from a local file
only, as data (open_clip's ``torch.load(weights_only=True)``); a pretrained *tag* (``openai``, ...) is refused, so
nothing is downloaded, and so is a model named by a place (``local-dir:``, ``hf-hub:``, a path).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dalle_lightning.generation.rerank import Reranker
from dalle_lightning.safe_files import refusal
from dalle_lightning_plugins.io.refusal import refused_global

CLIP_SPACE = "clip"  # the project's CLIP (clip=)
OPEN_CLIP_KEYS = ("model", "pretrained")


def open_clip_space_name(model: str) -> str:
    """``openclip_<model>`` in lower case with ``_`` for anything but letters and digits."""
    return "openclip_" + re.sub(r"[^a-z0-9]+", "_", model.lower()).strip("_")


def check_open_clip(spec: Any, key: str = "open_clip") -> tuple[str, str] | None:
    """``(model, pretrained)`` of an ``open_clip`` setting (None when null), or a one-line ``ValueError`` naming the
    key, the value and what is expected, before anything loads."""
    if spec is None:
        return None
    example = "{model: ViT-B-32, pretrained: /path/to/weights.pt}"
    if not isinstance(spec, Mapping) or set(spec) != set(OPEN_CLIP_KEYS):
        got = dict(spec) if isinstance(spec, Mapping) else spec
        raise ValueError(f"{key}={got!r}; expected null or {example} (an open_clip architecture and a local weights file)")
    model, pretrained = spec["model"], spec["pretrained"]
    from dalle_lightning.models import clip as clip_models

    # A name only: open_clip reads a local-dir: name from another folder (its own weights, not `pretrained`) and
    # downloads an hf-hub: one, so neither is asked of it here.
    try:
        ok = clip_models.is_plain_name(model) and clip_models.model_config(model) is not None
    except ValueError:  # unknown here
        ok = False
    if not ok:
        raise ValueError(f"{key}.model={model!r}; expected an open_clip architecture name (one of "
                         "open_clip.list_models(), e.g. ViT-B-32)")
    if not isinstance(pretrained, str) or not Path(pretrained).is_file():
        raise ValueError(f"{key}.pretrained={pretrained!r}; expected an existing local weights file for {model} "
                         "(pretrained tags such as 'openai' are never downloaded: download the file, then name it here)")
    return model, pretrained


def open_clip_reranker(model: str, pretrained: str, device: str | torch.device = "cpu",
                       key: str = "open_clip") -> Reranker:
    """The open_clip model ``model`` with the weights of the local file ``pretrained``; a file that does not hold
    that architecture's weights is a one-line ``ValueError`` naming ``key``."""
    try:
        return Reranker.from_pretrained(model, pretrained).to(device)
    except (RuntimeError, KeyError, ValueError, AssertionError, OSError, EOFError, pickle.UnpicklingError) as exc:
        # load_state_dict's mismatches, open_clip's own shape asserts, a truncated or foreign file; open_clip reads
        # with torch.load(weights_only=True), so a file that asks for a global was refused before anything ran
        name = refused_global(exc)
        if name is not None:
            raise refusal(pretrained, name, f"{key}.pretrained: weights file",
                          f"use the published weights file of {model}") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{key}.pretrained={pretrained!r} could not be loaded as {model} weights ({first[:200]}); "
                         f"expected a weights file of the {model} architecture") from exc


def feature_spaces(clip: Reranker | None, open_clip: tuple[str, str] | None = None,
                   device: str | torch.device = "cpu") -> dict[str, Reranker]:
    """Name -> model of every space to measure in: the project's CLIP (when loaded) and the open_clip model (when
    configured), in that order."""
    spaces: dict[str, Reranker] = {}
    if clip is not None:
        spaces[CLIP_SPACE] = clip
    if open_clip is not None:
        spaces[open_clip_space_name(open_clip[0])] = open_clip_reranker(*open_clip, device=device)
    return spaces
