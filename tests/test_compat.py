"""``dalle_lightning_plugins.compat``: each shim gives what torch's own API gives, on every supported torch.

The fallbacks exist for releases older than the API (2.9 to 2.12 lack ``set_reduce_scatter_unused_params``);
they are forced here on the newest release as well and compared with torch's own API, so a fallback is never
tested only where nothing checks it against the real thing. The reference is computed by hand in the test
process: ``ddp(find_unused_parameters=True)``'s average, where a rank that skipped a branch adds zeros.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dalle_lightning_plugins import compat
from tests.helpers.distributed import group_of_one, run_distributed

ROOT = Path(__file__).resolve().parents[1]

WORLD = 2
# (rank, micro-batch) -> whether that rank's forward takes the second branch of block 0
TAKES_BRANCH = {(0, 0): True, (1, 0): False, (0, 1): True, (1, 1): False}


class Block(nn.Module):
    """A branch inside an FSDP unit that only some ranks take: the unit's all-gather runs on every rank, but
    ``branch`` gets a gradient on those ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.branch = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        return torch.tanh(self.main(x)) + (self.branch(x) if take else 0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        return self.head(self.blocks[1](self.blocks[0](x, take), True)).pow(2).mean()


def batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + micro))


def _sharded_grads(rank: int, world_size: int, native: bool, micro_batches: int) -> dict[str, torch.Tensor]:
    """One step of ``Net`` sharded with FSDP2 over the 2 ranks (``micro_batches`` backwards, gradient sync on the
    last only), the unused-parameter rule set by the shim: every parameter's whole averaged gradient."""
    mesh = init_device_mesh("cpu", (world_size,))
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    compat.reduce_scatter_unused_params(net, native=native)
    assert isinstance(net, FSDPModule)
    for micro in range(micro_batches):
        net.set_requires_gradient_sync(micro == micro_batches - 1)
        net(batch(rank, micro), TAKES_BRANCH[(rank, micro)]).backward()
    grads = {name: p.grad.full_tensor() for name, p in net.named_parameters() if p.grad is not None}
    dist.barrier()
    return grads


def reference_grads(micro_batches: int) -> dict[str, torch.Tensor]:
    """``ddp(find_unused_parameters=True)``: the mean over ranks of each rank's summed gradient, zeros where a
    rank never used the parameter."""
    total: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        net = Net()
        for micro in range(micro_batches):
            net(batch(rank, micro), TAKES_BRANCH[(rank, micro)]).backward()
        for name, p in net.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            total[name] = total.get(name, 0) + g / WORLD
    return total


NATIVE = [pytest.param(True, marks=pytest.mark.skipif(not compat.HAS_REDUCE_SCATTER_UNUSED_PARAMS,
                                                      reason=f"torch {torch.__version__} has no "
                                                             "set_reduce_scatter_unused_params")),
          pytest.param(False, id="fallback")]


@pytest.mark.distributed
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one_backward", "accumulated"])
@pytest.mark.parametrize("native", NATIVE)
def test_unused_parameters_join_the_reduce_scatter_as_zeros(native: bool, micro_batches: int) -> None:
    """Rank 1 never takes block 0's branch: with the rule (torch's or the fallback) both ranks reduce-scatter
    the same buffers, and every gradient is ddp's average, the branch's half of rank 0's."""
    want = reference_grads(micro_batches)
    for got in run_distributed(_sharded_grads, WORLD, native, micro_batches, timeout=120):
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert want["blocks.0.branch.weight"].abs().sum() > 0  # the branch had a gradient to halve


def _fallback_installs_once(rank: int, world_size: int) -> list[int]:
    """Groups per unit, groups whose ``post_backward`` is the fallback around FSDP2's own method (not around a
    second fallback), and all groups."""
    mesh = init_device_mesh("cpu", (world_size,))
    net = Net()
    fully_shard(net.blocks[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    compat.reduce_scatter_unused_params(net, native=False)
    compat.reduce_scatter_unused_params(net, native=False)  # a later Trainer on the same model
    groups = [g for m in net.modules() if isinstance(m, FSDPModule)
              for g in compat.fsdp_param_groups(m._get_fsdp_state())]
    once = [g for g in groups if isinstance(g.post_backward, functools.partial)
            and not isinstance(g.post_backward.args[1], functools.partial)]
    return [len(compat.fsdp_param_groups(net.blocks[0]._get_fsdp_state())), len(once), len(groups)]


@pytest.mark.distributed
def test_the_fallback_wraps_each_parameter_group_once() -> None:
    """Calling the shim twice (a second Trainer on the same model) wraps ``post_backward`` once, not twice, and
    every unit has exactly its one parameter group on every supported release."""
    for unit_groups, wrapped_once, groups in run_distributed(_fallback_installs_once, WORLD, timeout=120):
        assert unit_groups == 1
        assert wrapped_once == groups == 2


@pytest.mark.parametrize(("version", "want"), [("2.11.0+cu130", (2, 11)), ("2.14.1", (2, 14)),
                                               ("2.12.0a0+git1234", (2, 12)), ("3.0.0.dev20270101+cpu", (3, 0))])
def test_torch_version_reads_major_and_minor(version: str, want: tuple[int, int]) -> None:
    assert compat.torch_version(version) == want


def test_the_version_table_matches_the_installed_torch() -> None:
    """The shims test for the API, not the number; this keeps the module's table true: 2.13 brought the API."""
    assert compat.HAS_REDUCE_SCATTER_UNUSED_PARAMS == (compat.TORCH_VERSION >= (2, 13))


# ---------------------------------------------------------------------------------------------------------------
# The private names behind compat's other functions: each function does on this release what its docstring says,
# checked against a value worked out by hand (tests/test_lightning_internals.py checks the names themselves).


def test_meta_tensors_are_materialised_by_their_own_reset() -> None:
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    compat.materialize_meta_tensors(layer, torch.device("cpu"))
    assert layer.weight.device.type == "cpu" and bool(layer.weight.abs().sum() > 0)
    assert float(layer.weight.abs().max()) <= 3 ** -0.5  # nn.Linear's own init: U(-1/sqrt(in), 1/sqrt(in))


def test_optimizer_state_moves_with_the_optimizers() -> None:
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    optimizer.step()
    compat.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[param]["momentum_buffer"].device.type == "meta"


def test_the_module_gets_the_mesh_it_reads() -> None:
    from lightning.pytorch import LightningModule

    module, mesh = LightningModule(), object()
    compat.set_module_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_a_scaler_told_of_an_overflow_skips_and_backs_off() -> None:
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    param.grad = torch.full((2,), 4.0)  # finite: the scaler alone would step
    scaler.unscale_(optimizer)
    compat.mark_scaler_overflow(scaler, optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert param.detach().equal(torch.ones(2)) and scaler.get_scale() == 2.0  # skipped; backoff 0.5


def test_after_closure_runs_the_hook_and_clips() -> None:
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1, bias=False)
            self.hooked = 0

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.hooked += 1

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, gradient_clip_val=0.5,
                        gradient_clip_algorithm="norm", enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module.layer.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5 -> clipped to norm 0.5
    compat.after_closure(trainer.precision_plugin, module, optimizer)
    assert module.hooked == 1
    torch.testing.assert_close(module.layer.weight.grad, torch.tensor([[0.3, 0.4]]), rtol=1e-4, atol=1e-6)


def test_the_launcher_reruns_the_script_as_ddps() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    launcher = compat.subprocess_script_launcher(LightningEnvironment(), 2, 1)
    assert launcher.num_processes == 2 and launcher.num_nodes == 1
    assert not launcher.is_interactive_compatible  # as strategy="ddp": it runs the script again


def test_op_argument_reads_the_async_flag_by_name() -> None:
    op = torch.ops.c10d.allreduce_.default
    names = ("async_op", "asyncOp")
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name in names)
    args = tuple(range(position)) + (False,)
    assert compat.op_argument(op, args, {}, names) is False
    assert compat.op_argument(op, args[:position], {}, names) is True  # the schema's default
    name = op._schema.arguments[position].name
    assert compat.op_argument(op, args[:position], {name: False}, names) is False
    assert compat.op_argument(op, args, {}, ("no_such_argument",)) is None


def test_dtensor_op_handlers_is_dtensors_own_table() -> None:
    handlers = compat.dtensor_op_handlers()
    assert torch.ops.aten.convolution.default in handlers  # torch's own entry (a convolution over DTensors)
    assert compat.dtensor_op_handlers() is handlers


def test_attached_trainer_is_the_modules_trainer_or_none() -> None:
    import lightning.pytorch as pl

    module = pl.LightningModule()
    assert compat.attached_trainer(module) is None and compat.attached_trainer(nn.Linear(1, 1)) is None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer is module.trainer


def test_tree_map_reaches_every_tensor_of_a_nesting() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    tree = {"x": torch.ones(2), "y": (torch.zeros(1), [torch.full((1,), 3.0)]), "z": Pair(torch.ones(1), 5)}
    out = compat.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, tree)
    assert isinstance(out["z"], Pair) and out["z"].b == 5
    torch.testing.assert_close(out["x"], torch.full((2,), 2.0))
    torch.testing.assert_close(out["y"][1][0], torch.full((1,), 6.0))
    torch.testing.assert_close(out["z"].a, torch.full((1,), 2.0))


def test_dynamo_config_holds_the_recompile_settings() -> None:
    config = compat.dynamo_config()
    assert isinstance(config.recompile_limit, int) and isinstance(config.fail_on_recompile_limit_hit, bool)
    before = config.recompile_limit
    try:
        config.recompile_limit = before + 1
        import torch._dynamo

        assert torch._dynamo.config.recompile_limit == before + 1  # the module torch.compile reads
    finally:
        config.recompile_limit = before


def test_amp_unscale_and_check_against_a_hand_computed_step() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found = torch.zeros(1)
    compat.amp_unscale_and_check(grads, found, torch.tensor([0.5]))
    torch.testing.assert_close(grads[0], torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(grads[1], torch.tensor([4.0]))
    assert found.item() == 0.0
    compat.amp_unscale_and_check([torch.tensor([1.0, float("inf")])], found, torch.tensor([1.0]))
    assert found.item() == 1.0


def test_gloo_options_carry_the_timeout() -> None:
    from datetime import timedelta

    options = compat.set_group_timeout(compat.gloo_options(), timedelta(seconds=7))
    assert isinstance(options, torch.distributed.ProcessGroupGloo._Options)  # type: ignore[attr-defined]
    assert options._timeout == timedelta(seconds=7)


def test_process_group_backend_as_the_strategy_says() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    assert compat.process_group_backend(DDPStrategy(process_group_backend="gloo")) == "gloo"
    strategy = ShardedPowerSGDStrategy(devices_per_node=1, process_group_backend="gloo")
    assert compat.process_group_backend(strategy) == "gloo"


def test_no_private_name_outside_compat() -> None:
    """Every private torch or Lightning name the plugins reach is reached here, in compat.py, and nowhere else:
    as an import or an attribute, or by its name in a string (``getattr(module, "_trainer")``, ``vars(x)["_y"]``)."""
    from tests.test_lightning_internals import private_attributes, private_imports

    plugins = ROOT / "strategies" / "dalle_lightning_plugins"
    others = sorted(p for p in plugins.rglob("*.py") if p.name != "compat.py")
    assert len(others) > 30
    found = {str(p.relative_to(plugins)): private_imports([p]) + private_attributes([p]) + private_strings(p)
             for p in others}
    assert {k: v for k, v in found.items() if v} == {}


# Calls that reach an attribute named by their second argument, and mapping methods that look a key up.
_BY_NAME = {"getattr", "setattr", "hasattr", "delattr", "__getattribute__", "__getattr__", "__setattr__", "__delattr__"}
_LOOKUPS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


def private_strings(path: Path) -> list[tuple[str, str]]:
    """``(how, name)`` of every private name reached by a string in ``path``: the name given to ``getattr``,
    ``setattr``, ``hasattr``, ``delattr`` (or ``object.__setattr__`` ...) and a key looked up in an object's
    ``__dict__`` or ``vars(...)``, written out or as a module-level constant."""
    import ast

    from tests.test_lightning_internals import _private

    tree = ast.parse(path.read_text(), filename=str(path))
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def name_of(arg: ast.expr | None) -> str | None:
        value = arg.value if isinstance(arg, ast.Constant) else constants.get(arg.id) if isinstance(arg, ast.Name) \
            else None
        return value if isinstance(value, str) and _private(value) else None

    def is_namespace(node: ast.expr) -> bool:  # x.__dict__ or vars(x)
        return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")

    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in _BY_NAME and len(node.args) >= 2 and (name := name_of(node.args[1])):
                found.add((called, name))
            elif isinstance(func, ast.Attribute) and called in _LOOKUPS and is_namespace(func.value) and node.args \
                    and (name := name_of(node.args[0])):
                found.add((f"__dict__.{called}", name))
        elif isinstance(node, ast.Subscript) and is_namespace(node.value) and (name := name_of(node.slice)):
            found.add(("__dict__[]", name))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(is_namespace(c) for c in node.comparators) and (name := name_of(node.left)):
            found.add(("in __dict__", name))
    return sorted(found)


def test_private_strings_are_found() -> None:
    """The string forms the guard reads, each found in a file written for it, and public names left alone."""
    import tempfile

    source = '''
HIDDEN = "_carried"
a = getattr(module, "_trainer", None)
setattr(module, "_x", 1)
hasattr(strategy, HIDDEN)
delattr(module, "_y")
object.__setattr__(module, "_z", 2)
module.__dict__.get("_w")
vars(module)["_v"]
"_u" in module.__dict__
module.__dict__.pop(HIDDEN, None)
getattr(module, "trainer")
getattr(module, "__class__")
module.__dict__.get("forward")
'''
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sample.py"
        path.write_text(source)
        assert private_strings(path) == sorted([
            ("getattr", "_trainer"), ("setattr", "_x"), ("hasattr", "_carried"), ("delattr", "_y"),
            ("__setattr__", "_z"), ("__dict__.get", "_w"), ("__dict__[]", "_v"), ("in __dict__", "_u"),
            ("__dict__.pop", "_carried")])


def test_a_strategys_timeout() -> None:
    """``DDPStrategy(timeout=...)`` and the plugins' ``timeout=``, as given; None for a strategy without one."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from dalle_lightning_plugins import ShardedPowerSGDStrategy

    assert compat.strategy_timeout(DDPStrategy(timeout=timedelta(seconds=7))) == timedelta(seconds=7)
    assert compat.strategy_timeout(ShardedPowerSGDStrategy(devices_per_node=1, timeout=9)) == timedelta(seconds=9)
    assert compat.strategy_timeout(SingleDeviceStrategy("cpu")) is None


def test_recomputation_stop_is_what_non_reentrant_checkpointing_raises_early() -> None:
    """A non-reentrant checkpoint with early stopping stops its recomputation by raising the class compat names:
    a saved-tensor hook that records what passes through it sees the recomputed forward cut short."""
    import torch.utils.checkpoint as checkpoint

    [error] = compat.recomputation_stop_errors()
    assert error.__name__ == "_StopRecomputationError" and issubclass(error, Exception)
    raised: list[type] = []
    original = error.__init__

    def spy(self: BaseException, *args: object) -> None:
        raised.append(type(self))
        original(self, *args)

    error.__init__ = spy  # type: ignore[method-assign]
    try:
        x = torch.ones(3, requires_grad=True)
        with checkpoint.set_checkpoint_early_stop(True):
            y = checkpoint.checkpoint(lambda t: (t.sin() * 2).cos().exp(), x, use_reentrant=False)
        y.sum().backward()
    finally:
        error.__init__ = original  # type: ignore[method-assign]
    assert raised == [error]


def _process_group_names(rank: int, world_size: int) -> dict[str, object]:
    """compat's process-group helpers on a real world: ddp's reduce, and joining a group that exists."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    compat.init_dist_connection(LightningEnvironment(), "gloo")  # one exists: nothing happens
    value = torch.tensor([float(rank + 1)])
    return {"mean": compat.sync_ddp_if_available(value.clone(), None, "mean"),
            "sum": compat.sync_ddp_if_available(value.clone(), None, "sum"),
            "world": dist.get_world_size()}


@pytest.mark.distributed
def test_lightnings_reduce_and_connection_as_ddp() -> None:
    for got in run_distributed(_process_group_names, WORLD, timeout=60, start_method="fork"):
        assert got["world"] == WORLD
        torch.testing.assert_close(got["mean"], torch.tensor([1.5]))  # (1 + 2) / 2
        torch.testing.assert_close(got["sum"], torch.tensor([3.0]))


def _materialised_shards(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = nn.Linear(4, 4, bias=False)
    fully_shard(layer, mesh=init_device_mesh("cpu", (world_size,)))
    compat.materialize_distributed_module(layer, torch.device("cpu"))
    local = layer.weight.to_local()  # type: ignore[attr-defined]
    assert local.device.type == "cpu"
    return [float(local.abs().max()), float(local.abs().sum())]


@pytest.mark.distributed
def test_a_sharded_meta_module_is_materialised_on_its_shards() -> None:
    for largest, total in run_distributed(_materialised_shards, WORLD, timeout=60, start_method="fork"):
        assert 0 < total and largest <= 0.5  # nn.Linear's init, U(-1/sqrt(4), 1/sqrt(4)), on each rank's shard


def _outside_forward(rank: int, world_size: int, register: bool) -> tuple[bool, torch.Tensor]:
    """A loss from the unit's gathered weight outside its forward; returns whether the unit is sharded again after
    the backward and the sharded parameter's (full) gradient."""
    torch.manual_seed(0)
    net = nn.Linear(2, 2, bias=False)
    fully_shard(net, mesh=init_device_mesh("cpu", (world_size,)))
    x = torch.ones(3, 2)
    net(x).sum().backward()  # FSDP2 initialises at its first forward
    net.zero_grad()
    net.unshard()
    loss = torch.nn.functional.linear(x, net.weight).sum()
    if register:
        compat.register_root_pre_backward(net, loss)  # type: ignore[arg-type]
    loss.backward()
    weight = net.weight
    grad = weight.grad.full_tensor() if hasattr(weight.grad, "full_tensor") else weight.grad
    return hasattr(weight, "full_tensor"), grad


@pytest.mark.distributed
def test_the_root_pre_backward_hook_reduces_a_loss_from_outside_the_forward() -> None:
    """Without the hook FSDP2 never runs its post-backward (the unit stays gathered, the gradient on the gathered
    weight); with it the unit is resharded and its shard holds the gradient, by hand d(sum(x W^T))/dW = 3."""
    # fresh workers, not forked: a backward through FSDP2 earlier in this process (tests/test_lightning_internals.py's
    # unit, in the same pytest worker) leaves autograd's threads, which a forked child's backward cannot use
    [(sharded, grad)] = run_distributed(_outside_forward, 1, False, timeout=60)
    assert not sharded
    [(sharded, grad)] = run_distributed(_outside_forward, 1, True, timeout=60)
    assert sharded
    torch.testing.assert_close(grad, torch.full((2, 2), 3.0))


def test_averaged_model_is_the_weight_averaging_callbacks_copy() -> None:
    """``WeightAveraging._average_model``: None before the callback's setup and for other callbacks; after it, the
    ``AveragedModel`` holding a copy of the module (what the strategy shards for a fit)."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
    from torch.optim.swa_utils import AveragedModel

    module = L.LightningModule()
    module.layer = nn.Linear(2, 2)
    callback = EMAWeightAveraging()
    assert compat.averaged_model(callback) is None
    callback.setup(None, module, "fit")  # type: ignore[arg-type]
    averaged = compat.averaged_model(callback)
    assert isinstance(averaged, AveragedModel) and averaged.module.layer.weight is not module.layer.weight
    torch.testing.assert_close(averaged.module.layer.weight, module.layer.weight)
    assert compat.averaged_model(ModelCheckpoint()) is None


def _store_between_ranks(rank: int, world_size: int) -> tuple[bool, str]:
    store = compat.default_store()
    if rank == 0:
        store.set("roll_call_probe", "rank 0 was here")
    dist.barrier()
    return store is not None, store.get("roll_call_probe").decode()


def test_default_store_is_the_store_every_rank_joined_through() -> None:
    """What one rank writes in ``compat.default_store()`` another reads there, without a collective (the roll call
    after an error relies on it); None where no process group is."""
    for found, seen in run_distributed(_store_between_ranks, WORLD, timeout=60, start_method="fork"):
        assert found and seen == "rank 0 was here"
    if not dist.is_initialized():
        assert compat.default_store() is None


def test_tensor_hook_count_counts_both_kinds_of_gradient_hook() -> None:
    p = nn.Parameter(torch.ones(3))
    assert compat.tensor_hook_count(p) == 0
    handle = p.register_hook(lambda g: g * 2)
    p.register_post_accumulate_grad_hook(lambda t: None)
    p.register_post_accumulate_grad_hook(lambda t: None)
    assert compat.tensor_hook_count(p) == 3
    handle.remove()
    assert compat.tensor_hook_count(p) == 2


class _NoLocalAttribute:
    """A release whose DTensor keeps its local tensor under another name: only ``to_local()`` answers."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def to_local(self) -> torch.Tensor:
        return self.local


def test_local_tensor_is_to_local_s_storage_or_falls_back_to_it() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with group_of_one():
        whole = torch.arange(6.0).reshape(3, 2)
        sharded = distribute_tensor(whole, init_device_mesh("cpu", (1,)), [Shard(0)])
        local = compat.local_tensor(sharded)
        assert type(local) is torch.Tensor and local.data_ptr() == sharded.to_local().data_ptr()
        assert torch.equal(local, whole)
        plain = torch.ones(2)
        assert compat.local_tensor(_NoLocalAttribute(plain)) is plain


def test_undo_fully_shard_leaves_the_module_as_built_and_redo_shards_it_again() -> None:
    """What ``fully_shard`` puts on a module (class, forward hooks, state-dict hooks, ``__dict__`` entries, the state
    registry) is gone after ``undo_fully_shard``, and ``redo`` puts all of it back: the unit then trains and
    saves a state dict as before (a checkpoint saved after a stage)."""
    from torch.distributed import _composable_state

    def marks(m: nn.Module) -> tuple:
        hooks = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks", "_state_dict_hooks")
        return type(m), sorted(vars(m)), [len(getattr(m, h)) for h in hooks]

    with group_of_one():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        built = {name: marks(m) for name, m in net.named_modules()}
        classes = {name: type(m) for name, m in net.named_modules()}
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        net(torch.randn(4, 2)).sum().backward()  # lazy init: the parameter groups' state-dict hooks are registered
        sharded = {name: marks(m) for name, m in net.named_modules()}
        params = {n: p for n, p in net.named_parameters()}
        plain = {n: nn.Parameter(p.full_tensor().detach().clone()) for n, p in params.items()}
        for name, p in plain.items():  # the user's own parameters back, as InPlace does
            owner, _, leaf = name.rpartition(".")
            net.get_submodule(owner)._parameters[leaf] = p
        redo = [compat.undo_fully_shard(m, classes[n]) for n, m in net.named_modules()]
        assert {name: marks(m) for name, m in net.named_modules()} == built
        assert net not in _composable_state._module_state_mapping and not isinstance(net, FSDPModule)
        for name, p in params.items():
            owner, _, leaf = name.rpartition(".")
            net.get_submodule(owner)._parameters[leaf] = p
        for undo in redo:
            undo()
        assert {name: marks(m) for name, m in net.named_modules()} == sharded
        net(torch.randn(4, 2)).sum().backward()
        assert sorted(net.state_dict()) == sorted(plain)
