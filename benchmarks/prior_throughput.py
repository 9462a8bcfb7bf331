"""Prior training throughput and fraction of the matmul peak (forward + backward + AdamW step), as JSON.

Shapes:

- ``demo``: the demo's prior (``conf/model/prior_shapes.yaml``: 6 layers, 4 heads x 32, 20 caption + 8x8 image
  tokens, batch 32).
- ``matched8`` / ``matched16``: width 256, depth 8, 4 heads, image vocabulary 512, text vocabulary 1024, batch 16,
  8x8 image + 32 text and 16x16 image + 64 text tokens: the shape compared with other DALL-E implementations.

One token is one stream position (``text_len + grid^2`` per sequence). Model FLOPs per token are
``6 x`` the matmul parameters each position passes through (the layers' linear weights, the text head for text
positions, the image head for image positions) plus ``12 x width`` per attended (query, key) pair of the masks;
``fraction_of_peak`` divides the achieved model FLOP/s by the same dtype's 2048^3 matmul rate measured in the same
process around the run. ``executed_gflop_per_step`` (torch's flop counter) also counts what the sparse kernel
computes and masks.

Usage: ``python benchmarks/prior_throughput.py [--shapes demo matched8 matched16] [--precisions fp32 bf16]
[--optimizer fused|foreach] [--steps 6] [--impl sparse] [--threads N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from _peak import executed_flops, timed_against_peak

from dalle_lightning.models.prior import DallePrior
from dalle_lightning_plugins.dtypes import resolve_dtype

SHAPES = {
    "demo": (dict(text_vocab_size=128, text_len=20, image_vocab_size=512, image_grid=8, n_layer=6, n_head=4,
                  d_head=32, conv_kernel=5), 32),
    "matched8": (dict(text_vocab_size=1024, text_len=32, image_vocab_size=512, image_grid=8, n_layer=8, n_head=4,
                      d_head=64), 16),
    "matched16": (dict(text_vocab_size=1024, text_len=64, image_vocab_size=512, image_grid=16, n_layer=8,
                       n_head=4, d_head=64), 16),
}
PRECISIONS = ["fp32", "bf16"]  # names resolve_dtype knows


def model_flops_per_token(model: DallePrior) -> float:
    """6 x matmul parameters per position + 12 x width per attended (query, key) pair, averaged over positions."""
    length = model.n_text + model.image_len - 1  # input positions: the last image token is never an input
    text, image = model.text_len, model.image_len
    layer_params = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    head_params = (model.text_head.weight.numel() * text + model.image_head.weight.numel() * image) / (text + image)
    pairs = sum(int(layer.attn.layout.full_mask()[:length, :length].sum()) for layer in model.layers)
    attention = 12 * model.d_model * pairs / (text + image)
    return 6 * (layer_params + head_params) + attention


def measure(shape: str, precision: str, optimizer: str, impl: str, steps: int) -> dict:
    config, batch = SHAPES[shape]
    torch.manual_seed(0)
    model = DallePrior(**config, attn_impl=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer: True})
    text = torch.randint(0, config["text_vocab_size"], (batch, config["text_len"]))
    image = torch.randint(0, config["image_vocab_size"], (batch, config["image_grid"] ** 2))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            loss = model(text, image)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    tokens = batch * (config["text_len"] + config["image_grid"] ** 2)
    seconds, peak = timed_against_peak(step, resolve_dtype(precision), steps)
    flops = model_flops_per_token(model)
    achieved = flops * tokens / seconds / 1e9
    return {"shape": shape, "precision": precision, "batch": batch, "tokens_per_s": round(tokens / seconds),
            "step_ms": round(seconds * 1e3, 1), "model_mflop_per_token": round(flops / 1e6, 2),
            "achieved_gflop_s": round(achieved, 1), "peak_gflop_s": round(peak, 1),
            "fraction_of_peak": round(achieved / peak, 3),
            "executed_gflop_per_step": round(executed_flops(step) / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["demo", "matched8", "matched16"])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=PRECISIONS)
    parser.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                        help="AdamW implementation (the stage configs use fused)")
    parser.add_argument("--impl", choices=["sparse", "dense"], default="sparse")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(shape, precision, args.optimizer, args.impl, args.steps)
               for shape in args.shapes for precision in args.precisions]
    print(json.dumps({"benchmark": "prior_train_throughput", "impl": args.impl, "optimizer": args.optimizer,
                      "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
