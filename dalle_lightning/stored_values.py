"""Walking values read from a file: each container once, at a bounded depth and a bounded expanded size.

A pickle's memo lets one container appear at many places: ``x = [x, x]`` forty times is 201 KB under
``torch.load(weights_only=True)`` (which keeps the sharing) but 2^40 paths, and a recursive walk visits every path.
A pickle can also nest a container in itself, or 100,000 levels deep, where a recursive walk raises
``RecursionError``. So every check of a stored value (a model file's ``config`` and ``meta``, a checkpoint's
``hyper_parameters``, a run directory's YAML, a ClipModule checkpoint's ``open_clip_spec``) walks it with
:func:`walk`: iteratively, each container and each string once (by identity: a shared one costs its size, not its
paths), in the order a recursive walk takes, so a tree (every JSON or YAML document, every value ``dalle-train``
writes) gets exactly the checks and the first offending key it got before. A value that nests deeper than
:data:`MAX_DEPTH`, holds itself, or would expand to more than :data:`MAX_VALUES` values as a tree (what
``json.dumps``, ``repr`` or ``OmegaConf`` would walk later) is refused in one :class:`StoredValueTooLarge` line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# A model file's config and meta nest 3 levels, a checkpoint's hyper-parameters and Hydra's YAML a handful; the
# bound leaves room and keeps every later recursive reader (json, copy, OmegaConf: several frames per level) far
# from Python's recursion limit of 1000.
MAX_DEPTH = 32
# Values the largest honest one holds, expanded as a tree: a few hundred (a composed Hydra config in multirun.yaml,
# a model file's config and meta); a million is a list of a million numbers, and a walk of that many is about a
# second of Python.
MAX_VALUES = 2**20


class StoredValueTooLarge(ValueError):
    """A stored value nests too deep, holds itself or expands to too many values; one line naming the file."""


@dataclass(frozen=True, slots=True)
class Place:
    """Where a value sits (``meta.trained_with.dvae``, ``config.layers[2]``), kept as links, spelled on demand."""

    parent: Place | None
    part: str  # the root's name, ".key" or "[i]"

    def __str__(self) -> str:
        parts, place = [], self
        while place is not None:
            parts.append(place.part)
            place = place.parent
        root, text = parts[-1], "".join(reversed(parts[:-1]))
        return root + text if root else text.removeprefix(".")


@dataclass(frozen=True, slots=True)
class Visit:
    """One value met by :func:`walk`: ``value`` at ``place``; ``is_key``: a dict's key (``place`` is the dict's)."""

    value: Any
    place: Place
    is_key: bool = False


def _children(value: Any, place: Place) -> Iterator[Visit]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield Visit(key, place, is_key=True)
            yield Visit(item, Place(place, f".{key}"))
    else:
        for i, item in enumerate(value):
            yield Visit(item, Place(place, f"[{i}]"))


def is_container(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple))


def walk(value: Any, root: str, named: str) -> Iterator[Visit]:
    """Every value in ``value`` (dicts' keys too), depth first in insertion order, as a recursive walk meets them,
    but each container and string once. ``root`` names ``value`` (``"meta"``, or ``""`` for a document), ``named``
    the file in a refusal (``"'/w/dvae.pt'"``). A dict's key is met, never descended into."""
    seen: set[int] = set()
    sizes: dict[int, int] = {}  # a finished container: the values it expands to, itself included
    stack: list[tuple[Iterator[Visit], int, int]] = []  # (its children, its id, the count when it was entered)
    expanded = 0
    visits: Iterator[Visit] = iter((Visit(value, Place(None, root)),))
    while True:
        visit = next(visits, None)
        if visit is None:
            if not stack:
                return
            _, ident, start = stack.pop()
            sizes[ident] = expanded - start + 1
            visits = stack[-1][0] if stack else iter(())
            continue
        item = visit.value
        if not is_container(item) or visit.is_key:
            expanded += 1
            if isinstance(item, str):
                if id(item) in seen:
                    continue  # the same string again: it was checked (and passed) where it was first met
                seen.add(id(item))
            yield visit
            continue
        ident = id(item)
        if ident in seen:
            if ident not in sizes:
                raise StoredValueTooLarge(f"{named}: {visit.place} holds itself (a container inside itself), so "
                                          "it was not used; expected plain values (a file this project wrote)")
            expanded += sizes[ident]
        else:
            seen.add(ident)
            expanded += 1
            if len(stack) >= MAX_DEPTH:
                raise StoredValueTooLarge(f"{named}: {visit.place} nests more than {MAX_DEPTH} levels deep, so it "
                                          "was not used; expected plain values (a file this project wrote)")
            yield visit
            stack.append((_children(item, visit.place), ident, expanded))
            visits = stack[-1][0]
        if expanded > MAX_VALUES:
            raise StoredValueTooLarge(f"{named}: {visit.place} expands to more than {MAX_VALUES} values (one "
                                      "container stored at many places), so it was not used; expected plain values "
                                      "(a file this project wrote)")


def shown(value: Any, limit: int) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` after a cut): the same text as ``repr`` for any value,
    without walking more of a shared or deep container than the characters shown."""
    pieces: list[str] = []
    length = 0
    for piece in _repr_pieces(value):
        pieces.append(piece)
        length += len(piece)
        if length > limit:
            break
    text = "".join(pieces)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _repr_pieces(value: Any) -> Iterator[str]:
    kind = type(value)
    if kind not in (dict, list, tuple):  # a scalar; another container type is named, not walked
        yield f"{kind.__name__}(...)" if is_container(value) else repr(value)
        return
    opening, closing = {dict: "{}", list: "[]", tuple: "()"}[kind]
    yield opening
    for i, item in enumerate(value.items() if kind is dict else value):
        if i:
            yield ", "
        if kind is dict:
            yield from _repr_pieces(item[0])
            yield ": "
            yield from _repr_pieces(item[1])
        else:
            yield from _repr_pieces(item)
    if kind is tuple and len(value) == 1:
        yield ","
    yield closing
