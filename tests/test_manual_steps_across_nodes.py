"""Issue 74, deliverable 4: manual optimization on 2 nodes x 2 devices averages each set of gradients once.

Under ``ddp`` a backward averages the gradients once, however many ``opt.step()`` calls follow it. Under
``ShardedPowerSGDStrategy`` (PowerSGD between nodes at full rank, ``overlap`` at its default) the same must hold:
one inter-node exchange per set of gradients (one ``manual_backward``, or two accumulated before one step), taken
by whichever optimizer steps first, for every parameter; not one per ``opt.step()``, which compressed and
error-fed every gradient again. One fit under ``ddp`` and one under the strategy, in one launch of 4 gloo processes
(start-up is the expensive part), each training step a pattern of its own: two optimizers each stepped once after
one backward (a GAN, or a backbone and a head), one optimizer stepped twice after one backward, and two
``manual_backward`` accumulated before the steps. Every parameter must be within 1e-4 of ``ddp``'s on every rank,
the four ranks (which agree under ``ddp``) bit for bit, and the exchanges counted (calls of the inter-node
reduction) must be one per set of gradients.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor

from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import WIDTH, TinyResNet, external_launch_env, loader, loss_fn, token_dataset, trainer

WORLD, PER_NODE = 4, 2
PATTERNS = ("two_optimizers", "one_optimizer_twice", "accumulated")  # training step i runs PATTERNS[i]


class ManualSteps(L.LightningModule):
    """TinyResNet under manual optimization, one optimizer for the blocks and one for the rest; each training
    step's pattern says how gradients and steps follow each other."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = TinyResNet()
        self.gradient_sets = 0  # sets of gradients the steps used: one per training step

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        blocks, rest = self.optimizers()
        pattern = PATTERNS[batch_idx]
        if pattern == "accumulated":  # two halves, each backward adding to the gradients, then the steps
            for half in (slice(0, 1), slice(1, 2)):
                self.manual_backward(loss_fn(self.model, tokens[half], targets[half]) / 2)
        else:
            self.manual_backward(loss_fn(self.model, tokens, targets))
        if pattern == "one_optimizer_twice":  # the same gradients stepped on twice
            blocks.step()
        blocks.step()
        rest.step()
        blocks.zero_grad()
        rest.zero_grad()
        self.gradient_sets += 1

    def configure_optimizers(self) -> Any:
        blocks = list(self.model.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [torch.optim.SGD(blocks, lr=0.3, momentum=0.9), torch.optim.SGD(rest, lr=0.2)]


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.detach().float().cpu().clone()
    return out


def _fit(layout: str, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = ManualSteps()
    calls: list[int] = []  # per exchange, the training step it ran in
    if layout == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    else:  # full PowerSGD rank (every matrix side is at most 2 * WIDTH): the exact average; overlap="auto"
        strategy = ShardedPowerSGDStrategy(devices_per_node=PER_NODE, powersgd_rank=2 * WIDTH, min_compression=0.0,
                                           timeout=90)
        reduce = strategy.inter_node.reduce

        def counting(*args: Any, **kwargs: Any) -> bool:
            calls.append(module.gradient_sets)
            return reduce(*args, **kwargs)

        strategy.inter_node.reduce = counting
    trainer(strategy, devices=WORLD, max_epochs=1, limit_train_batches=len(PATTERNS)).fit(
        module, loader(token_dataset(), rank, batch_size=2, world_size=WORLD))
    return {"weights": _weights(module), "exchanges": calls, "gradient_sets": module.gradient_sets}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    external_launch_env(rank)
    return {layout: _fit(layout, rank) for layout in ("ddp", "sharded")}


@pytest.mark.slow
@pytest.mark.distributed  # spawns 4 gloo processes: 2 nodes of 2
def test_manual_steps_average_each_set_of_gradients_once() -> None:
    results = run_distributed(_worker, WORLD, timeout=240)
    ours, ref = [r["sharded"] for r in results], [r["ddp"] for r in results]
    assert [o["gradient_sets"] for o in ours] == [len(PATTERNS)] * WORLD
    for rank, o in enumerate(ours):  # one inter-node exchange per set of gradients, not per opt.step()
        assert o["exchanges"] == list(range(len(PATTERNS))), f"rank {rank}: exchanges in training steps {o['exchanges']}"
    for rank in range(WORLD):
        assert ref[rank]["weights"].keys() == ref[0]["weights"].keys()
        for name, want in ref[0]["weights"].items():
            torch.testing.assert_close(ref[rank]["weights"][name], want, atol=0, rtol=0)  # ddp's ranks agree
            torch.testing.assert_close(ours[rank]["weights"][name], ours[0]["weights"][name], atol=0, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r} vs rank 0, {n}: {m}")
            torch.testing.assert_close(ours[rank]["weights"][name], want, atol=1e-4, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n} vs ddp: {m}")
