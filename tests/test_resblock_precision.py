"""The per-resblock scaling precision plugin on deep residual models of its own, in fp16 on CPU.

References are independent of the plugin: fp32 gradients of the same model, ``torch.amp.GradScaler`` with the
same branches under autocast, and gradients worked out from the residual structure itself.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from dalle_lightning_plugins.precision.resblock_precision import ResblockScalingPrecision
from tests.helpers.deep_residual import (DeepResidual, autocast_branches, branch_grads, cosine, plugin_update,
                                         regression_data, squared_error)
from tests.helpers.distributed import run_distributed


def _rel_err(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------ gradient fidelity
def test_per_block_scales_keep_every_block_where_one_global_scale_underflows() -> None:
    torch.manual_seed(0)
    model = DeepResidual()
    x, y = regression_data()
    model.zero_grad()
    squared_error(model, x, y).backward()
    reference = branch_grads(model)

    # One global scale, torch.amp.GradScaler at its defaults: the last blocks overflow until the scale fits them.
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model (and the fp32 reference) stay fixed
    scaler = torch.amp.GradScaler("cpu")
    global_grads = None
    with autocast_branches(model):
        for _ in range(8):
            opt.zero_grad()
            scaler.scale(squared_error(model, x, y)).backward()
            scaler.unscale_(opt)
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                global_grads = branch_grads(model)
            scaler.step(opt)
            scaler.update()
    assert global_grads is not None and scaler.get_scale() < 2**16  # it did have to back off
    global_cos = [cosine(g, r) for g, r in zip(global_grads, reference)]
    global_zeros = [(g == 0).double().mean().item() for g in global_grads]
    worst = min(range(len(global_cos)), key=global_cos.__getitem__)
    assert global_cos[worst] < 0.9 and global_zeros[worst] > 0.5, (global_cos, global_zeros)

    _check_per_block_scales_keep_every_block(model, x, y, reference)


def _check_per_block_scales_keep_every_block(
    model: DeepResidual, x: Tensor, y: Tensor, reference: list[Tensor]
) -> None:
    """Per-resblock scales: the paper's rules time-compressed (x2 growth per update instead of x2 per 1000, no
    cooldown) so the scales reach in ~40 updates the spread the paper's rules reach in ~11k."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plugin = ResblockScalingPrecision("fp16", growth_factor=2.0, cooldown=0)
    plugin.convert_module(model)
    per_block = None
    for _ in range(40):
        skipped = plugin.scales.skipped
        plugin_update(plugin, opt, model, x, y)
        if plugin.scales.skipped == skipped:
            per_block = branch_grads(model)
    plugin.teardown()
    assert per_block is not None
    log2 = plugin.scales.log2
    assert log2[0] - log2[-1] >= 8  # early blocks grew towards the cap, the last ones had to stay low
    cos = [cosine(g, r.to(g.device)) for g, r in zip(per_block, reference)]
    assert min(cos) >= 0.999, cos
    assert max(_rel_err(g, r.to(g.device)) for g, r in zip(per_block, reference)) < 1e-2  # unscaled, not just aligned
    assert max((g == 0).double().mean().item() for g in per_block) == 0.0


@pytest.mark.cuda
def test_per_block_scales_keep_every_block_on_cuda() -> None:
    """The same fidelity with fp16 branches under CUDA autocast (the paper's setting) against fp32 on the GPU."""
    torch.manual_seed(0)
    model = DeepResidual().cuda()
    x, y = (t.cuda() for t in regression_data())
    squared_error(model, x, y).backward()
    reference = branch_grads(model)
    model.zero_grad()
    _check_per_block_scales_keep_every_block(model, x, y, reference)


# ------------------------------------------------------------------------------------------ overflow filtering
def _adam_state(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [t.clone() for s in opt.state.values() for t in (s["step"], s["exp_avg"], s["exp_avg_sq"])]


def test_overflow_in_one_block_is_filtered_backed_off_and_skipped() -> None:
    torch.manual_seed(0)
    model = DeepResidual(depth=8, width=8, decay=0.5)
    x, y = regression_data(width=8, n=4)
    plugin = ResblockScalingPrecision("fp16", cooldown=125)
    plugin.convert_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = squared_error(model, x, y)
        loss.backward()
        return loss

    model.identity_grads = {}
    plugin.optimizer_step(opt, model, closure)  # a clean step: Adam has moments now
    clean = dict(model.identity_grads)
    k = 5
    assert not torch.equal(clean[k], clean[k + 1])  # normally block k's branch adds to its input's gradient
    params = [p.detach().clone() for p in model.parameters()]
    adam = _adam_state(opt)
    log2 = plugin.scales.log2.clone()

    model.blocks[k].branch.poison = "hidden"
    plugin.optimizer_step(opt, model, closure)
    grads = model.identity_grads
    # Block k's outgoing gradient was Inf (1e30 in fp16) and was filtered to exactly zero, so the identity path
    # below it carries the gradient from above unchanged, and every earlier block got finite gradients.
    assert torch.equal(grads[k], grads[k + 1])
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert plugin.scales.skipped == 1
    expected = log2.clone()
    expected[k] -= 0.5
    assert torch.equal(plugin.scales.log2, expected)  # only block k backed off (by 1/sqrt 2); nobody grew
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(opt), adam))  # moments and step count untouched
    assert all(p.grad is None for p in model.parameters())

    plugin.optimizer_step(opt, model, closure)  # overflows again with no update applied since: backs off again
    expected[k] -= 0.5  # within the cooldown, but the cooldown only protects a scale under which updates go through
    assert torch.equal(plugin.scales.log2, expected) and plugin.scales.skipped == 2
    model.blocks[k].branch.poison = None
    plugin.optimizer_step(opt, model, closure)
    assert torch.allclose(plugin.scales.log2, expected + math.log2(2 ** (1 / 1000)))
    assert not torch.equal(next(model.parameters()), params[0])  # clean again: it steps
    plugin.teardown()


def test_accumulated_micro_batches_share_one_scale() -> None:
    torch.manual_seed(0)
    model = DeepResidual(depth=4, width=8, decay=1.0)
    batches = [regression_data(width=8, n=4, seed=s) for s in (1, 2)]
    for x, y in batches:
        (squared_error(model, x, y) * 1e-3).backward()  # fp32 reference: the gradient of the sum of both micro-batches
    reference = branch_grads(model)
    model.zero_grad()
    plugin = ResblockScalingPrecision("fp16")
    plugin.convert_module(model)

    def accumulate() -> float:
        for x, y in batches:  # what Lightning does with accumulate_grad_batches=2: backward twice, step once
            (squared_error(model, x, y) * 1e-3).backward()
        return 0.0

    plugin.optimizer_step(torch.optim.SGD(model.parameters(), lr=0.0), model, accumulate)
    assert plugin.scales.skipped == 0
    assert max(_rel_err(g, r) for g, r in zip(branch_grads(model), reference)) < 1e-2
    plugin.teardown()


def test_each_optimizer_unscales_the_parameters_it_steps() -> None:
    """The per-block parameter groups are cached per optimizer: a second optimizer that leaves one block's
    branch out (frozen, or stepped elsewhere) must leave exactly that block's gradients as the backward left them."""
    torch.manual_seed(0)
    model = DeepResidual(depth=4, width=8, decay=1.0)
    x, y = regression_data(width=8, n=4)
    (squared_error(model, x, y) * 1e-3).backward()
    reference = branch_grads(model)  # fp32
    model.zero_grad()
    plugin = ResblockScalingPrecision("fp16")
    plugin.convert_module(model)

    def backward() -> float:
        model.zero_grad()
        (squared_error(model, x, y) * 1e-3).backward()
        return 0.0

    plugin.optimizer_step(torch.optim.SGD(model.parameters(), lr=0.0), model, backward)
    assert max(_rel_err(g, r) for g, r in zip(branch_grads(model), reference)) < 1e-2
    frozen = {id(p) for p in model.blocks[1].branch.parameters()}
    others = torch.optim.SGD([p for p in model.parameters() if id(p) not in frozen], lr=0.0)
    scale = float(plugin.scales.scales()[1])  # what block 1's backward multiplies by in the next step
    plugin.optimizer_step(others, model, backward)
    grads = branch_grads(model)
    assert _rel_err(grads[1], reference[1] * scale) < 1e-2  # left as the backward scaled it
    assert max(_rel_err(grads[i], reference[i]) for i in (0, 2, 3)) < 1e-2
    plugin.teardown()


def test_bf16_branches_match_fp32_and_bad_config_raises() -> None:
    torch.manual_seed(0)
    model = DeepResidual(depth=4, width=8, decay=0.0)
    x, y = regression_data(width=8, n=4)
    squared_error(model, x, y).backward()
    reference = branch_grads(model)
    model.zero_grad()
    plugin = ResblockScalingPrecision("bf16")
    plugin.convert_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plugin.optimizer_step(opt, model, lambda: squared_error(model, x, y).backward() or 0.0)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert min(cosine(g, r) for g, r in zip(branch_grads(model), reference)) > 0.99  # bf16: 8-bit mantissa
    plugin.teardown()
    with pytest.raises(ValueError, match="dtype"):
        ResblockScalingPrecision("fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="declares no resblocks"):
        ResblockScalingPrecision().convert_module(nn.Sequential(nn.Linear(2, 2)))


def test_hydra_config_gives_the_paper_rules() -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "precision" / "resblock16.yaml")
    plugin = instantiate(conf)
    assert isinstance(plugin, ResblockScalingPrecision) and plugin.dtype == torch.float16
    assert plugin.rules == ResblockScalingPrecision().rules  # the config spells out the defaults: the paper's
    assert plugin.rules.growth_factor == 2 ** (1 / 1000) and plugin.rules.cooldown == 125


# ------------------------------------------------------------------------------------- Lightning: fit, resume
class ResidualTask(pl.LightningModule):
    """A LightningModule declaring ``resblocks()``; optionally poisons one block at one step on one rank."""

    def __init__(self, poison_step: int | None = None, poison_block: int = 2, poison_where: str = "hidden",
                 poison_rank: int | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = DeepResidual(depth=4, width=8, decay=0.5)
        self.poison_step, self.poison_block = poison_step, poison_block
        self.poison_where, self.poison_rank = poison_where, poison_rank
        self.lr = lr
        self.seen: dict[str, Any] = {}

    def resblocks(self) -> list[nn.Module]:
        return [b.branch for b in self.net.blocks]

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        armed = self.global_step == self.poison_step and self.poison_rank in (None, self.global_rank)
        self.net.blocks[self.poison_block].branch.poison = self.poison_where if armed else None
        return squared_error(self.net, *batch) / len(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*regression_data(width=8, n=64)), batch_size=4)

    def on_train_start(self) -> None:
        self.seen["start_state"] = self.trainer.precision_plugin.state_dict()
        self.seen["start_params"] = [p.detach().clone() for p in self.parameters()]


def _trainer(plugin: ResblockScalingPrecision, max_steps: int, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def test_trainer_fit_logs_and_checkpoint_resume_continues_the_scales(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin = ResblockScalingPrecision("fp16")
    task = ResidualTask(poison_step=1, poison_block=2)
    trainer = _trainer(plugin, 3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(task)
    # 3 update attempts: finite, overflow in block 2 (skip, back off), finite -- worked out from the rules.
    g = math.log2(2 ** (1 / 1000))
    assert plugin.scales.log2.tolist() == pytest.approx([13 + 2 * g, 13 + 2 * g, 12.5 + 2 * g, 13 + 2 * g])
    assert (plugin.scales.updates, plugin.scales.skipped) == (3, 1)
    assert plugin.scales.names == [f"net.blocks.{i}.branch" for i in range(4)]
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    key = "precision/log2_scale/net.blocks.2.branch"
    logged = [float(r[key]) for r in rows if r.get(key)]
    assert logged[-1] == pytest.approx(12.5 + 2 * g) and float(rows[-1]["precision/skipped_updates"]) == 1.0
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = plugin.state_dict()

    resumed_plugin = ResblockScalingPrecision("fp16")
    resumed = ResidualTask()
    _trainer(resumed_plugin, 4).fit(resumed, ckpt_path=ckpt)
    assert resumed.seen["start_state"] == saved  # resumed with the same scales, cooldown clocks and counters
    assert resumed_plugin.scales.log2.tolist() == pytest.approx([x + g for x in saved["log2"]])
    assert resumed_plugin.scales.updates == 4


# ------------------------------------------------------------------------------- distributed: FSDP2 and DDP
def _fsdp2_grads(world_size: int, convert_first: bool) -> list[float]:
    """Branches as FSDP2 units (sharded DTensor gradients), hooks installed before or after ``fully_shard``
    (the project's sharding strategy converts first, Lightning's ModelParallelStrategy after). Returns each
    block's relative gradient error against the same model in fp32 without FSDP (same data on every rank)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = DeepResidual(depth=4, width=8, decay=2.0)
    reference = copy.deepcopy(model)
    x, y = regression_data(width=8, n=4)
    (squared_error(reference, x, y) * 1e-3).backward()
    plugin = ResblockScalingPrecision("fp16")
    if convert_first:
        plugin.convert_module(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block.branch, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not convert_first:
        plugin.convert_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plugin.optimizer_step(opt, model, lambda: (squared_error(model, x, y) * 1e-3).backward())
    assert plugin.scales.replicas == 1 and plugin.scales.skipped == 0  # FSDP averages: M = 1
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    errors = []
    for block, ref in zip(model.blocks, reference.blocks):
        g = torch.cat([p.grad.full_tensor().flatten() for p in block.branch.parameters()])
        errors.append(_rel_err(g, torch.cat([p.grad.flatten() for p in ref.branch.parameters()])))
    return errors


def _distributed_worker(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 first, then Lightning DDP in the same processes (one start-up cost).

    DDP: rank 0 alone overflows at a branch *input* (parameter gradients stay finite), so only its filter sees
    it: without the flag all-reduce rank 1 would step and the replicas would diverge."""
    import os

    fsdp_errors = [_fsdp2_grads(world_size, convert_first) for convert_first in (True, False)]
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # externally launched: Lightning joins our group
    torch.manual_seed(0)
    plugin = ResblockScalingPrecision("fp16")
    task = ResidualTask(poison_step=0, poison_block=1, poison_where="input", poison_rank=0, lr=0.1)
    _trainer(plugin, 2, devices=world_size, strategy="ddp").fit(task)
    start = task.seen["start_params"]
    return {
        "fsdp_errors": fsdp_errors,
        "replicas": plugin.scales.replicas,
        "log2": plugin.scales.log2.tolist(),
        "skipped": plugin.scales.skipped,
        "moved": [not torch.equal(p, q) for p, q in zip(task.parameters(), start)],
        "params": [p.detach().clone() for p in task.parameters()],
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_sharded_grads_and_ddp_ranks_skip_together() -> None:
    r0, r1 = run_distributed(_distributed_worker, 2, timeout=180)
    g = math.log2(2 ** (1 / 1000))
    for r in (r0, r1):
        assert max(max(e) for e in r["fsdp_errors"]) < 1e-2, r["fsdp_errors"]  # fp16 branches, unscaled shards
        assert r["replicas"] == 1 and r["skipped"] == 1  # DDP averages gradients: M = 1
        # Step 0 skipped on both ranks (block 1 backed off), step 1 applied (everyone grew once).
        assert r["log2"] == pytest.approx([13 + g, 12.5 + g, 13 + g, 13 + g])
        assert any(r["moved"])
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))  # replicas still identical


@pytest.mark.parametrize(("reduction", "expected"), [(None, 1), ("mean", 1), ("sum", 4)])
def test_replicas_follow_how_the_strategy_reduces_gradients(reduction: str | None, expected: int) -> None:
    """The paper's M * 2^13 assumes gradients summed over M replicas; averaged ones (every Lightning strategy)
    are M times smaller, so there M is 1. A strategy that sums says so with ``gradient_reduction = "sum"``."""
    from types import SimpleNamespace

    strategy = SimpleNamespace(world_size=4) if reduction is None else SimpleNamespace(world_size=4, gradient_reduction=reduction)
    model = DeepResidual(depth=2, width=4)
    model._trainer = SimpleNamespace(strategy=strategy)  # type: ignore[attr-defined]
    plugin = ResblockScalingPrecision("bf16")
    plugin.convert_module(model)
    assert plugin.scales.replicas == expected
    assert plugin.scales.scales()[0].item() == expected * 2.0**13
