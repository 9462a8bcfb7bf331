"""The strategy trains modules it was not written for, and refuses a mesh that does not tile the world.

2 simulated nodes x 2 devices: Lightning's own BoringModel (its single ``layer`` as the block) and a randomly
initialised torchvision resnet18 (``BasicBlock`` as the block class) each take two steps. In the same processes a
strategy asking for 3 devices per node in a world of 4 must fail with the clear mesh error.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from tests.helpers.distributed import run_distributed
from lightning.pytorch.demos.boring_classes import BoringModel
from tests.test_strategy_common import external_launch_env, trainer
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import resnet18

from dalle_lightning_plugins.strategies.mesh import mesh_shape
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy


class ResNetClassifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = resnet18(num_classes=10)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _replicas_equal(module: L.LightningModule, strategy: ShardedPowerSGDStrategy) -> bool:
    """All-gather a checksum of this rank's shards over the replicate group and compare."""
    # after fit the parameters are whole again (full_weights_after="auto"): all ranks then hold one model
    local = torch.stack([(p.to_local() if hasattr(p, "to_local") else p).double().sum() for p in module.parameters()])
    group = strategy.device_mesh["replicate"].get_group()
    gathered = [torch.empty_like(local) for _ in range(strategy.device_mesh["replicate"].size())]
    torch.distributed.all_gather(gathered, local, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _worker(rank: int, world_size: int) -> dict:
    external_launch_env(rank)
    out: dict = {}
    try:
        trainer(ShardedPowerSGDStrategy(devices_per_node=3), max_steps=1).fit(BoringModel())
    except ValueError as err:
        out["mismatch"] = str(err)

    torch.manual_seed(rank)  # different inits per rank: the strategy must align the replicas itself
    boring = BoringModel()
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_patterns=["layer"])
    fit = trainer(strategy, max_steps=2, use_distributed_sampler=True)
    fit.fit(boring)
    out["boring"] = (fit.global_step, strategy.block_names, _replicas_equal(boring, strategy))

    torch.manual_seed(0)
    net = ResNetClassifier()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    strategy = ShardedPowerSGDStrategy(devices_per_node=2, block_classes=["torchvision.models.resnet.BasicBlock"])
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.rand(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))
    fit = trainer(strategy, max_steps=2)
    fit.fit(net, DataLoader(data, batch_size=2))
    after = strategy.full_state_dict()
    changed = rank != 0 or all(not torch.equal(after[n], before[n]) for n in ("net.conv1.weight", "net.fc.weight"))
    out["resnet"] = (fit.global_step, len(strategy.block_names), _replicas_equal(net, strategy), changed)
    return out


def test_mesh_shape_rejects_worlds_it_cannot_tile() -> None:
    assert mesh_shape(8, 2) == (4, 2)
    with pytest.raises(ValueError, match="world size 6 is not a multiple of devices_per_node=4"):
        mesh_shape(6, 4)
    with pytest.raises(ValueError, match="devices_per_node=0"):
        mesh_shape(4, 0)


@pytest.mark.slow
@pytest.mark.distributed  # spawns gloo processes that each import torch and lightning
def test_trains_boring_model_and_resnet18_and_rejects_bad_mesh() -> None:
    results = run_distributed(_worker, 4, timeout=240)
    for r in results:
        assert "world size 4 is not a multiple of devices_per_node=3" in r["mismatch"]
        assert r["boring"] == (2, ["layer"], True)
        assert r["resnet"] == (2, 8, True, True)
