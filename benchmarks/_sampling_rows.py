"""The sampling rows of ``benchmarks/gpu.py``: the prior's decode loop, eager against CUDA graphs, against the
memory-bandwidth bound of its step.

Each row samples a full image per caption with ``sample_image_tokens`` (KV cache, top-k 64) from the prior as it
ships and trains: ``attn_impl="auto"`` (a FlexAttention prefill on CUDA, the blocked kernel elsewhere),
``compile="auto"`` (each residual branch's body compiled on CUDA, inside the capture) and the precision plugin's
branch hooks (``ResblockScalingPrecision(dtype="bf16")``, as ``make demo`` trains), sampled as the FID callback
samples under that plugin (``PriorModule.fid_generate``: bf16 autocast, so one cast copy per call). It
reports the time per token step (prefill and the draws included, divided by the image's tokens), images per second,
whether the graph path drew the eager path's tokens for the same seed, and the bound: the bytes one decode step
reads over the device's copy bandwidth, measured in the same process.

The bytes are those of the model the step runs: under autocast, ``sample_image_tokens`` samples from a copy whose
weights are cast once to bf16 (``dalle_lightning/generation/cast.py``; the final LayerNorm and the image head stay
fp32), so a step reads each layer's weights in bf16, the head in fp32, and each layer's gathered keys and values
in the cache's dtype. Before that copy, the step read the fp32 weights and cast them at every token, which a count
of the weights as stored hid. The issue's shapes: the demo prior (``conf/model/prior_shapes.yaml``, 8x8 tokens) at
batch 64 and the 353M prior on the paper's stream at batch 16.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dalle_lightning.generation.cast import precision_dtype, sampling_model, weights_dtype
from dalle_lightning.generation.sampling import sample_image_tokens
from dalle_lightning.models.prior import DallePrior
from dalle_lightning.models.regions import wants_compiled
from dalle_lightning.models.sparse_attention import decode_tables, resolve_impl
from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision

_DEMO = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/model/prior_shapes.yaml")
_TEXT_LEN = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/model/tokenizer_shapes.yaml").text_len  # the prior reads it
DEMO = dict(text_vocab_size=128, text_len=_TEXT_LEN, image_vocab_size=512, image_grid=8, n_layer=_DEMO.n_layer,
            n_head=_DEMO.n_head, d_head=_DEMO.d_head, conv_kernel=_DEMO.conv_kernel)
PAPER_353M = dict(text_vocab_size=16384, text_len=256, image_vocab_size=8192, image_grid=32, d_head=64, conv_kernel=11,
                  n_layer=24, n_head=16)
TINY = dict(text_vocab_size=64, text_len=8, image_vocab_size=64, image_grid=4, d_head=16, n_layer=2, n_head=2,
            conv_kernel=3)
SHAPES = {"demo": (DEMO, 64), "353M": (PAPER_353M, 16)}


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def step_bytes(model: DallePrior, batch: int, kv_bytes: int) -> int:
    """Bytes one decode step reads from ``model``, the module the step runs (the sampling copy, in its dtypes): the
    layers', the final LayerNorm's and the image head's weights, each layer's gathered row of cached keys and
    values, and the image embeddings' one row (ignored: a row per token)."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.startswith("layers.") or n.startswith("image_head") or n.startswith("ln_f"))
    gathered = 0
    for layer in model.layers:
        index, _ = decode_tables(layer.attn.layout, torch.device("cpu"))
        gathered += 2 * batch * layer.attn.n_head * index.shape[1] * layer.attn.d_head * kv_bytes
    return weights + gathered


def rows(device: torch.device, smoke: bool) -> Iterator[dict]:
    shapes = {"tiny": (TINY, 4)} if smoke else SHAPES
    bandwidth = copy_bandwidth(device, 16 if smoke else 2048)
    for shape, (config, batch) in shapes.items():
        torch.manual_seed(0)
        model = DallePrior(**config, attn_impl="auto", compile="auto").to(device).eval()
        plugin = ResblockScalingPrecision(dtype="bf16")
        plugin.convert_module(model)  # the branch hooks a run under the plugin samples with
        dtype = precision_dtype(plugin.precision)  # bf16-mixed: what fid_generate samples in
        text = torch.randint(1, config["text_vocab_size"], (batch, config["text_len"]), device=device)
        modes = [False, True] if device.type == "cuda" else [False]
        tokens: dict[bool, torch.Tensor] = {}
        seconds: dict[bool, float] = {}
        for graphs in modes:
            times = []
            for i in range(2 if smoke else 3):  # the first call builds tables and captures: not timed
                generator = torch.Generator(device=device).manual_seed(1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=dtype):
                    tokens[graphs] = sample_image_tokens(model, text, top_k=64, generator=generator, graphs=graphs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i:
                    times.append(time.perf_counter() - start)
            seconds[graphs] = min(times)
        n_tokens = model.image_len
        with torch.autocast(device.type, dtype=dtype):  # the module the step ran: one cast copy per call
            stepped, _ = sampling_model(model, device)
        moved = step_bytes(stepped, batch, next(stepped.layers.parameters()).element_size())
        for graphs in modes:
            per_token_s = seconds[graphs] / n_tokens
            yield {"row": f"sample_{shape}_b{batch}_{'graphs' if graphs else 'eager'}", "batch": batch,
                   "parameters": sum(p.numel() for p in model.parameters()), "ms_per_token_step": round(1e3 * per_token_s, 4),
                   "images_per_s": round(batch / seconds[graphs], 2), "bytes_per_step": moved,
                   "weights_dtype": str(weights_dtype(stepped)).removeprefix("torch."),
                   "attn_impl": resolve_impl(model.layers[0].attn.impl, device),
                   "compiled": wants_compiled(model.layers[0].mlp.compile_mode, text.float()),
                   "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "bound_ms": round(1e3 * moved / bandwidth, 4),
                   "times_the_bound": round(per_token_s * bandwidth / moved, 2),
                   "same_tokens_as_eager": bool(torch.equal(tokens[graphs], tokens[False]))}
