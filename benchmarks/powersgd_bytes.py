"""Bytes sent between nodes per step by PowerSGD versus a plain fp32 all-reduce; prints JSON.

1. Measured: 2 replicas (gloo processes on 127.0.0.1), a small transformer-shaped model, real backward passes,
   PowerSGD ranks 1, 4 and 16; bytes from ``PowerSGD.stats`` next to ``compression_report``'s prediction.
2. Predicted: the paper's 12B configuration on the meta device (64 layers, d_model 3968, 8 devices per node,
   rank 112 per shard), for comparison with the paper's ~86% compression.

    .venv/bin/python benchmarks/powersgd_bytes.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from dalle_lightning_plugins.compression.compression_report import compression_report, default_uncompressed  # noqa: E402
from dalle_lightning_plugins.compression.powersgd import PowerSGD  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, -1) @ v)
        return x + self.mlp_proj(torch.relu(self.c_fc(self.ln_2(x))))


class Transformer(nn.Module):
    """nanoGPT-shaped stand-in (no causal mask needed for counting bytes)."""

    def __init__(self, vocab: int, d: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


SMALL = dict(vocab=512, d=128, layers=2, ctx=32)
STEPS = 5


def _not_head(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """The paper leaves embeddings, unembedding, gains and biases uncompressed."""
    return default_uncompressed(name, param, module) or name.startswith("head.")


def _measure(rank: int, world_size: int, powersgd_rank: int) -> dict:
    torch.manual_seed(0)
    model = Transformer(**SMALL)
    listed = {n for mod_name, m in model.named_modules() for n, p in
              ((f"{mod_name}.{pn}", p) for pn, p in m.named_parameters(recurse=False)) if _not_head(n, p, m)}
    psgd = PowerSGD(dist.group.WORLD, rank=powersgd_rank)
    gen = torch.Generator().manual_seed(rank)
    seconds = 0.0
    for _ in range(STEPS):
        idx = torch.randint(0, SMALL["vocab"], (4, SMALL["ctx"]), generator=gen)
        model.zero_grad()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        start = time.perf_counter()
        assert psgd.reduce([(n, p.grad) for n, p in model.named_parameters()], uncompressed=listed)
        seconds += time.perf_counter() - start
    return {"bytes_sent_per_step": psgd.stats.bytes_sent_last_step,
            "uncompressed_bytes_per_step": psgd.stats.uncompressed_bytes_last_step,
            "reduce_ms": round(1e3 * seconds / STEPS, 2)}


def main() -> None:
    measured = {}
    for r in (1, 4, 16):
        m = run_distributed(_measure, 2, r, timeout=300)[0]
        with torch.device("meta"):
            model = Transformer(**SMALL)
        predicted = compression_report(model, nodes=2, devices_per_node=1, rank=0, powersgd_rank=r, uncompressed=_not_head)
        measured[f"rank_{r}"] = {
            **m,
            "compression": round(1 - m["bytes_sent_per_step"] / m["uncompressed_bytes_per_step"], 4),
            "predicted_bytes_sent_per_step": predicted["compressed_bytes"],
        }
    paper = {}
    with torch.device("meta"):
        big = Transformer(vocab=16384 + 8192, d=3968, layers=64, ctx=256 + 1024)
    for dtype in ("fp32", "bf16"):
        rep = compression_report(big, nodes=128, devices_per_node=8, rank=0, powersgd_rank=112,
                                 uncompressed=_not_head, comm_dtype=dtype)
        paper[f"comm_{dtype}"] = {k: rep[k] for k in ("params_total", "params_per_rank", "compressed_bytes",
                                                      "uncompressed_bytes", "compression")}
        paper[f"comm_{dtype}"]["compression_resblock_matrices_only"] = round(
            1 - rep["kinds"]["compressed"]["compressed_bytes"] / rep["kinds"]["compressed"]["uncompressed_bytes"], 4)
    paper["paper_formula_1-5r/(8d)"] = round(1 - 5 * 896 / (8 * 3968), 4)
    print(json.dumps({"small_model": SMALL, "replicas": 2, "measured": measured, "paper_12b_meta": paper}, indent=2))


if __name__ == "__main__":
    main()
