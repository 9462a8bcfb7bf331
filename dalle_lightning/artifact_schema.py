"""The values a model file may hold: typed, checked per key, and never an expression.

A model file's ``meta`` reaches OmegaConf: ``conf/model/prior_*.yaml`` reads ``${meta:${paths.dvae},vocab_size}``,
and OmegaConf resolves a string that a custom resolver returns once more, so a stored
``"${oc.create:{_target_: torch.load, ...}}"`` or ``"${oc.env:SECRET}"`` would be built or read there. So every
string anywhere in a file's ``config`` and ``meta`` that holds ``${`` is refused (:func:`refuse_interpolations`),
and each metadata key later stages read has one type (:data:`META_SCHEMA`: ``vocab_size`` is a positive int, never
a string that would be parsed); the building config's types come from the model class's own signature
(:mod:`dalle_lightning.model_targets`). A refusal is one :class:`~dalle_lightning.safe_files.UnsafeFile` line
naming the file and the key; the stored string is shown cut short and unresolved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from dalle_lightning import stored_values
from dalle_lightning.safe_files import UnsafeFile, check_plain
from dalle_lightning.stored_values import walk

INTERPOLATION = "${"  # how OmegaConf starts an interpolation or a resolver call
SHOWN = 40  # characters of a refused string the error line shows


@dataclass(frozen=True)
class Kind:
    """A metadata value's type: ``expected`` is what the error line says, ``accepts`` decides."""

    expected: str
    accepts: Callable[[Any], bool]


COUNT = Kind("an int >= 0", lambda v: type(v) is int and v >= 0)
DIGEST = Kind("a SHA-256 digest (64 lowercase hex digits)",
              lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None)
STAGES = ("dvae", "prior", "clip")
STAGE = Kind(f"one of {list(STAGES)}", lambda v: isinstance(v, str) and v in STAGES)

# The sizes later stages read through ``${meta:PATH,KEY}`` (and cli/sizes.py compares): ints, and only these.
SIZE_KEYS = ("vocab_size", "grid_size", "image_size", "text_len", "image_grid", "text_vocab_size", "image_vocab_size")
# The most each size may be: typed is not enough, a later stage builds what ${meta:...} hands it (vocab_size: 10**12,
# an embedding of 10**12 rows). Sizes a model's tensors fix are checked against them too (artifacts.check_sizes);
# these bounds hold for those they do not (a dVAE's image_size, an FSQ's product of levels). Far above the paper's
# (text vocab 16,384, image vocab 8,192, 256 text tokens, a 32x32 grid of 256 px) and a 64k-token BPE.
SIZE_BOUNDS = {"vocab_size": 2**20, "text_vocab_size": 2**20, "image_vocab_size": 2**20, "text_len": 2**16,
               "image_size": 8192, "grid_size": 1024, "image_grid": 1024}


def bounded_size(key: str) -> Kind:
    bound = SIZE_BOUNDS[key]
    return Kind(f"a positive int of at most {bound}", lambda v: type(v) is int and 0 < v <= bound)


Schema = Union[Kind, Mapping[str, "Schema"]]
# What dalle-train writes (cli/train.py model_meta, lineage.py records). Other keys are kept as plain values but
# never served to a config.
META_SCHEMA: dict[str, Schema] = {
    "stage": STAGE,
    "parameters": COUNT,
    "sha256": DIGEST,
    **{key: bounded_size(key) for key in SIZE_KEYS},
    "trained_with": {
        "dvae": {"sha256": DIGEST, "vocab_size": bounded_size("vocab_size"), "grid_size": bounded_size("grid_size")},
        "tokenizer": {"sha256": DIGEST, "vocab_size": bounded_size("vocab_size")},
    },
}


def shown(value: Any) -> str:
    """``repr(value)`` cut to :data:`SHOWN` characters: a stored value in an error line, unresolved, one line
    (only as much of a container is walked as is shown)."""
    return stored_values.shown(value, SHOWN)


def refuse_interpolations(value: Any, path: str | os.PathLike, where: str) -> None:
    """A one-line :class:`UnsafeFile` naming ``path`` and the key if any string in ``value`` (a key too) holds
    ``${``: a stored expression is never resolved, whatever reads the value later."""
    for visit in walk(value, where, repr(os.fspath(path))):
        item = visit.value
        if isinstance(item, str) and INTERPOLATION in item:
            place = f"{visit.place} key" if visit.is_key else str(visit.place)
            raise UnsafeFile(f"{os.fspath(path)!r}: {place} is a string holding '${{' ({shown(item)}), an OmegaConf "
                             "interpolation that could read the environment or build objects, so it was not read; "
                             "expected plain values (a file written by dalle-train)")


def check_values(value: Any, schema: Schema, path: str | os.PathLike, where: str) -> None:
    """``value`` against ``schema`` (a :class:`Kind`, or a dict of them per key); keys the schema does not name are
    kept (the caller checks the whole value is plain first: :func:`checked_meta`). A mismatch is one
    :class:`UnsafeFile` line naming ``path`` and the key."""
    if isinstance(schema, Kind):
        if not schema.accepts(value):
            raise UnsafeFile(f"{os.fspath(path)!r}: {where}={shown(value)} is a {type(value).__name__}; expected "
                             f"{schema.expected} (a file written by dalle-train)")
        return
    if not isinstance(value, Mapping):
        raise UnsafeFile(f"{os.fspath(path)!r}: {where} is a {type(value).__name__}; expected a dict of "
                         f"{sorted(schema)}")
    for key, item in value.items():
        if key in schema:
            check_values(item, schema[key], path, f"{where}.{key}")


def checked_meta(meta: Any, path: str | os.PathLike) -> dict[str, Any]:
    """A model file's ``meta``: no stored expression, plain values, each known key of its type (see the module
    docstring)."""
    refuse_interpolations(meta, path, "meta")
    check_plain(meta, path, "meta")  # before the schema: check_values leaves the keys it does not name to this
    check_values(meta, META_SCHEMA, path, "meta")
    return dict(meta)


def size_value(meta: Mapping[str, Any], key: str, path: str | os.PathLike) -> int:
    """``meta[key]`` for a size a config reads (:data:`SIZE_KEYS`), as an int: what the ``meta`` resolver returns,
    so OmegaConf has no string to parse. A ``KeyError`` line for a key that is not a size or not recorded."""
    if key not in SIZE_KEYS:
        raise KeyError(f"the meta resolver reads the sizes {list(SIZE_KEYS)} of a model file, not {key!r}")
    if key not in meta:
        raise KeyError(f"{os.fspath(path)!r} has no metadata {key!r}; it has {sorted(meta)}")
    value = meta[key]
    check_values(value, bounded_size(key), path, f"meta.{key}")  # checked at the read too: never a str here
    return int(value)
