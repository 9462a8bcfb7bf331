"""YAML and records from a file, read as plain values: a stored interpolation stays text, never an expression.

Hydra leaves YAML in every run directory (``.hydra/config.yaml``, ``overrides.yaml``, a sweep's ``multirun.yaml``),
and a run directory may come from anyone. Loading one with ``OmegaConf.load`` and reading a value resolves what the
value says: ``${oc.env:SECRET_TOKEN}`` reads the environment, ``${meta:...}`` opens a file, ``${oc.create:...}``
builds a config that ``instantiate`` would call. So such files are read here with ``yaml.safe_load`` (plain
strings, numbers, lists and dicts; a ``!!python`` tag is refused) and never handed to OmegaConf. A caller then keeps
a ``${...}`` text literally (a summary shows the override as it was typed) or refuses it with :func:`refuse_stored`,
whose one line names the file and the key but never the text, let alone what it would resolve to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import yaml

from dalle_lightning.stored_values import walk

INTERPOLATION = "${"
# Hydra's YAML in a run directory is a few kilobytes (a whole composed config in multirun.yaml); a file beyond this
# is none of them, and is refused before it is read.
MAX_YAML_BYTES = 16 * 2**20


class _PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors and aliases: Hydra never writes them (OmegaConf dumps fresh containers),
    and a few hundred bytes of nested aliases expand into millions of values (a self-referencing one recurses)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, "an anchor or alias (&name, *name)", event.start_mark)
        return super().compose_node(parent, index)


class StoredInterpolation(ValueError):
    """A value read from a file holds an interpolation (``${...}``) where a plain value was expected."""


def read_yaml(path: str | os.PathLike) -> Any:
    """The YAML document at ``path`` as plain Python values (``yaml.safe_load``; None for an empty file).

    A file that is not YAML, asks for a Python object (``!!python/...``), holds an anchor or alias, nests too deep
    for the parser, is not a regular file or is over :data:`MAX_YAML_BYTES` is a one-line ``ValueError`` naming
    it."""
    if not os.path.isfile(path):
        raise ValueError(f"{os.fspath(path)!r} is not a regular file; expected the YAML file Hydra wrote there")
    size = os.path.getsize(path)
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{os.fspath(path)!r} holds {size} bytes, so it was not read; expected the YAML file Hydra "
                         f"wrote there (at most {MAX_YAML_BYTES // 2**20} MiB)")
    try:
        with open(path, encoding="utf-8") as stream:
            return yaml.load(stream, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader, without aliases
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", None) or type(exc).__name__)
        raise ValueError(f"{os.fspath(path)!r} is not plain YAML ({problem}); expected the YAML file Hydra wrote "
                         "there") from None
    except UnicodeDecodeError:
        raise ValueError(f"{os.fspath(path)!r} is not UTF-8 text; expected the YAML file Hydra wrote there") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ValueError(f"{os.fspath(path)!r} nests its values too deep to read; expected the YAML file Hydra "
                         "wrote there") from None


def interpolations(value: Any, where: str = "", named: str = "a stored value") -> Iterator[str]:
    """The keys (``a.b[2]``) of every string in ``value`` (and of every dict key) that holds ``${``; walked by
    :func:`~dalle_lightning.stored_values.walk` (each shared container once; ``named``, the file, in its refusal
    of a value too deep or too large)."""
    for visit in walk(value, where, named):
        item = visit.value
        if isinstance(item, str) and INTERPOLATION in item:
            if not visit.is_key:
                yield str(visit.place) or "(the document)"
            else:
                yield f"{visit.place}.<key>" if str(visit.place) else "<key>"


def refuse_stored(value: Any, path: str | os.PathLike, where: str = "", fix: str = "a file this project wrote",
                  what: str = "") -> None:
    """Raise a one-line :class:`StoredInterpolation` naming ``path`` (after ``what``, e.g. ``resume: checkpoint``)
    and the first key of ``value`` whose string holds ``${``; nothing of the string itself is printed (its text
    may name a secret's variable), let alone what it would resolve to."""
    named = f"{what} {os.fspath(path)!r}" if what else repr(os.fspath(path))
    found = next(interpolations(value, where, named), None)
    if found is not None:
        raise StoredInterpolation(f"{named}: {found} holds an interpolation (${{...}}), which is never resolved "
                                  f"from a file, so the file was not used; expected plain values: {fix}")


def escaped(text: str) -> str:
    """``text`` as an OmegaConf string value that reads back as exactly ``text`` (``${`` escaped, never resolved)."""
    # a backslash before "${" escapes it, and backslashes right before one escape each other: double them first
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
