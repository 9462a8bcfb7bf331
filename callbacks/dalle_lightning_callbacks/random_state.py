"""Every rank's random number generators in checkpoints, so a resumed run draws what the uninterrupted run draws.

A resumed run rebuilds its model from the seed and then loads the checkpoint, but the draws that shape training
come from global generators the checkpoint does not hold: the dVAE's Gumbel noise and the prior's caption dropout
(torch's), numpy's and Python's, on every rank separately. This callback saves them per rank (a rank's draws differ
from another's, and a sharded checkpoint's metadata is written by rank 0 alone, so the states are gathered there)
and puts each rank's own states back when training starts. A LightningModule with generators of its own (CLIP's
hard-negative captions) lists them in ``random_generators() -> dict[str, generator]``; they travel the same way.

Validation draws too (the dVAE's Gumbel noise), and a resumed run does not repeat a validation that ran right after
its checkpoint, so validation during fit runs on a copy of the states: it never moves the training draws.

Checkpoints are taken after an update, so the states saved are those the next update starts from.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from typing_extensions import override

STATE_KEY = "random_states"  # checkpoint key: one entry per rank, in rank order


def _generators(pl_module: pl.LightningModule) -> Mapping[str, Any]:
    """The module's own generators (``random.Random``, ``torch.Generator``, ``np.random.Generator``), by name."""
    own = getattr(pl_module, "random_generators", None)
    return own() if callable(own) else {}


def _get(generator: Any) -> Any:
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    raise TypeError(f"random generator of type {type(generator).__name__}; expected random.Random, "
                    "torch.Generator or numpy.random.Generator")


def _set(generator: Any, state: Any) -> None:
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, torch.Generator):
        generator.set_state(state)
    else:
        generator.bit_generator.state = state


def _numpy_state() -> tuple:
    """numpy's global state with its key array as a list: checkpoints then load with ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return name, keys.tolist(), pos, has_gauss, cached


def capture(pl_module: pl.LightningModule) -> dict[str, Any]:
    """This process's generator states: torch (CPU and every CUDA device in use), numpy, Python, the module's own."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": random.getstate(),
                             "module": {name: _get(g) for name, g in _generators(pl_module).items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(pl_module: pl.LightningModule, state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture` returned (the module's generators by name; a missing one is an error)."""
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    generators = _generators(pl_module)
    saved = state.get("module", {})
    missing = sorted(set(generators) - set(saved))
    if missing:
        raise KeyError(f"checkpoint has no random state for the module's generator(s) {missing}; "
                       f"expected the generators it was saved with ({sorted(saved)})")
    for name, generator in generators.items():
        _set(generator, saved[name])


def gather(obj: Any) -> list[Any]:
    """Collective: every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RandomState(pl.Callback):
    """Saves every rank's generator states in checkpoints, restores them at the start of a resumed fit, and runs
    validation during fit on a copy of them. See the module docstring."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None  # this rank's states from a checkpoint, set at train start
        self._outside_validation: dict[str, Any] | None = None

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Every rank dumps the checkpoint (the strategy then writes it), so a collective is safe here.
        checkpoint[STATE_KEY] = gather(capture(pl_module))

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(STATE_KEY)
        if states is None:
            return  # a checkpoint written without this callback: the run resumes, with fresh draws
        if len(states) != trainer.world_size:
            raise ValueError(f"checkpoint holds random states of {len(states)} rank(s) and this run has "
                             f"{trainer.world_size}; expected the same number of processes to resume exactly")
        self._pending = states[trainer.global_rank]

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Restored here, not on load: building the strategy, the optimizers and the data loader may draw in between.
        if self._pending is not None:
            restore(pl_module, self._pending)
            self._pending = None

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._outside_validation = capture(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._outside_validation is not None:
            restore(pl_module, self._outside_validation)
            self._outside_validation = None
