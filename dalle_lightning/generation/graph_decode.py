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

On the CPU there is no graph: :func:`decode_step` runs the same static step eagerly, which the tests compare with
the eager decode token for token (``tests/test_graph_decode.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from dalle_lightning.models.prior import DallePrior, KVCache

WARMUP = 2  # eager runs on a side stream before capture (cuBLAS workspaces, lazily built tables), as torch advises


class DecodeStep(Protocol):
    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor: ...


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

    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor:
        self._load(token, image_pos)
        return self.model.decode_at(self.token, self.image_pos, self.cache)


class GraphDecoder(StaticDecoder):
    """:class:`StaticDecoder` replayed as one CUDA graph, captured at the first step.

    Built after the prefill (the cache must exist, whole) and used for one sampling call: the graph holds the
    cache's addresses. The step is captured under the caller's autocast state, with autocast's weight-cast cache off
    (a capture may not allocate from it), so the replay computes in the same dtypes as the eager step."""

    def __init__(self, model: DallePrior, cache: KVCache, token: torch.Tensor) -> None:
        super().__init__(model, cache, token)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.captures = 0

    def _capture(self) -> None:
        device = self.token.device
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.autocast(device.type, dtype=dtype, enabled=autocast, cache_enabled=False):
            for _ in range(WARMUP):  # writes this step's keys and values twice: the same values, the same place
                self.model.decode_at(self.token, self.image_pos, self.cache)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.autocast(device.type, dtype=dtype, enabled=autocast, cache_enabled=False):
            self.logits = self.model.decode_at(self.token, self.image_pos, self.cache)
        self.graph = graph
        self.captures += 1

    def __call__(self, token: torch.Tensor, image_pos: int) -> torch.Tensor:
        self._load(token, image_pos)
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        return self.logits


def decode_step(model: DallePrior, cache: KVCache, token: torch.Tensor, graphs: bool) -> DecodeStep:
    """The decode step of one sampling call: a :class:`GraphDecoder` with ``graphs``, else the eager static step
    (the position as a host int, so the eager loop reads and copies nothing per token)."""
    if graphs:
        return GraphDecoder(model, cache, token)

    def eager(token: torch.Tensor, image_pos: int) -> torch.Tensor:
        return model.decode_at(token, image_pos, cache)

    return eager
