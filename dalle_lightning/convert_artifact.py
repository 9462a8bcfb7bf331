"""``python -m dalle_lightning.convert_artifact OLD NEW``: rewrite a model file you trust as data, once.

Model files are read as data (:mod:`dalle_lightning.safe_files`): every file this project wrote holds only tensors
and plain values and loads as it is. A model file that holds more (a config saved as an OmegaConf ``DictConfig``,
``pathlib`` paths or numpy numbers in its metadata, as a hand-made or another tool's file may) is refused in one
line naming what it asked for. If it is your own and you trust it, this command opens it the old way, once
(``torch.load(weights_only=False)``, which runs whatever the file holds: never on a file from someone else), turns
its config and metadata into plain JSON values, checks its ``_target_`` against the project's models, and writes
NEW in the current format (safetensors, :mod:`dalle_lightning.model_file_format`), which the commands then read as
data. An OLD that is already data (any file the commands open) is read as data instead, never unpickled: this
rewrites a ``torch.save`` model file as safetensors. OLD is left as it was; its values go through the same checks
as every model file's (no ``${`` in any string, typed metadata), so NEW holds nothing the commands would refuse.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path, PurePath
from typing import Any

import torch
from omegaconf import OmegaConf

from dalle_lightning import model_file_format
from dalle_lightning.artifacts import read_file, save_model
from dalle_lightning.model_targets import checked_config


def plain(value: Any) -> Any:
    """``value`` as plain JSON values: OmegaConf containers resolved, paths as strings, numpy numbers as Python's,
    tuples as lists; anything else unchanged (and then refused by the writer's check, naming it)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "item") and not torch.is_tensor(value) and getattr(value, "shape", None) == ():
        return value.item()  # a numpy scalar
    return value


def convert(old: str | os.PathLike, new: str | os.PathLike) -> Path:
    """Write ``new``, the data-only form of the trusted model file ``old`` (see the module docstring)."""
    if Path(old).resolve() == Path(new).resolve():
        raise ValueError(f"NEW={os.fspath(new)!r} is OLD; expected another path (OLD is kept as it was)")
    if not Path(old).is_file():
        raise FileNotFoundError(f"OLD={os.fspath(old)!r} does not exist; expected a model file")
    if model_file_format.is_safetensors(old):
        blob = read_file(old)  # already data: nothing to unpickle
    else:
        blob = torch.load(old, map_location="cpu", weights_only=False)  # trusted by the user who runs this, once
    if not isinstance(blob, dict) or "config" not in blob or "state_dict" not in blob:
        raise ValueError(f"{os.fspath(old)!r} is not a dalle-lightning model file; expected keys config, state_dict")
    config = plain(blob["config"])
    checked_config(config, old)
    state = {str(k): v for k, v in dict(blob["state_dict"]).items()}
    model = torch.nn.Module()  # save_model reads the weights from ``state_dict``; the model is not built here
    path = save_model(new, config, model, meta=plain(dict(blob.get("meta") or {})), state_dict=state)
    read_file(path)  # what was written reads as data
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dalle_lightning.convert_artifact", description=__doc__.splitlines()[0])
    parser.add_argument("old", help="a model file you trust (it is opened with weights_only=False)")
    parser.add_argument("new", help="where to write its data-only form")
    args = parser.parse_args(argv)
    try:
        path = convert(args.old, args.new)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{path} written: {args.old} as safetensors with typed values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
