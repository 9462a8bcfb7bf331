"""Contrastive image-text models for reranking, built by open_clip.

The paper reranks the prior's samples with CLIP. Here any open_clip architecture can be built by name
(``"RN50"``, ``"ViT-B-32"``, ...), with weights from a local file the user already has: nothing is ever
downloaded, so a pretrained *tag* such as ``"openai"`` is refused with a clear error.

The embedded default, ``shapes-clip``, is a small open_clip ``CLIP`` for 64x64 shapes-world images: a
ModifiedResNet (CLIP's RN tower: conv stem, one bottleneck per stage, attention pooling) of width 16 and a
two-layer text transformer over 32 tokens. It tells colours and shapes apart within a few hundred steps,
where a ViT with 8x8 patches, though faster per step, still confused small triangles and squares at twice
that (docs/experiments.md): 12-px shapes fall inside single patches, and the conv stem sees their outlines. Its text tower keeps open_clip's 49,408-token
BPE vocabulary so that the stock open_clip tokenizer works unchanged.

Every model built here carries ``open_clip_spec`` (name, architecture config and preprocessing config), so a
checkpoint can rebuild it without the code that made it, and :func:`save` writes the ``local-dir:`` layout
that ``open_clip.create_model("local-dir:<dir>")`` reads directly.

A model file names a model, never a place: open_clip reads ``local-dir:<dir>`` from that folder and downloads
``hf-hub:<repo>``, so a name read from a file (a model file's ``config.name``, a checkpoint's ``open_clip_spec``)
must be a plain model name (:func:`check_file_model_name`) before open_clip sees it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import nn
from typing_extensions import override

from dalle_lightning_plugins.io.atomic_files import torch_save, write_json

SHAPES_CLIP = "shapes-clip"

# Sizes chosen by timing fp32 training steps at batch 64 on 2 CPU cores; bf16 autocast gave no speed-up at
# this size. The 64-px input leaves a 2x2 map for the attention pool.
SHAPES_CLIP_CONFIG: dict[str, Any] = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "head_width": 16},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_pytorch_model.bin"
# What open_clip reads a model's name with: letters, digits and _.+- only (no ":" of a schema such as local-dir: or
# hf-hub:, no "/" of a path or URL), which is also what register_config writes as a file name.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
HF_HUB = "hf-hub:"

_registry_dir: Path | None = None


def register_config(name: str, model_cfg: dict[str, Any]) -> None:
    """Make ``name`` resolvable by ``open_clip.create_model``/``get_tokenizer`` in this process.

    open_clip's only public registration hook reads JSON files named ``<name>.json``, so the config is written
    to a private temporary directory added to its search path.
    """
    if not PLAIN_NAME.fullmatch(name):
        raise ValueError(f"open_clip config name {name!r} must use only letters, digits and _.+-")
    if not all(k in model_cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ValueError(f"config for {name!r} has keys {sorted(model_cfg)}; expected embed_dim, vision_cfg, text_cfg")
    global _registry_dir
    first = _registry_dir is None
    if first:
        _registry_dir = Path(tempfile.mkdtemp(prefix="dalle_lightning_open_clip_"))
    write_json(_registry_dir / f"{name}.json", model_cfg, sort_keys=False)
    if first:
        open_clip.add_model_config(_registry_dir)
    else:
        open_clip.factory._rescan_model_configs()  # the directory is already on the search path


def _ensure_default_registered() -> None:
    if open_clip.get_model_config(SHAPES_CLIP) is None:
        register_config(SHAPES_CLIP, SHAPES_CLIP_CONFIG)


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` names a model rather than a place open_clip would read it from (``local-dir:``,
    ``hf-hub:``, a path, a URL)."""
    return isinstance(name, str) and bool(PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def check_file_model_name(name: Any, path: str | os.PathLike, key: str, registered: bool = True) -> str:
    """``name`` read from the file ``path`` at ``key``, if it is a plain open_clip model name (with ``registered``,
    one of ``open_clip.list_models()``); otherwise a one-line :class:`~dalle_lightning.safe_files.UnsafeFile`
    naming the file and the key, before open_clip is called with it (it would read another folder or download)."""
    from dalle_lightning.safe_files import UnsafeFile

    shown = repr(name)[:200]
    where = f"{os.fspath(path)!r}: {key}={shown}"
    if not is_plain_name(name):
        raise UnsafeFile(f"{where} names a place to read a model from (a local-dir: or hf-hub: name, a path or a "
                         "URL), not a model, so nothing was opened; expected an open_clip model name such as "
                         f"{SHAPES_CLIP!r} or 'ViT-B-32' (the file's own weights are the model's)")
    if registered:
        _ensure_default_registered()
        if name not in open_clip.list_models():
            raise UnsafeFile(f"{where} is not an open_clip model known here; expected one of "
                             "open_clip.list_models(), e.g. 'ViT-B-32' or " + repr(SHAPES_CLIP))
    return name


def model_config(name: str) -> dict[str, Any]:
    """The architecture config open_clip resolves for ``name`` (a registered name or ``local-dir:<dir>``)."""
    _ensure_default_registered()
    if name.startswith("local-dir:") and not (Path(name[len("local-dir:") :]) / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {name[len('local-dir:'):]!r}; expected a directory written by save()")
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ValueError(f"unknown open_clip model {name!r}; expected one of open_clip.list_models() or 'local-dir:<dir>'")
    return cfg


def create(
    name: str = SHAPES_CLIP,
    pretrained: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build the open_clip model ``name``, loading weights from the local file ``pretrained`` if given.

    ``device="meta"`` builds without allocating memory (useful to inspect paper-size models). Returns a real
    open_clip model (``open_clip.model.CLIP`` or a subclass) with an ``open_clip_spec`` attribute.
    """
    if isinstance(name, str) and name.startswith(HF_HUB):
        raise ValueError(f"open_clip model {name!r} would be downloaded; expected an open_clip model name or "
                         "'local-dir:<dir>' (nothing is ever downloaded)")
    cfg = model_config(name)
    if pretrained is not None and not Path(pretrained).is_file():
        raise FileNotFoundError(
            f"open_clip weights file not found: {str(pretrained)!r}; expected a local file (pretrained tags are never downloaded)"
        )
    pretrained_arg = None if pretrained is None else str(pretrained)
    with contextlib.ExitStack() as stack:
        if pretrained is None:  # weights come from our own checkpoint (or training): not a warning, every load
            stack.enter_context(_without_random_init_warning())
        if str(device) == "meta":
            stack.enter_context(torch.device("meta"))
        model = open_clip.create_model(name, pretrained=pretrained_arg, device=str(device), pretrained_text=False)
    model.open_clip_spec = {"name": name, "model_cfg": cfg, "preprocess_cfg": dict(model.visual.preprocess_cfg)}
    return model


class _RandomInitFilter(logging.Filter):
    """Drops open_clip's "No pretrained weights loaded ... initialized randomly" (logged on the root logger)."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded")


@contextlib.contextmanager
def _without_random_init_warning() -> Iterator[None]:
    root, quiet = logging.getLogger(), _RandomInitFilter()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def spec_of(model: nn.Module) -> dict[str, Any]:
    """The ``open_clip_spec`` of a model built by :func:`create` (name, model_cfg, preprocess_cfg)."""
    spec = getattr(model, "open_clip_spec", None)
    if spec is None:
        raise ValueError(
            f"{type(model).__name__} has no open_clip_spec; expected a model built by dalle_lightning.models.clip.create"
        )
    return spec


def from_spec(spec: dict[str, Any], state_dict: dict[str, torch.Tensor] | None = None,
              path: str | os.PathLike = "open_clip_spec") -> nn.Module:
    """Rebuild a model from its spec (as stored in the checkpoint ``path``), from the spec's own architecture.

    The spec carries the architecture, so its name need not be known here, but it must be a plain name: asked
    for ``local-dir:``/``hf-hub:`` names, open_clip would read another folder or download. Nothing is registered
    with open_clip: a spec whose config is not the one its name has here is built from its config directly, so a
    checkpoint never changes what a name builds later in the process. With ``state_dict``, the model is first built
    on the meta device and its tensors' names and shapes compared with the checkpoint's (one line if they
    differ), before any memory is spent on it."""
    name = check_file_model_name(spec["name"], path, "open_clip_spec.name", registered=False)
    _ensure_default_registered()
    model_cfg, preprocess_cfg = spec["model_cfg"], spec.get("preprocess_cfg")
    known = open_clip.get_model_config(name) == model_cfg
    if not known:
        _check_own_config(model_cfg, path)

    def build(device: str) -> nn.Module:
        if known:
            return create(name, device=device)
        return _create_from_config(model_cfg, preprocess_cfg, device)

    if state_dict is not None:
        from dalle_lightning.model_targets import shape_difference
        from dalle_lightning.safe_files import UnsafeFile

        try:
            planned = {k: tuple(v.shape) for k, v in build("meta").state_dict().items()}
        except Exception as exc:  # noqa: BLE001 - whatever open_clip makes of a config it cannot build
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UnsafeFile(f"{os.fspath(path)!r}: its open_clip_spec builds no model ({type(exc).__name__}: "
                             f"{first}); expected a checkpoint dalle-train stage=clip wrote") from None
        problem = shape_difference(planned, {k: tuple(v.shape) for k, v in state_dict.items()})
        if problem is not None:
            raise UnsafeFile(f"{os.fspath(path)!r}: its tensors are not those of the model its open_clip_spec "
                             f"builds ({problem}), so no model was built; expected a checkpoint dalle-train "
                             "stage=clip wrote")
    model = build("cpu")
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.open_clip_spec = {**spec, "name": name}
    return model


OWN_CONFIG_KEYS = ("embed_dim", "vision_cfg", "text_cfg")
# What would make open_clip read or download something else: a timm or Hugging Face tower, an HF tokenizer.
ELSEWHERE = (("vision_cfg", "timm_model_name"), ("text_cfg", "hf_model_name"), ("text_cfg", "hf_tokenizer_name"),
             ("text_cfg", "tokenizer_kwargs"))


def _check_own_config(model_cfg: Any, path: str | os.PathLike) -> None:
    """A spec's own architecture (not the one its name has here) builds open_clip's own towers only."""
    from dalle_lightning.safe_files import UnsafeFile

    if not isinstance(model_cfg, dict) or not all(isinstance(model_cfg.get(k), dict) or k == "embed_dim"
                                                  for k in OWN_CONFIG_KEYS) or "embed_dim" not in model_cfg:
        raise UnsafeFile(f"{os.fspath(path)!r}: open_clip_spec.model_cfg is not an open_clip config; expected "
                         f"the keys {list(OWN_CONFIG_KEYS)} (a checkpoint dalle-train stage=clip wrote)")
    for tower, key in ELSEWHERE:
        if key in model_cfg[tower]:
            raise UnsafeFile(f"{os.fspath(path)!r}: open_clip_spec.model_cfg.{tower}.{key} asks open_clip for a "
                             "tower or tokenizer from elsewhere, so nothing was built; expected a config of "
                             "open_clip's own towers, or a model name known here")


def _create_from_config(model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any] | None,
                        device: str) -> nn.Module:
    """An open_clip model from the config itself (what ``open_clip.create_model`` builds for a registered name,
    in fp32, without weights), never registered under a name."""
    cfg = deepcopy(model_cfg)
    custom_text = cfg.pop("custom_text", False)
    model_class = (open_clip.CoCa if "multimodal_cfg" in cfg else open_clip.CustomTextCLIP) if custom_text \
        else open_clip.CLIP
    with torch.device(device):
        model = model_class(**cfg, cast_dtype=None)
    if preprocess_cfg is not None:
        open_clip.set_model_preprocess_cfg(model, dict(preprocess_cfg))
    return model


def tokenizer_for(model: nn.Module) -> Any:
    """The open_clip tokenizer of ``model`` (its BPE vocabulary ships with open_clip, so no download); for a
    model built from a spec whose config is not its name's here, open_clip's own BPE tokenizer."""
    spec = spec_of(model)
    context_length = spec["model_cfg"]["text_cfg"].get("context_length")
    if open_clip.get_model_config(spec["name"]) != spec["model_cfg"]:
        return open_clip.SimpleTokenizer(context_length=context_length or open_clip.tokenizer.DEFAULT_CONTEXT_LENGTH)
    return open_clip.get_tokenizer(spec["name"], context_length=context_length)


def image_mean_std(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel normalisation the model was (or will be) trained with."""
    cfg = spec_of(model)["preprocess_cfg"]
    return tuple(cfg["mean"]), tuple(cfg["std"])


def save(model: nn.Module, directory: str | Path) -> Path:
    """Write ``open_clip_config.json`` and the weights so ``create("local-dir:<directory>")`` rebuilds the model."""
    spec = spec_of(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": deepcopy(spec["model_cfg"]), "preprocess_cfg": spec["preprocess_cfg"]}
    # Weights first, config last: a directory with a config holds the weights that belong to it.
    torch_save(model.state_dict(), directory / WEIGHTS_FILE)
    write_json(directory / CONFIG_FILE, config, sort_keys=False)
    return directory


def image_size(model: nn.Module) -> tuple[int, int]:
    """The (height, width) the vision tower expects."""
    size = model.visual.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def check_images(images: torch.Tensor, name: str = "images", check_range: bool = True) -> None:
    """Fail early on batches that are not ``FloatTensor[B, 3, H, W]`` in [0, 1] (e.g. uint8 or [-1, 1]). The range
    is one host read (both bounds together); ``check_range=False`` skips it."""
    if not torch.is_tensor(images) or images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"{name} has shape/type {shape}; expected a float tensor [B, 3, H, W] with values in [0, 1]")
    if not check_range or images.numel() == 0:
        return
    lo, hi = torch.stack(images.aminmax()).tolist()
    if lo < 0.0 or hi > 1.0:
        raise ValueError(f"{name} range [{lo:.3g}, {hi:.3g}]; expected values in [0, 1]")


def normalize_images(
    images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    """[0, 1] images -> model input: resized to ``size`` when they differ, then standardised.

    Shrinking averages areas (an integer-factor upsample followed by this gives back the original exactly);
    enlarging is bicubic, as open_clip's own preprocessing does.
    """
    if tuple(images.shape[-2:]) != tuple(size):
        shrink = images.shape[-2] >= size[0] and images.shape[-1] >= size[1]
        mode = "area" if shrink else "bicubic"
        images = torch.nn.functional.interpolate(images, size=size, mode=mode).clamp(0, 1)
    return (images - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
