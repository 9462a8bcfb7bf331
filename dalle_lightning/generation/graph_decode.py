"""The prior's decode step replayed as one CUDA graph: sampling near the memory-bandwidth limit (gpt-fast's recipe).

A decode step at a small batch is a few hundred small kernels (per layer: LayerNorm, the QKV product, a gather of
the mask row's keys, attention, the projections, the MLP), each a few microseconds of GPU work, so an eager loop
is bound by the host launching them: 13.4 ms per token for the 353M prior at batch 16 on an H200, where its
weights (0.7 GB in bf16) take about 0.2 ms to read. Captured once into a CUDA graph, a step is one launch.

What makes the step capturable (``DallePrior.decode_at``): the cache is allocated whole by the prefill
(``LayerKV``: ``[2, B, H, max_len, D]`` per layer), the position is a one-element tensor on the device, written in
place (``index_copy_``) and read by gathers (``index_select``), so every kernel has the same shapes and addresses at
every token and no host value is read. :class:`GraphDecoder` copies the token and position into its static inputs,
replays the graph and returns its static output. The draw from the logits (top-k, top-p, the inverse CDF) stays
eager: a dozen kernels, with the sampler's own generator.

The capture runs without autocast: the weights are already in the compute dtype (:mod:`.cast`, as gpt-fast
samples), so the replay reads them once, in 16 bits, and no cast of them is captured. It runs with
``capture_error_mode="thread_local"``: under a distributed run another thread's CUDA call (NCCL's watchdog) would
invalidate a ``"global"`` capture; inductor's CUDA graph trees capture the same way for this reason.

**Buffers**: a step returns logits the caller owns. The graph's output is one buffer that the next replay
overwrites, so :class:`GraphDecoder` returns a copy of it ([B, Vi] floats: a few hundred kilobytes, one small
kernel per token beside a step that reads the whole model).

**Fallback**: should the capture fail (a torch release, a driver or a GPU it never ran on, another thread's CUDA
call), the step runs eagerly, for this call and every later one in the process, with one line naming ``graphs=false``
(:mod:`dalle_lightning_plugins.fast_paths`; strict mode raises). A capture inside the FID or sample-grid callback
therefore cannot end a training run.

On the CPU there is no graph: :func:`decode_step` runs the same static step eagerly, which the tests compare with
the eager decode token for token (``tests/test_graph_decode.py``); they emulate a replay that overwrites its output
and force a capture to fail (``tests/test_fast_path_fallbacks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from dalle_lightning.models.prior import DallePrior, KVCache
from dalle_lightning_plugins.fast_paths import FastPath

WARMUP = 2  # eager runs on a side stream before capture (cuBLAS workspaces, lazily built tables), as torch advises


class DecodeStep(Protocol):
    """``step(token [B], image_pos) -> logits [B, Vi]``: the next token's logits, a tensor the caller owns (no later
    step writes into it)."""

    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor: ...


# One capture failure turns graphs off for the process: a capture that failed would fail again at every call.
GRAPHS = FastPath("CUDA graph capture of the prior's decode step", "graphs=false", site="GraphDecoder")


def use_graphs(mode: bool | str, device: torch.device, model: torch.nn.Module | None = None) -> bool:
    """``graphs``: True, False or ``auto``: CUDA graphs where the device is a GPU and the model is whole (a model
    a strategy shards, sampled by a callback during training, gathers its parameters as it goes)."""
    if mode == "auto":
        sharded = model is not None and any(isinstance(p, DTensor) for p in model.parameters())
        return device.type == "cuda" and not sharded
    if not isinstance(mode, bool):
        raise ValueError(f"graphs={mode!r}; expected true, false or auto")
    if mode and device.type != "cuda":
        raise ValueError(f"graphs=true on {device}; expected a CUDA device (graphs=auto uses them where there is one)")
    return mode


class StaticDecoder:
    """``step(token [B], image_pos)`` -> next logits ``[B, Vi]`` through static inputs: the token and the position
    are copied into tensors that keep their addresses, and the step reads nothing else from the host. Eager, it
    is what :class:`GraphDecoder` captures, and what the CPU tests compare with the eager decode."""

    def __init__(self, model: DallePrior, cache: KVCache, token: torch.Tensor) -> None:
        self.model, self.cache = model, cache
        self.token = token.detach().clone()
        self.image_pos = torch.zeros(1, dtype=torch.long, device=token.device)

    def _load(self, token: torch.Tensor, image_pos: int) -> None:
        self.token.copy_(token)
        self.image_pos.fill_(image_pos)  # a kernel: no host-device copy, no wait

    def _step(self) -> torch.Tensor:
        return self.model.decode_at(self.token, self.image_pos, self.cache)

    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor:
        self._load(token, image_pos)
        return self._step()


def capture(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` captured into a CUDA graph, without autocast and with ``capture_error_mode="thread_local"``, after
    :data:`WARMUP` eager runs on a side stream; returns the graph and its static output.

    The step must be idempotent (the decode step writes this position's keys and values: the same values, the
    same place). A failed capture leaves the caller's stream current again: torch's ``graph`` context skips that
    when ``capture_end`` raises, and the eager step that follows would otherwise run on the capture stream."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.autocast(device.type, enabled=False):
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    step()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = step()
        finally:
            torch.cuda.set_stream(current)
            current.wait_stream(side)  # after a failed warm-up too: its writes land before the eager step's
    return graph, out


class GraphDecoder(StaticDecoder):
    """:class:`StaticDecoder` replayed as one CUDA graph, captured at the first step (:func:`capture`).

    Built after the prefill (the cache must exist, whole) and used for one sampling call: the graph holds the
    cache's addresses. The step computes in the weights' dtype, without autocast (:mod:`.cast`), as the eager step
    of the same call does, so both draw the same tokens. Each call returns a copy of the graph's output buffer.
    A failed capture runs the step eagerly (see the module docstring)."""

    def __init__(self, model: DallePrior, cache: KVCache, token: torch.Tensor) -> None:
        super().__init__(model, cache, token)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.captures = 0
        self.eager = False  # the capture failed: every step of this call runs eagerly

    def _capture_and_replay(self) -> torch.Tensor:
        graph, logits = capture(self._step, self.token.device)
        graph.replay()  # kept only once it has replayed: a graph that cannot is a failed fast path too
        self.graph, self.logits = graph, logits
        self.captures += 1
        return logits.clone()

    def _replay(self) -> torch.Tensor:
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        return self.logits.clone()

    def _eager(self) -> torch.Tensor:
        self.eager = True
        return self._step()

    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor:
        self._load(token, image_pos)
        if self.graph is not None:
            return self._replay()
        if self.eager:
            return self._step()
        return GRAPHS.run(self._capture_and_replay, self._eager)


def decode_step(model: DallePrior, cache: KVCache, token: torch.Tensor, graphs: bool) -> DecodeStep:
    """The decode step of one sampling call: a :class:`GraphDecoder` with ``graphs`` (unless a capture failed in
    this process), else the eager static step (the position as a host int, so the eager loop reads and copies
    nothing per token)."""
    if graphs and not GRAPHS.failed:
        return GraphDecoder(model, cache, token)

    def eager(token: torch.Tensor, image_pos: int) -> torch.Tensor:
        return model.decode_at(token, image_pos, cache)

    return eager
