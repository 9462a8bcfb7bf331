"""The private names of other libraries the project relies on still exist, each checked by name.

``pyproject.toml`` pins ``lightning``, ``torch`` and the rest to the ranges they were tested with; a newer release
may move or drop a private helper without notice. Then this file fails first, naming the symbol, instead of a
training run failing halfway with an ``AttributeError`` deep in a strategy hook. Two kinds are found by reading
every source file of the project (``dalle_lightning/``, ``strategies/dalle_lightning_plugins/``,
``callbacks/dalle_lightning_callbacks/``, ``benchmarks/``), so a new one is checked without being listed here:

* private imports: ``from lightning.fabric.utilities.init import _materialize_meta_tensors``,
  ``from hydra._internal.utils import get_args_parser``;
* private attributes of imported modules: ``torch._foreach_norm``, ``wds.filters._shuffle``,
  ``open_clip.factory._rescan_model_configs``, ``dist.ProcessGroupGloo._Options``.

Private attributes of *instances* (``self._latest_update_step`` inherited from Lightning's EMA callback, a
``GradScaler``'s per-optimizer state) cannot be told from the project's own by reading, and are listed by hand.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("dalle_lightning", "strategies/dalle_lightning_plugins", "callbacks/dalle_lightning_callbacks",
               "benchmarks")
# the project's own packages, and the benchmark scripts' sibling modules (``from _peak import ...``)
OWN_PACKAGES = {"dalle_lightning", "dalle_lightning_plugins", "dalle_lightning_callbacks", "tests", "benchmarks"} | {
    p.stem for p in (ROOT / "benchmarks").glob("*.py")
}


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(paths: list[Path]) -> list[tuple[str, str]]:
    """``(module, name)`` of every import of another package's private module or name in ``paths``."""
    found: set[tuple[str, str]] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in OWN_PACKAGES:
                    continue
                private_module = any(_private(p) for p in node.module.split("."))
                found.update((node.module, a.name) for a in node.names if private_module or _private(a.name))
    return sorted(found)


def private_attributes(paths: list[Path]) -> list[tuple[str, str]]:
    """``(module, dotted.attribute)`` of every private attribute reached from an imported module in ``paths``
    (``torch._foreach_norm``; ``dist.ProcessGroupGloo._Options`` with ``import torch.distributed as dist``)."""
    found: set[tuple[str, str]] = set()
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}
        imported: dict[str, tuple[str, str]] = {}  # ``from torch.distributed.tensor import DTensor``: a class
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # ``from torch import distributed as dist``: a module reached by name
                    aliases.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
                    imported.setdefault(a.asname or a.name, (node.module, a.name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.insert(0, cur.attr)
                cur = cur.value
            if not isinstance(cur, ast.Name) or cur.id not in aliases or not any(_private(p) for p in chain):
                continue
            module = aliases[cur.id]
            if module.split(".")[0] in OWN_PACKAGES:
                continue
            if not _is_module(module):  # a class or function imported by name: ``DTensor._op_dispatcher``
                if cur.id not in imported:
                    continue
                module, owner = imported[cur.id]
                chain.insert(0, owner)
            # the whole chain: what follows a private part (``torch._dynamo.config.recompile_limit``) is private too
            found.add((module, ".".join(chain)))
    # a longer chain is checked part by part anyway: keep the longest of each
    return sorted(x for x in found if not any(o[0] == x[0] and o[1].startswith(x[1] + ".") for o in found))


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


SOURCES = sorted(p for folder in SOURCE_DIRS for p in (ROOT / folder).rglob("*.py"))
assert all(any((ROOT / folder).glob("*.py")) for folder in SOURCE_DIRS), "a source folder moved: update SOURCE_DIRS"


@pytest.mark.parametrize(("module", "name"), private_imports(SOURCES), ids=lambda v: str(v))
def test_private_import_exists(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), (
        f"{module}.{name}, which the project imports, is gone in the installed release; "
        "pin the package below this release or replace the helper"
    )


@pytest.mark.parametrize(("module", "name"), private_attributes(SOURCES), ids=lambda v: str(v))
def test_private_module_attribute_exists(module: str, name: str) -> None:
    value: object = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(value, part), f"{module} has no {name} in the installed release; the project relies on it"
        value = getattr(value, part)


def _owner(name: str) -> object:
    """An instance of a Lightning class (instance attributes are set in ``__init__``), or a torch module."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    makers = {
        "c10d.allreduce_": lambda: torch.ops.c10d.allreduce_.default,
        "Parameter": lambda: torch.nn.Parameter(torch.zeros(1)),
        "LightningModule": LightningModule,
        "LightningOptimizer": lambda: LightningOptimizer(optimizer),
        "Precision": Precision,
        "DDPStrategy": DDPStrategy,
        "EMAWeightAveraging": EMAWeightAveraging,
        "GradScaler": lambda: torch.amp.GradScaler("cpu"),
        "ProcessGroupGloo._Options": dist.ProcessGroupGloo._Options,  # type: ignore[attr-defined]
        "Module": torch.nn.Module,
        "ModelCheckpoint": ModelCheckpoint,
        "TQDMProgressBar": TQDMProgressBar,
        "RichProgressBar": RichProgressBar,
    }
    return makers[name]() if name in makers else importlib.import_module(name)


# Owner -> private attributes of its instances the project uses (module-level ones are found by the scan above).
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    # compat.set_module_device_mesh hands the strategy's mesh to the module; compat.attached_trainer:
    # ResblockScalingPrecision asks if a trainer is attached.
    "LightningModule": ("_device_mesh", "_trainer"),
    # ResblockScalingPrecision.optimizer_step and the strategy's GradScaler step run Lightning's hooks and clipping.
    "Precision": ("_after_closure",),
    # dalle_lightning_callbacks.ema.EMA keeps Lightning's update schedule in its parent's counters;
    # compat.averaged_model: the strategy shards Lightning's averaged copy as the module for a fit.
    "EMAWeightAveraging": ("_latest_update_step", "_latest_update_epoch", "_average_model"),
    # The strategy records an overflow found by PowerSGD on every rank, so update() backs the scale off alike.
    "GradScaler": ("_per_optimizer_states",),
    # compat.strategy_timeout (dalle_lightning_plugins.environments.elastic): the default group made before the
    # strategy would, with its timeout.
    "DDPStrategy": ("_timeout",),
    # compat.recomputation_stop_errors (dalle_lightning_plugins.fast_paths): checkpointing's early stop is control flow.
    "torch.utils.checkpoint": ("_StopRecomputationError",),
    # compat.compiled_call and compiled_in_place's regions (dalle_lightning_plugins.strategies.compiled_in_place): a module
    # compiled with Module.compile() is compiled around FSDP2's units for a stage, with the user's configuration.
    "Module": ("_compiled_call_impl", "_call_impl"),
    # compat.tensor_hook_count (dalle_lightning_plugins.strategies.sharding): a child's parameter with a gradient hook
    # is refused at a sharded stage, where FSDP2's parameter in its place would train without it.
    "Parameter": ("_backward_hooks", "_post_accumulate_grad_hooks"),
    # compat.set_group_timeout (dalle_lightning_plugins.strategies.mesh): the gloo groups' collective timeout.
    "ProcessGroupGloo._Options": ("_timeout",),
    # ShardedPowerSGDStrategy.backward: a loss from a forward outside the root's forward gets the root's
    # pre-backward hook, so FSDP2 reduce-scatters the root unit's gradients.
    "torch.distributed.fsdp": ("FSDPModule._get_fsdp_state",),
    "torch.distributed.fsdp._fully_shard._fsdp_state": ("FSDPState._register_pre_backward_hook",),
    # compat.op_argument: the async flag of a c10d op DTensor hands the raw collectives' rule, by its schema.
    "c10d.allreduce_": ("_schema.arguments",),
    # dalle_lightning_callbacks.paced_checkpoint.PacedCheckpoint saves by time through its parent's own steps.
    "ModelCheckpoint": ("_last_global_step_saved", "_should_skip_saving_checkpoint", "_save_topk_checkpoint",
                        "_save_last_checkpoint", "_monitor_candidates"),
    # dalle_lightning_callbacks.progress_bar: one bar over a step-bounded run's updates, through the bars' own steps.
    "TQDMProgressBar": ("_should_update",),
    "RichProgressBar": ("_add_task", "_update", "_update_metrics", "_initialize_train_progress_bar_id",
                        "_get_train_description", "train_progress_bar_id"),
    # dalle_lightning.run.exits.lost_peer_exit names a failure inside Lightning's SIGTERM handler by its frame.
    "lightning.pytorch.trainer.connectors.signal_connector": ("_SignalConnector._sigterm_notifier_fn",),
}


@pytest.mark.parametrize(
    ("owner", "name"), [(o, n) for o, names in PRIVATE_NAMES.items() for n in names], ids=lambda v: str(v)
)
def test_private_name_exists(owner: str, name: str) -> None:
    value = _owner(owner)
    for part in name.split("."):
        assert hasattr(value, part), f"{owner} has no {name} in the installed release; the plugins rely on it"
        value = getattr(value, part)


# FSDP2's instance attributes the plugins read or set (the ``reduce_scatter_unused_params`` fallback, the root's
# pre-backward hook and ``undo_fully_shard``, which gives the user's module back plain after a stage, of
# dalle_lightning_plugins.compat),
# checked on a real unit, on every tested torch. Dotted names are checked part by part. The parameter groups' own attribute moved in 2.13
# (``_fsdp_param_group`` -> ``_fsdp_param_groups``): compat.fsdp_param_groups reads either, and
# test_fsdp2_parameter_groups_are_found checks that the one of the installed release exists.
FSDP2_INSTANCE_NAMES: dict[str, tuple[str, ...]] = {
    "FSDPState": ("_register_pre_backward_hook", "_pre_forward_hook_handle", "_post_forward_hook_handle",
                  "_pre_forward", "_post_forward"),
    "FSDPParamGroup": ("fsdp_params", "post_backward", "reduce_grads", "_module_to_pre_save_state_dict_hook_handle",
                       "_module_to_pre_load_state_dict_hook_handle", "_register_state_dict_hooks"),
    "FSDPParam": ("unsharded_accumulated_grad", "_unsharded_param", "unsharded_param", "_post_load_hook_handle",
                  "reset_sharded_param", "_module_info.module"),
    # compat.local_tensor (the hook guard of dalle_lightning_plugins.strategies.shard_reads): a sharded parameter's
    # local tensor without to_local()'s autograd function.
    "DTensor": ("_local_tensor",),
}


@pytest.fixture(scope="module")
def fsdp_unit() -> Iterator[dict[str, object]]:
    """One real FSDP2 unit after a forward and a backward (a process group of one: gloo on an in-process store),
    with its state, its parameter group and its first parameter's ``FSDPParam``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dalle_lightning_plugins.compat import fsdp_param_groups
    from tests.helpers.distributed import group_of_one

    with group_of_one():
        net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        net(torch.randn(3, 2)).sum().backward()
        state = net._get_fsdp_state()  # type: ignore[operator]
        groups = fsdp_param_groups(state)
        yield {"FSDPState": state, "FSDPParamGroup": groups[0], "FSDPParam": groups[0].fsdp_params[0],
               "DTensor": next(net.parameters()), "groups": groups}


@pytest.mark.parametrize(("owner", "name"), [(o, n) for o, names in FSDP2_INSTANCE_NAMES.items() for n in names],
                         ids=lambda v: str(v))
def test_fsdp2_instance_name_exists(fsdp_unit: dict[str, object], owner: str, name: str) -> None:
    value = fsdp_unit[owner]
    for part in name.split("."):
        assert hasattr(value, part), f"FSDP2's {owner} has no {name} in torch {torch.__version__}; the strategy uses it"
        value = getattr(value, part)


def test_fsdp2_parameter_groups_are_found(fsdp_unit: dict[str, object]) -> None:
    """The attribute compat.fsdp_param_groups reads on this release exists, and gives the unit's one group;
    where torch has ``set_reduce_scatter_unused_params``, the group attribute it sets exists too."""
    from dalle_lightning_plugins.compat import HAS_REDUCE_SCATTER_UNUSED_PARAMS, TORCH_VERSION

    state = fsdp_unit["FSDPState"]
    assert hasattr(state, "_fsdp_param_groups" if TORCH_VERSION >= (2, 13) else "_fsdp_param_group")
    assert len(fsdp_unit["groups"]) == 1  # type: ignore[arg-type]
    assert hasattr(fsdp_unit["FSDPParamGroup"], "reduce_scatter_unused_params") == HAS_REDUCE_SCATTER_UNUSED_PARAMS


def test_the_source_scan_finds_private_names(tmp_path: Path) -> None:
    """Guards the scan itself: if it missed names, the parametrized tests above would pass vacuously."""
    source = tmp_path / "plugin.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nimport webdataset as wds\n"
        "from lightning.fabric.utilities.init import _private, public\nfrom hydra._internal.utils import parser\n"
        "from dalle_lightning_plugins.strategies.mesh import _own\nfrom torch.distributed.tensor import DTensor\n"
        "torch._foreach_norm(x)\ndist.ProcessGroupGloo._Options()._timeout = 1\nwds.filters._shuffle(s)\n"
        "self._mine = torch.zeros(1)\nhandlers = DTensor._op_dispatcher._custom_op_handlers\n"
        "torch._dynamo.config.recompile_limit = 8\n"
    )
    assert private_imports([source]) == [("hydra._internal.utils", "parser"),
                                         ("lightning.fabric.utilities.init", "_private")]
    assert private_attributes([source]) == [("torch", "_dynamo.config.recompile_limit"), ("torch", "_foreach_norm"),
                                            ("torch.distributed", "ProcessGroupGloo._Options"),
                                            ("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers"),
                                            ("webdataset", "filters._shuffle")]
