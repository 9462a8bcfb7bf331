"""A Lightning project that is not dalle-lightning, using its plugins as a stranger would, from the installed
``dalle_lightning_plugins`` alone. It imports torch, torchvision, Lightning and the plugins, nothing of the
repository (tests/test_plugins_fresh_env.py runs it in an environment that has nothing else).

Two models of its own, random data, a few SGD steps each:

* ``mlp``: a plain MLP with two residual blocks (``x + branch(x)``), named to the plugins by ``block_patterns``;
* ``resnet18``: torchvision's ResNet-18 on random 64 x 64 images, its ``BasicBlock`` named by ``block_classes``.

``torchrun --standalone --nproc-per-node=2 train.py strategy OUT``: each model trains on 2 CPU processes (gloo) under
Lightning's ``ddp``, under ``ShardedPowerSGDStrategy(devices_per_node=2)`` (1 node of 2: FSDP2) and under
``devices_per_node=1`` (2 nodes of 1: PowerSGD at full rank); rank 0 writes ``OUT/strategy.json``: per model and
layout the largest difference of the final weights (and BatchNorm statistics) to ``ddp``'s on the same rank, and
whether the ranks agree exactly wherever ``ddp``'s do (every parameter; BatchNorm statistics are each rank's own).

``python train.py precision OUT``: each model trains in one process in fp32, under Lightning's
``MixedPrecision("16-mixed")`` (its ``GradScaler`` starting at the plugin's scale) and under
``ResblockScalingPrecision("fp16")``; ``OUT/precision.json`` gives the largest differences between the three.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock

from dalle_lightning_plugins import ResblockScalingPrecision, ShardedPowerSGDStrategy

STEPS = 3
WORLD = 2


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                    nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), Residual(32), Residual(32), nn.Linear(32, 4))


def resnet() -> nn.Module:
    return resnet18(num_classes=10)


def data(name: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return TensorDataset(torch.randn(48, 16, generator=g), torch.randint(0, 4, (48,), generator=g))
    return TensorDataset(torch.rand(24, 3, 64, 64, generator=g), torch.randint(0, 10, (24,), generator=g))


# model -> (constructor, how the plugins find its blocks, full PowerSGD rank: the largest matrix side)
MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any], int]] = {
    "mlp": (mlp, {"block_patterns": ["net.*.branch"]}, 128),
    "resnet18": (resnet, {"block_classes": [BasicBlock]}, 512),
}


class Classifier(L.LightningModule):
    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images).float(), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every floating-point parameter and buffer, whole (a collective for sharded ones), fp32 on the CPU."""
    out = {}
    for name, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.is_floating_point():
            out[name] = value.detach().float().cpu().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return worst(a, b)[0]


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference between two sets of weights, and where."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((float((a[k] - b[k]).abs().max()), k) for k in a)


def agree(ranks: list[dict[str, torch.Tensor]], key: str) -> bool:
    return all(torch.equal(r[key], ranks[0][key]) for r in ranks)


def trainer(devices: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def strategy_run(out: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    for name, (make, blocks, full_rank) in MODELS.items():
        layouts = {
            "ddp": DDPStrategy(process_group_backend="gloo"),
            "dpn2": ShardedPowerSGDStrategy(devices_per_node=2, **blocks),
            "dpn1": ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=full_rank, min_compression=0.0,
                                            **blocks),
        }
        got = {}
        for layout, strategy in layouts.items():
            module = Classifier(make)
            dataset = data(name)
            sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=False)
            trainer(WORLD, strategy=strategy).fit(module, DataLoader(dataset, batch_size=4, sampler=sampler))
            got[layout] = weights(module)
        every_rank: list[Any] = [None] * WORLD
        dist.all_gather_object(every_rank, got)
        if rank == 0:
            ddp = [r["ddp"] for r in every_rank]
            # BatchNorm's running statistics are each rank's own after the last step, under ddp too
            shared = [k for k in ddp[0] if agree(ddp, k)]
            results[name] = {"steps": STEPS, "ddp_keys_equal_on_every_rank": len(shared), "keys": len(ddp[0])}
            for layout in ("dpn2", "dpn1"):
                mine = [r[layout] for r in every_rank]
                diff, key = max(worst(m, d) for m, d in zip(mine, ddp))
                results[name][layout] = {"max_diff_to_ddp": diff, "where": key,
                                         "ranks_agree_where_ddp_does": all(agree(mine, k) for k in shared)}
    if rank == 0:
        (out / "strategy.json").write_text(json.dumps(results, indent=1))


def precision_run(out: Path) -> None:
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for name, (make, blocks, _) in MODELS.items():
        got, skipped = {}, {}
        plugins = {
            "fp32": None,
            "16-mixed": MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**13)),
            "resblock_fp16": ResblockScalingPrecision("fp16", **blocks),
        }
        for label, plugin in plugins.items():
            module = Classifier(make)
            trainer(1, plugins=[plugin] if plugin else None).fit(module, DataLoader(data(name), batch_size=4))
            got[label] = weights(module)
            if isinstance(plugin, ResblockScalingPrecision):
                skipped[label] = plugin.scales.skipped
        params = {k for k, _ in module.named_parameters()}
        results[name] = {"steps": STEPS, "resblock_fp16_skipped_updates": skipped["resblock_fp16"]}
        for label, (a, b) in {"resblock_fp16_vs_16_mixed": ("resblock_fp16", "16-mixed"),
                              "resblock_fp16_vs_fp32": ("resblock_fp16", "fp32"),
                              "16_mixed_vs_fp32": ("16-mixed", "fp32")}.items():
            for part, keys in {"parameters": params, "buffers": set(got[a]) - params}.items():
                if keys:
                    diff, key = worst({k: got[a][k] for k in keys}, {k: got[b][k] for k in keys})
                    results[name][f"{label}/{part}"] = {"max_diff": diff, "where": key}
        initial = weights(Classifier(make))
        results[name]["fp32_moved/parameters"] = max_diff({k: got["fp32"][k] for k in params},
                                                          {k: initial[k] for k in params})
    (out / "precision.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    phase, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    {"strategy": strategy_run, "precision": precision_run}[phase](out_dir)
