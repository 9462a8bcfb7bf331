"""The stand-ins a sharded stage trains, in one process (``strategies/.../strategies/stand_ins.py``): made on the meta
device with ties kept, filled from the user's tensors, which give their storage back and get it again whole, with
their own objects. The sharded cycle on 2 processes is ``tests/test_stage_memory.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dalle_lightning_plugins.strategies import stand_ins


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.dec = nn.Linear(4, 3)
        self.dec.weight = nn.Parameter(torch.randn(3, 4))
        self.head = nn.Linear(4, 4)
        self.head.weight = self.enc[0].weight  # tied between children
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.own = nn.Parameter(torch.ones(2))


def test_stand_ins_are_meta_twins_with_the_ties_and_flags_of_the_users() -> None:
    torch.manual_seed(0)
    module = Tied()
    children = dict(module.named_children())
    originals = stand_ins.make_stand_ins(module)
    assert originals == children  # the user's own children, by name
    assert all(getattr(module, n) is not c for n, c in children.items())
    tensors = [*module.parameters(recurse=True), *module.buffers()]
    assert all(t.is_meta for t in tensors if t is not module.own) and not module.own.is_meta
    assert module.head.weight is module.enc[0].weight  # the tie, between the stand-ins
    assert not module.frozen.weight.requires_grad and module.enc[0].weight.requires_grad
    assert all(not t.is_meta for c in children.values() for t in [*c.parameters(), *c.buffers()])


def test_a_module_parameter_tied_to_a_childs_is_refused_in_one_line() -> None:
    module = Tied()
    module.head_w = module.enc[0].weight
    with pytest.raises(ValueError, match=r"^ShardedPowerSGDStrategy\(devices_per_node=2\): Tied.head_w is enc.0.weight "
                                         r"\(one tensor registered on the LightningModule and in a child\)"):
        stand_ins.make_stand_ins(module)
    assert isinstance(module.enc[0], nn.Linear) and not module.enc[0].weight.is_meta  # nothing swapped


def test_released_tensors_come_back_whole_in_their_own_objects() -> None:
    torch.manual_seed(0)
    module = Tied()
    before = {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    ids = {n: id(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    root, originals, released = _stage(module)
    for name, value in [*root.named_parameters(), *root.named_buffers()]:
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert all(t.untyped_storage().nbytes() == 0 for c in originals.values() for t in [*c.parameters(), *c.buffers()])
    with torch.no_grad():
        root.enc[0].weight.add_(1.0)  # what the stage trained
    stand_ins.put_back(module, originals)
    stand_ins.give_back(root, released, torch.device("cpu"))
    assert {n: id(t) for n, t in [*module.named_parameters(), *module.named_buffers()]} == ids
    assert module.head.weight is module.enc[0].weight
    torch.testing.assert_close(module.enc[0].weight, before["enc.0.weight"] + 1, rtol=0, atol=0)
    torch.testing.assert_close(module.dec.weight, before["dec.weight"], rtol=0, atol=0)
    assert not module.frozen.weight.requires_grad


def _stage(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module], dict[str, stand_ins.Released]]:
    """A stage's stand-ins in one process (whole tensors stand for the shards): made, filled, the user's released."""
    originals = stand_ins.make_stand_ins(module)
    root = nn.Module()
    for name in originals:
        root.add_module(name, getattr(module, name))
    for tensor in {id(t): t for t in [*root.parameters(), *root.buffers()]}.values():  # ties kept (to_empty's aren't)
        stand_ins.assign(tensor, torch.empty_like(tensor, device="cpu"))
    stand_ins.fill_shards(root, originals)
    object.__setattr__(root, "originals", originals)
    return root, originals, stand_ins.release(originals)


def test_after_an_error_each_rank_puts_back_what_it_holds_without_a_collective() -> None:
    torch.manual_seed(0)
    module = Tied()
    root, originals, released = _stage(module)
    with torch.no_grad():
        root.enc[0].weight.mul_(2.0)
    trained = {n: t.detach().clone() for n, t in [*root.named_parameters(), *root.named_buffers()]}
    stand_ins.put_back(module, originals)
    assert stand_ins.restore_locally(root, released, torch.device("cpu"))  # something had been released
    assert module.head.weight is module.enc[0].weight  # the tie survives
    got = dict([*module.named_parameters(), *module.named_buffers()])
    for name, value in trained.items():  # a tensor this rank holds whole comes back with its trained value
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def test_a_meta_tensor_given_back_keeps_its_object() -> None:
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    weight = layer.weight
    stand_ins.assign(weight, torch.full((2, 3), 2.0))
    assert layer.weight is weight and not weight.is_meta and weight.requires_grad
    assert torch.equal(weight.detach(), torch.full((2, 3), 2.0))
