"""Contrastive reranking: keep the candidate image that best matches its caption.

The paper draws N samples per caption from the prior and keeps the best by CLIP score (N = 512 in its
figures; FID gains flatten after N = 32). The score is the cosine similarity between the image and text
embeddings of an open_clip model: the embedded ``shapes-clip`` trained by ``dalle-train stage=clip``, or any
open_clip architecture with the user's local weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dalle_lightning.artifacts import load_model
from dalle_lightning.models import clip as clip_models
from dalle_lightning.safe_files import check_plain, read_data


class Reranker(nn.Module):
    """Scores (image, caption) pairs with an open_clip model; images are ``[..., 3, H, W]`` floats in [0, 1]."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        image_mean: tuple[float, ...] | torch.Tensor,
        image_std: tuple[float, ...] | torch.Tensor,
        batch_size: int = 256,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size}; expected a positive number of images per forward pass")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.register_buffer("image_mean", torch.as_tensor(image_mean, dtype=torch.float32), persistent=False)
        self.register_buffer("image_std", torch.as_tensor(image_std, dtype=torch.float32), persistent=False)

    @classmethod
    def from_model(cls, model: nn.Module, batch_size: int = 256) -> "Reranker":
        """A reranker for a model built by :func:`dalle_lightning.models.clip.create` (tokenizer and mean/std from it)."""
        mean, std = clip_models.image_mean_std(model)
        return cls(model, clip_models.tokenizer_for(model), mean, std, batch_size=batch_size)

    @classmethod
    def from_saved(cls, path: str | Path, device: str = "cpu") -> "Reranker":
        """The CLIP that ``dalle-train stage=clip`` saved (``paths.clip``, written by ``artifacts.save_model``)."""
        return cls.from_model(load_model(path)).to(device)

    @classmethod
    def from_pretrained(cls, name: str, pretrained: str | Path | None = None, device: str = "cpu") -> "Reranker":
        """Any open_clip architecture by name, with weights from a local file (e.g. ``"ViT-B-32"``, ``"/w/b32.pt"``)."""
        return cls.from_model(clip_models.create(name, pretrained=pretrained)).to(device)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu") -> "Reranker":
        """Load a ``ClipModule`` Lightning checkpoint, or a directory written by ``models.clip.save``."""
        path = Path(path)
        if path.is_dir():
            return cls.from_model(clip_models.create(f"local-dir:{path}")).to(device)
        if not path.is_file():
            raise FileNotFoundError(f"CLIP checkpoint not found: {str(path)!r}; expected a .ckpt file or a saved model directory")
        checkpoint = read_data(path, "ClipModule checkpoint", "use a checkpoint that dalle-train stage=clip wrote",
                               "a .ckpt file that dalle-train stage=clip wrote")  # data only: no code runs
        if not isinstance(checkpoint, dict) or "open_clip_spec" not in checkpoint or "state_dict" not in checkpoint:
            raise ValueError(f"{str(path)!r} is not a ClipModule checkpoint; expected keys 'open_clip_spec' and 'state_dict'")
        prefix = "model."
        state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
        check_plain(checkpoint["open_clip_spec"], path, "open_clip_spec")
        model = clip_models.from_spec(checkpoint["open_clip_spec"], state, path)  # a model's name, not a place
        return cls.from_model(model).to(device)

    @property
    def device(self) -> torch.device:
        return self.image_mean.device

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> unit-norm embeddings ``[B, D]`` (resized to the model's input if needed)."""
        clip_models.check_images(images)
        size = clip_models.image_size(self.model)
        out = []
        for chunk in images.split(self.batch_size):
            pixels = clip_models.normalize_images(chunk.to(self.device), self.image_mean, self.image_std, size)
            out.append(self.model.encode_image(pixels, normalize=True).float())
        return torch.cat(out)

    @torch.no_grad()
    def embed_texts(self, captions: list[str]) -> torch.Tensor:
        """Captions -> unit-norm embeddings ``[B, D]``."""
        if isinstance(captions, str) or not all(isinstance(c, str) for c in captions):
            raise ValueError(f"captions is {type(captions).__name__}; expected a list of strings")
        tokens = self.tokenizer(list(captions)).to(self.device)
        return self.model.encode_text(tokens, normalize=True).float()

    def score(self, images: torch.Tensor, captions: list[str]) -> torch.Tensor:
        """Cosine similarity of each image with its own caption: ``FloatTensor[B]``."""
        if torch.is_tensor(images) and images.ndim == 4 and len(captions) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(captions)} captions; expected one caption per image")
        return (self.embed_images(images) * self.embed_texts(captions)).sum(dim=-1)

    def best_of(self, candidates: torch.Tensor, caption: str) -> tuple[int, torch.Tensor]:
        """Index of the candidate ``[N, 3, H, W]`` that best matches ``caption``, and all N scores."""
        if not isinstance(caption, str):
            raise ValueError(f"caption is {type(caption).__name__}; expected one string (use rerank() for several)")
        scores = self.embed_images(candidates) @ self.embed_texts([caption])[0]
        return int(scores.argmax()), scores

    def rerank(self, candidates: torch.Tensor, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """For candidates ``[P, N, 3, H, W]`` and P captions: the best image per caption ``[P, 3, H, W]`` and scores ``[P, N]``."""
        if not torch.is_tensor(candidates) or candidates.ndim != 5:
            shape = tuple(candidates.shape) if torch.is_tensor(candidates) else type(candidates).__name__
            raise ValueError(f"candidates has shape {shape}; expected [P prompts, N candidates, 3, H, W]")
        p, n = candidates.shape[:2]
        if len(captions) != p:
            raise ValueError(f"{p} prompts of candidates but {len(captions)} captions; expected one caption per prompt")
        image_features = self.embed_images(candidates.flatten(0, 1)).view(p, n, -1)
        text_features = self.embed_texts(captions)
        scores = torch.einsum("pnd,pd->pn", image_features, text_features)
        best = candidates[torch.arange(p), scores.argmax(dim=1).to(candidates.device)]
        return best, scores
