"""Regional compilation: each residual branch's body compiled on its own (``compile=True|False|"auto"``).

Why regions and not the whole model: the plugins work per residual branch. FSDP2 makes each branch a unit, the
precision plugin puts its boundary hooks (autocast, the 16-bit casts and the gradient filter) around each branch,
and activation checkpointing recomputes each branch. Compiling only what runs *inside* ``branch.forward`` leaves
every one of those hooks where it was, eager and outside the graph, and compiles each kind of branch once: the
function below is shared by every branch of a class, and dynamo treats the module as an input (its parameters are
graph inputs), so branches of the same shape share a graph.

Why a module-level compiled function and not ``torch.compile(module)`` or ``module.compile()``: those keep the
compiled callable on the instance, which an EMA copy (``deepcopy``) would share with the original, or wrap the
module and prefix its parameter names (``_orig_mod.``), which the plugins and checkpoints address by name. Here a
module only holds its ``compile`` setting.

``"auto"`` compiles where the inputs are on CUDA, and runs eagerly elsewhere (on the CPU the C++ compile of each
graph costs more than a short run saves). Graphs are specialised per branch shape, dtype, grad mode and
train/eval (the batch dimension is dynamic): the per-function recompile limit is raised for these functions only (a
model of many branch shapes, such as the dVAE's groups, needs more than dynamo's 8). Each region's graphs are
counted under its name (``<module>.<function>``, e.g. ``prior.MlpBranch._body``), and hitting the limit runs the new
shapes eagerly with one line, or raises in strict mode (:mod:`dalle_lightning.models.recompiles`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch

from dalle_lightning.models.recompiles import CompiledFunction, RecompileLimitError
from dalle_lightning_plugins.fast_paths import FastPath

CompileMode = Union[bool, str]
COMPILE_MODES = (True, False, "auto")
RECOMPILE_LIMIT = 64  # graphs per compiled function: branch shapes x dtypes x grad mode x train/eval


def check_compile(value: Any) -> CompileMode:
    """``True``, ``False`` or ``"auto"`` (also from a config string); anything else is a one-line error."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value not in COMPILE_MODES or isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"compile={value!r}; expected true, false or auto")
    return value


def wants_compiled(mode: CompileMode, x: torch.Tensor) -> bool:
    """Whether a region with this setting runs compiled for input ``x`` (never when already inside a compile:
    a user who compiles the whole model gets one graph, not nested ones)."""
    if mode is False or torch.compiler.is_compiling():
        return False
    return mode is True or x.is_cuda


class CompiledRegion:
    """``fn(module, *args)`` compiled on first use, under the recompile policy of :mod:`~.recompiles` (a raised
    limit, graphs counted per region; a hit runs new shapes eagerly, or raises in strict mode).

    Should the compile or the compiled call fail (a torch release or a GPU it never ran on), the region runs ``fn``
    eagerly from then on, with one line for all regions (:mod:`dalle_lightning_plugins.fast_paths`; strict mode
    raises). A failure in the compiled backward, which AOTAutograd compiles at the first backward, is not caught
    here."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"
        self._compiled = CompiledFunction(name, fn, limit=RECOMPILE_LIMIT, option="model.compile=false")
        self._path = FastPath("torch.compile of the model's residual branches", "model.compile=false",
                              site=fn.__qualname__, passthrough=(RecompileLimitError,))

    def __call__(self, *args: Any) -> Any:
        return self._path.run(lambda: self._compiled(*args), lambda: self.fn(*args))
