"""What the demo-sized dVAE encoder and decoder can carry through an 8 x 8 bottleneck in a fixed number of updates,
as JSON lines: caption accuracy of reconstructions of fresh renders at chosen updates.

It separates the two suspects for the demo's dVAE ceiling: the quantiser, and the encoder and decoder around it.
``--bottleneck continuous`` decodes the encoder's output unquantised (no quantiser at all: an upper bound for any
quantiser at this size and budget); ``lfq`` rounds each of ``--channels`` channels to +-1 (``vector_quantize_pytorch``'s
LFQ: 2^channels codes, an entropy term of weight ``--entropy``); ``gumbel`` is the paper's relaxation over
``--channels`` codes with the demo's temperature (5 -> 1/16, cosine) and KL schedules, judged on argmax codes.
``--resample space_to_depth`` replaces the paper's max-pool and nearest upsampling between groups by lossless
pixel (un)shuffles with a 1x1 conv; ``both`` adds such a path, zero-initialised, beside the paper's. In-process, one thread advised, fp32 unless ``--bf16``; training scenes are drawn
fresh from the world's train split, the judged ones are ``eval_scenes(1, split, 200)``.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/dvae_bottleneck.py --bottleneck continuous --channels 9``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dalle_lightning.evaluation.evaluate import eval_scenes, images_of
from dalle_lightning.models.dvae import DiscreteVAE, conv
from dalle_lightning.world import caption_accuracy
from dalle_lightning.world.render import render
from dalle_lightning.world.scene import sample_scenes

CHANNELS_LAST = torch.channels_last


class Sum(nn.Module):
    """The paper's resampling plus a lossless pixel-(un)shuffle path whose conv starts at zero: at initialisation
    the network is the paper's, and the second path can add where in a cell things are."""

    def __init__(self, paper: nn.Module, lossless: nn.Sequential) -> None:
        super().__init__()
        self.paper, self.lossless = paper, lossless
        conv_layer = next(m for m in lossless if isinstance(m, nn.Conv2d))
        nn.init.zeros_(conv_layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.paper(x) + self.lossless(x)


def build(args: argparse.Namespace) -> DiscreteVAE:
    """The demo's dVAE sizes (conf/model/dvae_gumbel.yaml) with ``channels`` encoder outputs / decoder inputs."""
    model = DiscreteVAE(64, args.channels, n_hid=32, n_blk_per_group=1, group_count=4, codebook_dim=64,
                        codebook_init_std=1.0, block_min_hidden=args.min_hidden)
    if args.resample != "maxpool":
        for g in range(1, 4):
            enc, dec = getattr(model.encoder.blocks, f"group_{g}"), getattr(model.decoder.blocks, f"group_{g}")
            width = 32 * 2 ** (g - 1)
            down = nn.Sequential(nn.PixelUnshuffle(2), conv(4 * width, width, 1))
            enc.pool = down if args.resample == "space_to_depth" else Sum(enc.pool, down)
            width = 32 * 2 ** (4 - g)
            up = nn.Sequential(conv(width, 4 * width, 1), nn.PixelShuffle(2))
            dec.upsample = up if args.resample == "space_to_depth" else Sum(dec.upsample, up)
    return model.to(memory_format=CHANNELS_LAST)


def batches(batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless training images from the train split, 512 fresh scenes at a time."""
    for chunk in range(10**9):
        scenes = sample_scenes(seed + chunk, "train", 512)
        images = torch.from_numpy(np.stack([render(s) for s in scenes])).permute(0, 3, 1, 2).float() / 255
        yield from images.split(batch)


class Bottleneck:
    """Training forward (loss) and evaluation codes -> decoder input for the chosen bottleneck."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.lfq = None
        if args.bottleneck == "lfq":
            from vector_quantize_pytorch import LFQ

            self.lfq = LFQ(dim=args.channels, codebook_size=2**args.channels, entropy_loss_weight=args.entropy,
                           channel_first=True)

    def eval_input(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder input and the codes (None for the continuous bottleneck)."""
        if self.args.bottleneck == "gumbel":
            codes = latents.argmax(1)
            return F.one_hot(codes, self.args.channels).permute(0, 3, 1, 2).float(), codes
        if self.args.bottleneck == "lfq":
            quantized, codes, _ = self.lfq(latents.float())
            return quantized, codes
        return latents, None

    def loss(self, model: DiscreteVAE, images: torch.Tensor, step: int) -> torch.Tensor:
        args = self.args
        if args.bottleneck == "gumbel":
            tau = 0.0625 + (5 - 0.0625) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            beta = 6.6 * 0.5 * (1 - math.cos(math.pi * min(step, 150) / 150))
            return model(images, temperature=tau, kl_weight=beta)["loss"]
        latents = model.encode(images)
        aux = 0.0
        if args.bottleneck == "lfq":
            with torch.autocast("cpu", enabled=False):
                latents, _, aux = self.lfq(latents.float())
        stats = model.decoder(latents.contiguous(memory_format=CHANNELS_LAST)).float()
        return model.logit_laplace_nll(stats, images) + aux


@torch.no_grad()
def evaluate(model: DiscreteVAE, bottleneck: Bottleneck, judged: dict) -> dict:
    model.eval()
    out: dict = {}
    codes = []
    for split, (images, captions, objects) in judged.items():
        latents = model.encode(images.contiguous(memory_format=CHANNELS_LAST))
        inputs, split_codes = bottleneck.eval_input(latents)
        recon = model.stats_to_images(model.decoder(inputs.contiguous(memory_format=CHANNELS_LAST)).float())
        two = [i for i, n in enumerate(objects) if n == 2]
        acc = caption_accuracy(recon, captions)
        out[split] = {"accuracy": acc["accuracy"], "shape": acc["shape"], "colour": acc["colour"],
                      "two_objects": caption_accuracy(recon[two], [captions[i] for i in two])["accuracy"],
                      "psnr": round(-10 * math.log10(F.mse_loss(recon, images).item()), 2)}
        if split_codes is not None:
            codes.append(split_codes.flatten())
    if codes:
        counts = torch.bincount(torch.cat(codes)).double()
        p = counts[counts > 0] / counts.sum()
        out["codes_in_use"], out["perplexity"] = int(p.numel()), round(float(torch.exp(-(p * p.log()).sum())), 1)
    model.train()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bottleneck", choices=["continuous", "lfq", "gumbel"], default="continuous")
    parser.add_argument("--channels", type=int, default=9, help="latent channels (lfq: bits; gumbel: codes)")
    parser.add_argument("--resample", choices=["maxpool", "space_to_depth", "both"], default="maxpool",
                        help="both: max-pool / nearest plus a zero-initialised pixel-(un)shuffle path")
    parser.add_argument("--min-hidden", type=int, default=0,
                        help="smallest res-path width of a block (the paper: width / 4, 8 channels at full resolution)")
    parser.add_argument("--entropy", type=float, default=0.01, help="LFQ's entropy loss weight")
    parser.add_argument("--steps", type=int, default=3500, help="updates (the demo's dVAE: 3,500)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.0, help="gradient norm clip (0: none, as the demo)")
    parser.add_argument("--evals", default="1000,2000,3500", help="updates after which to judge")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, bottleneck = build(args), Bottleneck(args)
    judged = {}
    for split in ("val", "zeroshot"):
        scenes = eval_scenes(1, split, 200)
        judged[split] = (images_of(scenes), [s.caption for s in scenes], [len(s.objects) for s in scenes])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4, fused=True)
    final = 4.1667e-4  # the demo's final lr share
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: final + (1 - final) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    evals = {int(s) for s in args.evals.split(",")}
    start = time.perf_counter()
    for step, images in enumerate(batches(args.batch, 1000 + args.seed), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = bottleneck.loss(model, images.contiguous(memory_format=CHANNELS_LAST), step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        if step in evals:
            print(json.dumps({"update": step, "loss": round(loss.item(), 4), "seconds": round(time.perf_counter() - start, 1),
                              **vars(args), **evaluate(model, bottleneck, judged)}), flush=True)
        if step >= args.steps:
            break


if __name__ == "__main__":
    main()
