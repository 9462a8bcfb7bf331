"""In-place sharding of a stage (``strategies/.../strategies/in_place.py``, ``compat.undo_fully_shard``) on 2 gloo
processes: the user's children become FSDP2 units, their parameter objects give their storage back, and come back
whole (or, after an error, each rank's shard and NaN elsewhere) with the user's classes, hooks and ``__dict__``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dalle_lightning_plugins.strategies import in_place, plain_weights, sharding
from dalle_lightning_plugins.strategies.sharding import shard_in_place
from tests.helpers.distributed import run_distributed


class Tied(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.dec = nn.Linear(4, 3)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.enc[0].weight  # tied between children
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.own = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x)).sum() + self.head(x).sum() + self.own.sum() + self.frozen.weight.sum()


def _marks(module: nn.Module) -> dict[str, Any]:
    hooks = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
             "_load_state_dict_post_hooks", "_state_dict_hooks")
    return {name: (type(m), sorted(vars(m)), [len(getattr(m, h)) for h in hooks]) for name, m in module.named_modules()}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Tied()
    module.dec.weight.no_decay = True  # a user's mark, which configure_optimizers reads during the stage
    before = {n: t.detach().clone() for n, t in module.named_parameters()}
    ids = {n: id(t) for n, t in module.named_parameters(remove_duplicate=False)}
    marks = _marks(module)
    mesh = init_device_mesh("cpu", (world_size,))
    root = shard_in_place(module, lambda m: (m, [("dec", m.dec)]), mesh, torch.device("cpu"))
    out: dict[str, Any] = {
        "units": isinstance(module.dec, FSDPModule) and not isinstance(module.enc, FSDPModule),
        "sharded": all(isinstance(p, DTensor) for n, p in module.named_parameters() if n != "own"),
        "mark": getattr(module.dec.weight, "no_decay", False) and not hasattr(module.enc[0].weight, "no_decay"),
    }
    kept = root.originals
    out["released"] = all(k.tensor.untyped_storage().nbytes() == 0 for k in kept.kept.values())
    with torch.no_grad():
        module.enc[0].weight.add_(1.0)  # what the stage trained (on this rank's shard)
    module.frozen.requires_grad_(True)  # unfrozen in the stage: given back unfrozen
    root.remove_owner_hooks()  # the strategy's teardown (WholeWeights.leave)
    plain_weights.to_plain(root, torch.device("cpu"))
    out["same_objects"] = {n: id(t) for n, t in module.named_parameters(remove_duplicate=False)} == ids
    out["tie"] = module.head.weight is module.enc[0].weight
    out["trained"] = torch.equal(module.enc[0].weight.detach(), before["enc.0.weight"] + 1)
    out["dec"] = torch.equal(module.dec.weight.detach(), before["dec.weight"])
    out["unfrozen"] = module.frozen.weight.requires_grad
    out["marks"] = _marks(module) == marks
    out["forward"] = float(module(torch.randn(5, 3)))  # the plain module runs, as under ddp
    # a checkpoint after the stage: sharded again from the plain values, then plain again
    with torch.no_grad():
        module.dec.weight.mul_(2.0)
    plain_weights.from_plain(root)
    out["resharded"] = isinstance(module.dec, FSDPModule) and isinstance(module.dec.weight, DTensor)
    plain_weights.to_plain(root)
    out["round_trip"] = torch.equal(module.dec.weight.detach(), 2 * before["dec.weight"]) and _marks(module) == marks
    # after an error: each rank alone, its shard and NaN elsewhere, the tie kept
    module2 = Tied()
    root2 = shard_in_place(module2, lambda m: (m, [("dec", m.dec)]), mesh, torch.device("cpu"))
    root2.remove_owner_hooks()
    assert plain_weights.restore_after_error(root2, torch.device("cpu"))
    weight = module2.enc[0].weight.detach()
    out["holes"] = int(weight.isnan().sum()), int((~weight.isnan()).sum())
    out["tie_after_error"] = module2.head.weight is module2.enc[0].weight
    out["marks_after_error"] = _marks(module2) == marks
    # built on the meta device (init_module(empty_init=True)), then an error: the shards' values, no meta left
    with torch.device("meta"):
        module3 = Tied()
    root3 = shard_in_place(module3, lambda m: (m, [("dec", m.dec)]), mesh, torch.device("cpu"))
    root3.remove_owner_hooks()
    assert plain_weights.restore_after_error(root3, torch.device("cpu"))
    out["meta_after_error"] = [n for n, p in module3.named_parameters() if p.is_meta or n != "own" and p.isfinite().all()]
    # a failure while the stage is built (here after every unit is sharded): the values from before it, exactly
    torch.manual_seed(0)
    module4 = Tied()
    before4 = {n: t.detach().clone() for n, t in module4.named_parameters()}
    hooks4 = _marks(module4)
    compile_in_place = sharding.compile_in_place
    sharding.compile_in_place = _fail
    try:
        shard_in_place(module4, lambda m: (m, [("dec", m.dec)]), mesh, torch.device("cpu"))
    except RuntimeError:
        pass
    finally:
        sharding.compile_in_place = compile_in_place
    out["built_error"] = [n for n, t in module4.named_parameters() if not torch.equal(t.detach(), before4[n])]
    out["built_error_marks"] = _marks(module4) == hooks4
    return out


def _fail(*_: Any) -> None:
    raise RuntimeError("a failure while the stage is built")


@pytest.mark.distributed
def test_the_users_module_is_sharded_in_place_and_comes_back_plain() -> None:
    for out in run_distributed(_worker, 2, timeout=120):
        assert out["units"] and out["sharded"] and out["released"] and out["mark"], out
        assert out["same_objects"] and out["tie"] and out["trained"] and out["dec"] and out["unfrozen"], out
        assert out["marks"], "classes, hooks or __dict__ entries left on the user's modules"
        assert out["resharded"] and out["round_trip"], out
        assert out["holes"][0] > 0 and out["holes"][1] > 0 and out["tie_after_error"] and out["marks_after_error"], out
        assert out["meta_after_error"] == [], out["meta_after_error"]  # each rank's shard, NaN elsewhere: none whole
        assert out["built_error"] == [] and out["built_error_marks"], out["built_error"]


def test_a_module_parameter_tied_to_a_childs_is_refused_in_one_line() -> None:
    module = Tied()
    module.head_w = module.enc[0].weight
    with pytest.raises(ValueError, match=r"^ShardedPowerSGDStrategy\(devices_per_node=2\): Tied.head_w is enc.0.weight "
                                         r"\(one tensor registered on the LightningModule and in a child\)"):
        in_place.refuse_owner_ties(module, in_place.children_with_tensors(module), 2)


def test_a_meta_tensor_given_back_keeps_its_object() -> None:
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    weight = layer.weight
    in_place.assign(weight, torch.full((2, 3), 2.0))
    assert layer.weight is weight and not weight.is_meta and weight.requires_grad
    assert torch.equal(weight.detach(), torch.full((2, 3), 2.0))
