"""What every command-line app shares: config validation, one-line errors, instantiation helpers."""

from __future__ import annotations

import functools
from pathlib import Path
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.artifacts import register_resolvers

log = logging.getLogger("dalle_lightning")

register_resolvers()


def check_keys(cfg: DictConfig, allowed: Iterable[str], where: str = "config") -> None:
    """A mistyped top-level key (e.g. from an experiment file) is an error, not silently ignored."""
    unknown = sorted(set(cfg.keys()) - set(allowed) - {"hydra"})
    if unknown:
        raise KeyError(f"unknown {where} key(s) {unknown}; expected one of {sorted(allowed)}")


def one_line_errors(main: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Bad input ends the app with one line naming the value, not a traceback (set DALLE_DEBUG=1 for it)."""

    @functools.wraps(main)
    def wrapper(cfg: DictConfig) -> Any:
        import os

        try:
            return main(cfg)
        except (FileNotFoundError, ValueError, KeyError, FloatingPointError, InstantiationException) as exc:
            if os.environ.get("DALLE_DEBUG"):
                raise
            if isinstance(exc, InstantiationException) and exc.__cause__ is not None:
                exc = exc.__cause__  # Hydra wraps the constructor's own error; show that one
            text = str(exc).strip().strip("'\"")
            msg = text.splitlines()[0] if text else type(exc).__name__
            print(f"error: {msg}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def instantiate_dict(nodes: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` node of a dict-of-nodes config (callbacks), in key order."""
    if not nodes:
        return []
    return [instantiate(node) for _, node in nodes.items() if node is not None and "_target_" in node]


def strategy_and_precision(cfg: DictConfig) -> dict[str, Any]:
    """Trainer kwargs for the strategy and precision groups: a registered name, or a plugin object."""
    kwargs: dict[str, Any] = {}
    strat = cfg.strategy
    kwargs["strategy"] = instantiate(strat) if "_target_" in strat else strat.name
    prec = cfg.precision
    if "_target_" in prec:
        kwargs["plugins"] = [instantiate(prec)]
    else:
        kwargs["precision"] = prec.name
    return kwargs


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


# The Hydra config tree at the repository root (the package is installed in editable mode by `make`).
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
