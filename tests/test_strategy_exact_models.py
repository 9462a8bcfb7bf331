"""The project's dVAE and prior under the strategy are exact data parallelism when PowerSGD cannot lose anything.

2 simulated nodes x 2 devices (4 gloo processes), fp32, SGD. At full PowerSGD rank (the rank of every gradient
matrix, so P Q'^T reproduces it) ``STEPS`` updates of each model land on the parameters of the same updates
taken in one process on the full batch (the four ranks' batches together), within 1e-5 relative. The
reference is independent of the strategy: a plain module, one process, no sharding.

A one-node mesh (1 x 4) at the default rank must be exact as well: with nobody to talk to between nodes,
PowerSGD must not approximate anything.

Randomness is taken out or made identical: the dVAE's Gumbel noise is switched off (a softmax at the same
temperature), the prior has no dropout and no caption dropout. The FSQ dVAE (the shapes world's default) has no
randomness; its rounding is per sample, so the batch split cannot change it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env, trainer

STEPS, BATCH, WORLD, LR = 3, 2, 4, 0.05


class Dicts(Dataset):
    """Batches as the project's modules expect them (dicts of tensors)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


@contextmanager
def no_gumbel_noise() -> Iterator[None]:
    """The relaxation without its noise (a softmax at the same temperature): reproducible on any batch split."""
    from dalle_lightning.models import dvae

    original = dvae.gumbel_softmax
    dvae.gumbel_softmax = lambda logits, tau, dim=1: (logits / tau).softmax(dim)
    try:
        yield
    finally:
        dvae.gumbel_softmax = original


def dvae_module() -> tuple[Any, Dataset]:
    from dalle_lightning.lit.dvae import DVAEModule
    from dalle_lightning.models.dvae import DiscreteVAE

    torch.manual_seed(0)
    model = DiscreteVAE(image_size=16, vocab_size=32, group_count=2, n_hid=8, n_blk_per_group=1, codebook_dim=16)
    module = DVAEModule(model, functools.partial(torch.optim.SGD, lr=LR), temperature=0.9, kl_weight=0.5)
    images = torch.rand(STEPS * BATCH * WORLD, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return module, Dicts(image=images)


def fsq_module() -> tuple[Any, Dataset]:
    from dalle_lightning.lit.dvae import DVAEModule
    from dalle_lightning.models.dvae_fsq import FSQVAE

    torch.manual_seed(0)
    model = FSQVAE(image_size=16, levels=[5, 4, 3], group_count=2, n_hid=8, n_blk_per_group=1, codebook_dim=16)
    module = DVAEModule(model, functools.partial(torch.optim.SGD, lr=LR))
    images = torch.rand(STEPS * BATCH * WORLD, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return module, Dicts(image=images)


def prior_module() -> tuple[Any, Dataset]:
    from dalle_lightning.lit.prior import PriorModule
    from dalle_lightning.models.prior import DallePrior

    torch.manual_seed(0)
    model = DallePrior(text_vocab_size=20, text_len=6, image_vocab_size=16, image_grid=4, n_layer=2, n_head=2, d_head=8)
    module = PriorModule(model, lambda params: torch.optim.SGD(params, lr=LR), caption_dropout=0.0)
    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH * WORLD
    return module, Dicts(text=torch.randint(0, 20, (n, 6), generator=g), image=torch.randint(0, 16, (n, 16), generator=g))


BUILDERS = {"dvae": dvae_module, "fsq": fsq_module, "prior": prior_module}


def rank_loader(dataset: Dataset, rank: int) -> DataLoader:
    """Rank r reads items r, r + 4, ...: each update's four rank batches together are items [8 s, 8 s + 8)."""
    return DataLoader(torch.utils.data.Subset(dataset, range(rank, len(dataset), WORLD)), batch_size=BATCH)


def _worker(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    external_launch_env(rank)
    out = {}
    runs = [("dvae", 2, 10_000), ("fsq", 2, 10_000), ("prior", 2, 10_000), ("prior_one_node", 4, 4)]
    for name, per_node, rank_r in runs:
        module, data = BUILDERS[name.split("_")[0]]()
        strategy = ShardedPowerSGDStrategy(devices_per_node=per_node, powersgd_rank=rank_r, min_compression=0.0)
        with no_gumbel_noise():
            trainer(strategy, max_steps=STEPS, precision="32-true").fit(module, rank_loader(data, rank))
        out[name] = strategy.full_state_dict()
        out[name + "_bytes"] = {"sent": torch.tensor(strategy.powersgd.stats.bytes_sent_total)}
    return out


def reference(name: str) -> dict[str, torch.Tensor]:
    """The same updates in one process, each on the union of the four ranks' batches."""
    module, data = BUILDERS[name]()
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    with no_gumbel_noise():
        for step in range(STEPS):
            _reference_step(module, opt, data, step)
    return {k: v.detach() for k, v in module.state_dict().items()}


def _reference_step(module: Any, opt: torch.optim.Optimizer, data: Dataset, step: int) -> None:
    items = range(step * BATCH * WORLD, (step + 1) * BATCH * WORLD)
    batch = next(iter(DataLoader(torch.utils.data.Subset(data, items), batch_size=BATCH * WORLD)))
    opt.zero_grad()
    module.training_step(batch, step).backward()
    opt.step()


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(got) == set(want), set(got) ^ set(want)
    return {k: float((got[k].float() - want[k].float()).norm() / want[k].float().norm().clamp_min(1e-12)) for k in want}


@pytest.mark.slow  # 4 gloo processes training the real models three times
@pytest.mark.distributed
def test_real_models_at_full_rank_equal_exact_data_parallelism() -> None:
    results = run_distributed(_worker, WORLD, timeout=400)
    for name in ("dvae", "fsq", "prior", "prior_one_node"):
        want = reference(name.split("_")[0])
        start = BUILDERS[name.split("_")[0]]()[0].state_dict()
        moved = max(relative_errors(want, {k: v.detach() for k, v in start.items()}).values())
        assert moved > 1e-3, f"{name}: the reference barely moved ({moved}); the comparison would say nothing"
        errors = relative_errors(results[0][name], want)
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-5, f"{name}: {worst} is {errors[worst]:.2e} away from exact data parallelism"
    assert int(results[0]["prior_one_node_bytes"]["sent"]) == 0  # one node: nothing crosses a node
    assert int(results[0]["prior_bytes"]["sent"]) > 0
