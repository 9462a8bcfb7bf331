"""dVAE training step (forward + backward + AdamW) time and fraction of the matmul peak, as JSON.

The shapes world's dVAEs (64x64 images, 4 groups, width 32, 512 codes: ``--model fsq``, ``conf/model/dvae_fsq.yaml``,
``--model vq``, ``conf/model/dvae_vq.yaml``; ``--model gumbel``, ``conf/model/dvae_gumbel.yaml``, the paper's
relaxation and the demo's) at the demo's batch
(8) and at 32, in fp32 and bf16 autocast, with NCHW and channels-last (NHWC) tensors. FLOPs are those torch's flop
counter finds in the convolutions (forward and backward); ``fraction_of_peak`` divides the achieved rate by the
same dtype's 2048^3 matmul rate measured in the same process around the run.

Usage: ``python benchmarks/dvae_throughput.py [--model gumbel|fsq|vq] [--batches 8 32] [--optimizer fused|foreach]
[--steps 6]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from _peak import executed_flops, timed_against_peak

from dalle_lightning.models.dvae import DiscreteVAE
from dalle_lightning.models.dvae_fsq import FSQVAE
from dalle_lightning.models.dvae_vq import VQVAE
from dalle_lightning_plugins.dtypes import resolve_dtype

SHAPES = dict(image_size=64, group_count=4, n_hid=32, n_blk_per_group=1, codebook_dim=64)
MODELS = {"gumbel": lambda **kw: DiscreteVAE(vocab_size=512, **SHAPES, **kw),
          "fsq": lambda **kw: FSQVAE(levels=[8, 8, 8], **SHAPES, **kw),
          "vq": lambda **kw: VQVAE(vocab_size=512, latent_dim=8, use_cosine_sim=True, **SHAPES, **kw)}
PRECISIONS = ["fp32", "bf16"]  # names resolve_dtype knows


def measure(name: str, batch: int, precision: str, channels_last: bool, optimizer: str, steps: int,
            block_min_hidden: int = 0) -> dict:
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = MODELS[name](block_min_hidden=block_min_hidden).to(memory_format=layout)
    kwargs = dict(temperature=1.0, kl_weight=1.0) if model.relaxed else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer: True})
    images = torch.rand(batch, 3, 64, 64).contiguous(memory_format=layout)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            loss = model(images, **kwargs)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    seconds, peak = timed_against_peak(step, resolve_dtype(precision), steps)
    flops = executed_flops(step)
    achieved = flops / seconds / 1e9
    return {"batch": batch, "precision": precision, "channels_last": channels_last,
            "step_ms": round(seconds * 1e3, 1), "images_per_s": round(batch / seconds, 1),
            "gflop_per_step": round(flops / 1e9, 2), "achieved_gflop_s": round(achieved, 1),
            "peak_gflop_s": round(peak, 1), "fraction_of_peak": round(achieved / peak, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gumbel")
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=PRECISIONS)
    parser.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                        help="AdamW implementation (the stage configs use fused)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--block-min-hidden", type=int, default=0, help="the model option (0: the paper's width / 4)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(args.model, batch, precision, channels_last, args.optimizer, args.steps, args.block_min_hidden)
               for batch in args.batches for precision in args.precisions for channels_last in (False, True)]
    print(json.dumps({"benchmark": "dvae_train_step", "model": args.model, "block_min_hidden": args.block_min_hidden,
                      "optimizer": args.optimizer,
                      "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
