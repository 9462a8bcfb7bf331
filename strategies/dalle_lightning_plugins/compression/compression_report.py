"""Expected inter-node traffic of sharded PowerSGD for a model, computed from shapes alone.

Works on a model on the meta device: no memory, no processes. For one global rank of a nodes x devices mesh it
derives each parameter's local shard as FSDP2 cuts it, applies the same per-matrix rule as :class:`PowerSGD`
(``plan_rank``), and counts the bytes this rank contributes to the inter-node all-reduces per step, against a
plain fp32 all-reduce of the same shard. The figures use the same definition as ``PowerSGD.stats``, so a
measured run can be checked against the report.

FSDP2's rule (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``_chunk_with_empty``): dim 0 is split
with ``torch.chunk`` into ``devices_per_node`` pieces, i.e. chunks of ceil(d0 / k) rows, the last one shorter
and trailing ones empty if rows run out; storage is padded to the chunk size, but the gradient a rank holds
(and compresses) has the unpadded shard shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dalle_lightning_plugins.compression.comm_dtype import resolve_comm_dtype
from dalle_lightning_plugins.compression.powersgd import FP32_BYTES, factor_bytes, plan_rank

KINDS = ("compressed", "listed", "vector", "too_small", "empty")


def fsdp_shard_shape(shape: tuple[int, ...] | torch.Size, shards: int, index: int) -> tuple[int, ...]:
    """Local (unpadded) shape of shard ``index`` of a tensor of ``shape`` cut by FSDP2 into ``shards`` on dim 0."""
    if not 0 <= index < shards:
        raise ValueError(f"shard index {index} out of range for {shards} shards")
    shape = tuple(shape) or (1,)  # FSDP2 treats a scalar as one element on dim 0
    chunk = math.ceil(shape[0] / shards)
    rows = max(0, min(chunk, shape[0] - index * chunk))
    return (rows, *shape[1:])


def default_uncompressed(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Embeddings and 1-D parameters (gains, biases) go uncompressed in fp32, as in the paper.

    The output head (unembedding) is NOT excluded by default: which Linear is "the head" is model-specific.
    To mirror the paper, pass e.g. ``lambda n, p, m: default_uncompressed(n, p, m) or n.startswith("head.")``.
    """
    return isinstance(module, nn.Embedding) or param.ndim < 2


def _owned_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Module]]:
    seen: set[int] = set()
    out = []
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights are sharded and reduced once
                continue
            seen.add(id(param))
            out.append((f"{mod_name}.{p_name}" if mod_name else p_name, param, module))
    return out


def compression_report(
    model: nn.Module,
    nodes: int,
    devices_per_node: int,
    rank: int,
    powersgd_rank: int,
    uncompressed: Callable[[str, nn.Parameter, nn.Module], bool] | None = None,
    comm_dtype: torch.dtype | str = torch.float32,
    min_compression: float = 2.0,
) -> dict[str, Any]:
    """JSON-able figures for global ``rank`` (node = rank // devices_per_node, shard = rank % devices_per_node).

    Keys: params_total, params_per_rank (unpadded local numel), padded_params_per_rank, compressed_bytes and
    uncompressed_bytes (per step, contributed by this rank), compression = 1 - compressed/uncompressed, ratio =
    uncompressed/compressed, ring_bytes_per_step (what a ring all-reduce over ``nodes`` actually sends:
    2 (nodes-1)/nodes x compressed_bytes), and ``kinds``: per kind (compressed, listed = excluded by
    ``uncompressed``, vector, too_small, empty) the parameter count, local numel and both byte figures.
    """
    for label, value, low in (("nodes", nodes, 1), ("devices_per_node", devices_per_node, 1), ("powersgd_rank", powersgd_rank, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{label}={value!r} must be an integer >= {low}")
    if not 0 <= rank < nodes * devices_per_node:
        raise ValueError(f"rank={rank} must be in [0, {nodes * devices_per_node}) for {nodes} nodes x {devices_per_node} devices")
    dtype = resolve_comm_dtype(comm_dtype)
    is_listed = uncompressed or default_uncompressed
    shard = rank % devices_per_node

    kinds = {k: {"params": 0, "numel": 0, "compressed_bytes": 0, "uncompressed_bytes": 0} for k in KINDS}
    params_total = padded = 0
    for name, param, module in _owned_parameters(model):
        params_total += param.numel()
        local = fsdp_shard_shape(param.shape, devices_per_node, shard)
        padded += fsdp_shard_shape(param.shape, devices_per_node, 0)[0] * math.prod(local[1:])
        numel = math.prod(local)
        if numel == 0:
            kind, r = "empty", 0
        elif param.ndim < 2:
            kind, r = "vector", 0
        elif is_listed(name, param, module):
            kind, r = "listed", 0
        else:
            r = plan_rank(local, powersgd_rank, min_compression)
            kind = "compressed" if r else "too_small"
        sent = factor_bytes(local[0], numel // local[0], r, dtype) if r else numel * FP32_BYTES
        entry = kinds[kind]
        entry["params"] += 1
        entry["numel"] += numel
        entry["compressed_bytes"] += sent
        entry["uncompressed_bytes"] += numel * FP32_BYTES

    compressed = sum(k["compressed_bytes"] for k in kinds.values())
    full = sum(k["uncompressed_bytes"] for k in kinds.values())
    return {
        "nodes": nodes,
        "devices_per_node": devices_per_node,
        "rank": rank,
        "shard_index": shard,
        "powersgd_rank": powersgd_rank,
        "comm_dtype": str(dtype).removeprefix("torch."),
        "params_total": params_total,
        "params_per_rank": sum(k["numel"] for k in kinds.values()),
        "padded_params_per_rank": padded,
        "compressed_bytes": compressed,
        "uncompressed_bytes": full,
        "compression": 1 - compressed / full if full else 0.0,
        "ratio": full / compressed if compressed else 1.0,
        "ring_bytes_per_step": round(2 * (nodes - 1) / nodes * compressed),
        "kinds": kinds,
    }
