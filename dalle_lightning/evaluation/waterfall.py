"""The waterfall of a trained pipeline: where caption accuracy is lost, stage by stage.

Each row bounds the next from above, so the first large drop names the stage to fix:

* ``renders``: the world's own renders of the evaluation captions (the detector's ceiling, ~1.0);
* ``reconstructions``: the dVAE's reconstructions of those renders (argmax codes -> decoder), what the prior's
  tokens can show at best; beside it the codes in use and the codebook perplexity on those renders;
* ``any_of_n``: at least one of the N candidates matches (a perfect reranker);
* ``pick_clip`` / ``pick_prior`` / ``pick_both``: the candidate each reranker keeps (``dalle_lightning.generation.selection``);
* ``one_sample``: the mean over all candidates (no reranking; less noisy than candidate 0 alone).

Every row is given for all captions and apart for one- and two-object captions, whose shapes are smaller and whose
relation must hold as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dalle_lightning.world.parse import parse_caption

GROUPS = ("all", "one_object", "two_objects")
ROWS = ("renders", "reconstructions", "any_of_n", "pick_clip", "pick_prior", "pick_both", "one_sample")


def object_groups(captions: Sequence[str]) -> dict[str, np.ndarray]:
    """Boolean masks over ``captions``: all of them, those naming one object and those naming two."""
    count = np.array([len(parse_caption(c).objects) for c in captions])
    return {"all": np.ones(len(captions), dtype=bool), "one_object": count == 1, "two_objects": count == 2}


@torch.no_grad()
def reconstruct(dvae: torch.nn.Module, images: torch.Tensor, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The dVAE's reconstructions of ``images [B, 3, H, W]`` (back at H x W, in [0, 1]) and their argmax codes
    ``[B, h, w]``. Images are resized to the dVAE's own size first when it differs (the world renders at 64 px)."""
    size = getattr(dvae, "image_size", images.shape[-1])
    param = next(dvae.parameters(), None)
    device = param.device if param is not None else images.device
    recons, codes = [], []
    for chunk in images.split(batch_size):
        x = chunk.to(device)
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="area")
        y = dvae.reconstruct(x).float().clamp(0, 1)
        if y.shape[-1] != images.shape[-1]:
            y = F.interpolate(y, size=images.shape[-2:], mode="bilinear", align_corners=False)
        recons.append(y.cpu())
        codes.append(dvae.get_codebook_indices(x).cpu())
    return torch.cat(recons), torch.cat(codes)


def codebook_usage(codes: torch.Tensor, vocab_size: int) -> dict[str, float | int]:
    """Codes in use among ``vocab_size`` and the perplexity ``exp(entropy)`` of their frequencies (the number of
    equally used codes that would carry as much information; ``vocab_size`` at best)."""
    counts = torch.bincount(codes.flatten().long(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    entropy = float(-(p * p.log()).sum()) if p.numel() else 0.0
    return {"codes_in_use": int((counts > 0).sum()), "vocab_size": int(vocab_size),
            "codebook_perplexity": round(math.exp(entropy), 2), "tokens": int(codes.numel())}


def waterfall_rows(renders_ok: np.ndarray, recon_ok: np.ndarray, ok: np.ndarray, picks: dict[str, np.ndarray],
                   groups: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per group of captions, each row's accuracy. ``ok [P, N]`` says which candidates match, ``picks`` maps a
    reranker (``clip``, ``prior``, ``both``) to the index it keeps per caption (absent: not measured)."""
    out = {}
    rows = np.arange(ok.shape[0])
    for name, mask in groups.items():
        if not mask.any():
            continue
        entry = {"renders": renders_ok[mask].mean(), "reconstructions": recon_ok[mask].mean(),
                 "any_of_n": ok[mask].any(axis=1).mean()}
        entry.update({f"pick_{r}": ok[rows, index][mask].mean() for r, index in picks.items()})
        entry["one_sample"] = ok[mask].mean()
        out[name] = {k: round(float(v), 4) for k, v in entry.items()}
        out[name]["captions"] = int(mask.sum())
    return out


def waterfall_line(waterfall: dict[str, Any]) -> str:
    """One split's waterfall on one line, e.g. ``renders 100% | dVAE 63% (37/512 codes, perplexity 21.3) | ...``
    (all captions; one-/two-object captions in brackets)."""
    names = {"renders": "renders", "reconstructions": "dVAE", "any_of_n": f"any of {waterfall['n']}",
             "pick_clip": "clip pick", "pick_prior": "prior pick", "pick_both": "both pick", "one_sample": "one sample"}
    parts = []
    for row in ROWS:
        if row not in waterfall["all"]:
            continue
        by_count = "/".join(f"{waterfall[g][row]:.0%}" for g in ("one_object", "two_objects") if g in waterfall)
        text = f"{names[row]} {waterfall['all'][row]:.0%} ({by_count})"
        if row == "reconstructions":
            codes = waterfall["codes"]
            text += f" [{codes['codes_in_use']}/{codes['vocab_size']} codes, perplexity {codes['codebook_perplexity']}]"
        parts.append(text)
    return " | ".join(parts)
