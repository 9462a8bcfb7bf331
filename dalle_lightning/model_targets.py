"""The only things a model file may ask to have built: the project's own model classes.

A model file carries the config that rebuilds its model (``{"_target_": "dalle_lightning.models.dvae.DiscreteVAE",
"image_size": 64, ...}``). Handed to Hydra's ``instantiate``, such a config runs whatever importable callable its
``_target_`` names (``builtins.open``, ``os.system``), with arguments the file chose, and resolves ``${oc.env:...}``
interpolations in its values: a file that loads under ``weights_only=True`` could still run code. So a model file's
config is built here instead: its ``_target_`` must be one of :data:`MODEL_TARGETS`, every other key a plain
keyword argument (no nested ``_target_``, no Hydra ``_args_``/``_partial_``/... keys), every value a plain JSON value;
the class is then imported from this fixed list and called directly. Each value must have the type the class's
own signature annotates (``image_size: int`` takes an int, not ``"64"`` nor ``True``), no string may hold ``${``,
and every required argument must be there. Anything else is a one-line error naming the file, the key and the
target, before anything is built (only the allow-listed module is imported, to read its signature).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from pathlib import PurePath
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from dalle_lightning.artifact_schema import refuse_interpolations, shown
from dalle_lightning import stored_values
from dalle_lightning.safe_files import UnsafeFile, check_plain

# _target_ -> (module, attribute): every model class a stage saves (conf/model/*.yaml).
MODEL_TARGETS: dict[str, tuple[str, str]] = {
    "dalle_lightning.models.dvae.DiscreteVAE": ("dalle_lightning.models.dvae", "DiscreteVAE"),
    "dalle_lightning.models.dvae_vq.VQVAE": ("dalle_lightning.models.dvae_vq", "VQVAE"),
    "dalle_lightning.models.dvae_fsq.FSQVAE": ("dalle_lightning.models.dvae_fsq", "FSQVAE"),
    "dalle_lightning.models.prior.DallePrior": ("dalle_lightning.models.prior", "DallePrior"),
    "dalle_lightning.models.clip.create": ("dalle_lightning.models.clip", "create"),
}
CLIP_TARGET = "dalle_lightning.models.clip.create"


def checked_config(config: Any, path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """``(target, kwargs)`` of a model file's building config, or a one-line :class:`UnsafeFile` naming ``path``."""
    where = os.fspath(path)
    if not isinstance(config, Mapping):
        raise UnsafeFile(f"{where!r}: its config is a {type(config).__name__}; expected a dict with _target_ "
                         "(a file written by dalle-train)")
    refuse_interpolations(config, path, "config")  # first: a stored expression is named as such
    target = config.get("_target_")
    if not isinstance(target, str) or target not in MODEL_TARGETS:
        raise UnsafeFile(f"{where!r} asks to build {stored_values.shown(target, 200)}, which is not one of the "
                         f"project's models, so nothing was built; expected _target_ one of {sorted(MODEL_TARGETS)}")
    kwargs = {k: v for k, v in config.items() if k != "_target_"}
    for key, value in kwargs.items():
        if not isinstance(key, str) or key.startswith("_"):
            raise UnsafeFile(f"{where!r}: config key {key!r} for {target}; expected plain keyword arguments (no "
                             "Hydra _args_, _partial_, ... keys)")
        check_plain(value, path, f"config.{key}")
        if any(isinstance(v.value, str) and "_target_" in v.value for v in stored_values.walk(value, key, repr(where))):
            raise UnsafeFile(f"{where!r}: config.{key} holds a nested _target_; expected plain keyword arguments "
                             f"of {target}")
    check_types(target, kwargs, where)
    if target == CLIP_TARGET:
        if "name" in kwargs:  # a model's name, not a folder (local-dir:) or a download (hf-hub:)
            from dalle_lightning.models.clip import check_file_model_name

            check_file_model_name(kwargs["name"], path, "config.name")
        # The file's own weights replace any pretrained ones: never open another file the config names.
        kwargs["pretrained"] = None
    return target, kwargs


@cache
def signature(target: str) -> dict[str, inspect.Parameter]:
    """The keyword arguments of an allow-listed target, their annotations evaluated (the module is the project's)."""
    module, attribute = MODEL_TARGETS[target]
    function = getattr(importlib.import_module(module), attribute)
    return dict(inspect.signature(function, eval_str=True).parameters)


def conforms(value: Any, annotation: Any) -> bool:
    """Whether the plain value ``value`` is of ``annotation`` (ints are not bools; a path or device is a str)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, option) for option in typing.get_args(annotation))
    if annotation in (bool, int, str):
        return type(value) is annotation
    if annotation is float:
        return type(value) in (int, float)
    if origin in (Sequence, list, tuple) or annotation in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if not isinstance(value, (list, tuple)):  # JSON's lists (a caller's tuple is written as one)
            return False
        return all(conforms(v, args[0]) for v in value) if args else True
    if annotation is torch.device or (isinstance(annotation, type) and issubclass(annotation, PurePath)):
        return isinstance(value, str)
    return False


def check_types(target: str, kwargs: Mapping[str, Any], where: str) -> None:
    """Each keyword argument of ``target`` is one its signature names, of the type it annotates; every required
    one is given. One :class:`UnsafeFile` line naming the file and the key otherwise."""
    parameters = signature(target)
    for key, value in kwargs.items():
        parameter = parameters.get(key)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise UnsafeFile(f"{where!r}: config.{key} is not an argument of {target}; expected some of "
                             f"{sorted(parameters)}")
        annotation = parameter.annotation
        if annotation is not parameter.empty and not conforms(value, annotation):
            name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
            raise UnsafeFile(f"{where!r}: config.{key}={shown(value)} is a {type(value).__name__}; expected {name} "
                             f"(the type {target} takes)")
    missing = [k for k, p in parameters.items() if p.default is p.empty and k not in kwargs
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise UnsafeFile(f"{where!r}: the config lacks {missing}, required by {target}; expected a file written by "
                         "dalle-train")


def build_model(config: Any, path: str | os.PathLike,
                shapes: Mapping[str, Sequence[int]] | None = None) -> nn.Module:
    """The model a model file's config describes, built from the allow-list (see the module docstring); with
    ``shapes`` (the file's tensors), only after :func:`planned_model` found that its tensors are the file's."""
    target, kwargs = checked_config(config, path)
    if shapes is not None:
        planned_model(config, path, shapes)
    module, attribute = MODEL_TARGETS[target]
    return getattr(importlib.import_module(module), attribute)(**kwargs)


# Parameters and modules a model's constructor may register per tensor of its file, and beside them: a config
# that asks for more (a million layers) is refused while it is built on the meta device, before it costs more
# than the file's own size in Python objects.
BUILD_SLACK = 4
BUILD_BASE = 1000


@contextlib.contextmanager
def bounded_registrations(limit: int, where: str, target: str) -> Iterator[None]:
    """Refuse (one :class:`UnsafeFile` line) once a constructor run inside registers more than ``limit``
    parameters or modules: torch's global registration hooks, removed again on the way out."""
    counts = {"parameters": 0, "modules": 0}

    def counted(kind: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            counts[kind] += 1
            if counts[kind] > limit:
                raise UnsafeFile(f"{where!r}: its config builds a {target} of more than {limit} {kind}, more "
                                 "than its tensors could fill, so no model was built; expected a file written by "
                                 "dalle-train")
        return hook

    handles = [register_module_parameter_registration_hook(counted("parameters")),
               register_module_module_registration_hook(counted("modules"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def planned_model(config: Any, path: str | os.PathLike, shapes: Mapping[str, Sequence[int]]) -> nn.Module:
    """The model ``config`` describes, built on the meta device (no memory, no initialisation), once its tensors'
    names and shapes are found equal to ``shapes`` (the file's): a config whose sizes its tensors do not back
    (``d_head=20000`` and no tensors: 7.3 GB built and initialised before ``load_state_dict`` noticed) is one
    :class:`UnsafeFile` line naming the first difference, before any real model is built."""
    target, kwargs = checked_config(config, path)
    where = os.fspath(path)
    module, attribute = MODEL_TARGETS[target]
    build = getattr(importlib.import_module(module), attribute)
    if target == CLIP_TARGET:
        kwargs["device"] = "meta"
    try:
        with bounded_registrations(BUILD_SLACK * len(shapes) + BUILD_BASE, where, target), torch.device("meta"):
            model = build(**kwargs)
        planned = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    except UnsafeFile:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the constructor makes of sizes it cannot build
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UnsafeFile(f"{where!r}: its config builds no {target} ({type(exc).__name__}: {first}); expected a "
                         "file written by dalle-train") from None
    problem = shape_difference(planned, {name: tuple(shape) for name, shape in shapes.items()})
    if problem is not None:
        raise UnsafeFile(f"{where!r}: its tensors are not those of the {target} its config builds ({problem}), so "
                         "no model was built; expected a file written by dalle-train")
    return model


def shape_difference(planned: Mapping[str, tuple[int, ...]], stored: Mapping[str, tuple[int, ...]]) -> str | None:
    """How the tensors ``stored`` (name: shape) differ from those a model ``planned``, in a few words; None if
    they are the same names and shapes (what ``load_state_dict`` would check, before anything is allocated)."""
    missing = [name for name in planned if name not in stored]
    unexpected = [name for name in stored if name not in planned]
    resized = [name for name in planned if name in stored and planned[name] != stored[name]]
    parts = []
    if resized:
        name = resized[0]
        parts.append(f"{len(resized)} of another shape, first {name!r}: {list(stored[name])} where the model has "
                     f"{list(planned[name])}")
    if missing:
        parts.append(f"{len(missing)} missing, first {missing[0]!r} of shape {list(planned[missing[0]])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected, first {stored_values.shown(unexpected[0], 80)}")
    return "; ".join(parts) or None
