"""With PowerSGD's rank at least the smaller side of every matrix, a Lightning step is exact data parallelism.

2 simulated nodes x 2 devices. The reference is one process taking an SGD step on the full batch (the four
ranks' batches together); the sharded run must land on the same parameters within 1e-5, each rank must hold
only its dim-0 slice of every parameter, and the two replicas of each shard must be identical after every step.
With gradient accumulation over 2 micro-batches the result is still exact, while FSDP reduce-scatters and
PowerSGD communicates only once per update (on the final micro-batch).
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as L
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import TinyModule, TinyResNet, external_launch_env, loader, loss_fn, token_dataset, trainer

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

LR, STEPS, BATCH = 0.5, 2, 2


class ShardRecorder(L.Callback):
    """Copies this rank's local shard of every parameter after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.steps.append({n: p.to_local().detach().clone() for n, p in pl_module.named_parameters()})


def _worker(rank: int, world_size: int, activation_checkpointing: bool) -> dict:
    external_launch_env(rank)
    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    strategy = ShardedPowerSGDStrategy(
        devices_per_node=2, powersgd_rank=2 * 6, min_compression=0.0, activation_checkpointing=activation_checkpointing
    )
    recorder = ShardRecorder()
    trainer(strategy, max_steps=STEPS, callbacks=[recorder]).fit(module, loader(token_dataset(), rank, BATCH))
    stats = strategy.powersgd.stats

    torch.manual_seed(0)
    module = TinyModule(TinyResNet(), functools.partial(torch.optim.SGD, lr=LR))
    accumulating = ShardedPowerSGDStrategy(devices_per_node=2, powersgd_rank=12, min_compression=0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer(accumulating, max_steps=1, accumulate_grad_batches=2).fit(module, loader(token_dataset(), rank, BATCH))
    reduces = [e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")]
    return {
        "accumulated": accumulating.full_state_dict(),
        "accumulated_psgd_steps": accumulating.powersgd.stats.steps,
        "accumulated_reduces": reduces,
        "full": strategy.full_state_dict(),
        "shards": recorder.steps,
        "mesh": (strategy.device_mesh["replicate"].get_local_rank(), strategy.device_mesh["shard"].get_local_rank()),
        "sent": stats.bytes_sent_last_step,
        "uncompressed": stats.uncompressed_bytes_last_step,
        "blocks": strategy.block_names,
    }


def _reference(steps: int = STEPS, batch: int = BATCH) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyResNet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, targets = token_dataset().tensors
    world = 4
    for step in range(steps):
        # DistributedSampler(shuffle=False) gives rank r the items r, r + 4, ...; the full batch is their union.
        idx = torch.arange(step * batch * world, (step + 1) * batch * world)
        opt.zero_grad()
        loss_fn(model, tokens[idx], targets[idx]).backward()
        opt.step()
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_one_step_equals_exact_data_parallel_and_shards_are_consistent() -> None:
    results = run_distributed(_worker, 4, True, timeout=120)
    reference = _reference()

    full = results[0]["full"]
    assert set(full) == set(reference)
    for name, want in reference.items():
        torch.testing.assert_close(full[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")

    assert results[0]["blocks"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    # the compressed path was taken: full-rank factors cost more bytes than the plain gradient
    assert results[0]["sent"] > results[0]["uncompressed"] > 0

    by_coord = {r["mesh"]: r for r in results}
    assert set(by_coord) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for name, want in reference.items():
        rows = want.shape[0]
        per_shard = math.ceil(rows / 2)
        for shard in (0, 1):
            expected_rows = max(0, min(rows, (shard + 1) * per_shard) - shard * per_shard)
            for step in range(STEPS):
                a = by_coord[(0, shard)]["shards"][step][name]
                b = by_coord[(1, shard)]["shards"][step][name]
                assert a.shape[0] == expected_rows, (name, shard, a.shape)
                assert torch.equal(a, b), f"replicas of shard {shard} of {name} differ after step {step}"
        final = torch.cat([by_coord[(0, s)]["shards"][-1][name] for s in (0, 1)])
        torch.testing.assert_close(final, want, atol=1e-5, rtol=0)

    # one update from 2 micro-batches of 2 per rank == one SGD step on the first 16 items
    for name, want in _reference(steps=1, batch=2 * BATCH).items():
        torch.testing.assert_close(results[0]["accumulated"][name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    for r in results:
        assert r["accumulated_psgd_steps"] == 1
        # one reduce-scatter per FSDP unit (3 blocks + root) for the whole update, none for the first micro-batch
        assert len(r["accumulated_reduces"]) == 4, r["accumulated_reduces"]
