"""The stage's model of :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy`: the
sharded root over the user's own children, sharded in place (:mod:`~dalle_lightning_plugins.strategies.sharding`,
:mod:`~dalle_lightning_plugins.strategies.in_place`), the blocks that became FSDP units and their names, and the
activation-checkpointing wrappers the stage put on them.

One object owns them so that the strategy's other parts (whole weights, checkpoints, the step) are handed what they
need instead of reading each other's attributes, and so that a pickled strategy drops exactly the per-process part.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from dalle_lightning_plugins import compat
from dalle_lightning_plugins.protocol import RESBLOCKS_METHOD, blocks_tied_outside, find_resblocks
from dalle_lightning_plugins.strategies.broadcasts import broadcast_replicas
from dalle_lightning_plugins.strategies.activation_checkpointing import ActivationCheckpointing
from dalle_lightning_plugins.strategies.sharded_root import (VERIFY_EVERY, VERIFY_FIRST, ShardedRoot, check_units_ran,
                                                              hook_lightning_module, reshard_all)
from dalle_lightning_plugins.strategies.sharding import shard_in_place
from dalle_lightning_plugins.strategies.weight_averaging import load_whole_into_shards, shard_averages

if TYPE_CHECKING:
    import lightning.pytorch as pl


def declares_resblocks(module: nn.Module) -> bool:
    """Whether any submodule of ``module`` has the ``resblocks()`` method of the protocol."""
    return any(callable(getattr(m, RESBLOCKS_METHOD, None)) for m in module.modules())


def default_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a module that names none: the entries (holding parameters) of its outermost ``nn.ModuleList``s,
    as torchtitan and Hugging Face shard a transformer's layers; none (the whole module one unit) without one."""
    found: dict[int, tuple[str, nn.Module]] = {}  # an entry in two lists (or twice in one) is one unit
    lists: list[str] = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or any(name.startswith(f"{outer}.") for outer in lists):
            continue
        lists.append(name)
        for i, entry in enumerate(child):
            if next(entry.parameters(), None) is not None:
                found.setdefault(id(entry), (f"{name}.{i}".lstrip("."), entry))
    return list(found.values())


class ShardedModel:
    """The sharded root (kept across fit -> validate: FSDP2 shards a module only once), its blocks, their names, and
    this stage's activation checkpointing."""

    def __init__(self, block_classes: Sequence[type[nn.Module]] = (), block_patterns: Sequence[str] = (), *,
                 activation_checkpointing: bool = False, mp_policy: MixedPrecisionPolicy | None = None,
                 reshard_after_forward: bool = True, prefetch_depth: int = 1, owner: str = "") -> None:
        # how the stage is sharded: the strategy's arguments of the same names; owner names it in what it logs
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"prefetch_depth={prefetch_depth!r}, expected a non-negative integer")
        self.block_classes, self.block_patterns = list(block_classes), list(block_patterns)
        self.activation_checkpointing, self.owner = activation_checkpointing, owner
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.root: ShardedRoot | None = None
        self.blocks: dict[str, nn.Module] = {}
        self.block_names: list[str] = []
        self.checkpointing: ActivationCheckpointing | None = None  # the stage's blocks' wrappers (setup, teardown)
        self.averages_sharded = False  # this fit shards a WeightAveraging callback's copy
        self.backwards = 0  # this stage's backwards (check_units_ran verifies the first few across the node)

    def begin(self, module: nn.Module) -> None:
        """A new stage on ``module``: fresh activation checkpointing; the last stage's root only if it is this
        module's."""
        self.checkpointing = ActivationCheckpointing()
        self.backwards = 0
        self.averages_sharded = False
        if self.root is not None and self.root.owner is not module:
            self.root = None

    def find_blocks(self, module: nn.Module, shard_size: int) -> list[tuple[str, nn.Module]]:
        """The blocks that become FSDP units (and the overlapped exchange's buckets): the configured classes and
        patterns, else the model's ``resblocks()``; blocks that share weights with the rest of the model are sharded
        with it, said in one line naming the owner."""
        owner = self.owner
        if self.block_classes or self.block_patterns or declares_resblocks(module):
            blocks = find_resblocks(module, self.block_classes or None, self.block_patterns or None)
        else:
            blocks = default_blocks(module)
            rank_zero_info(f"{owner}: {type(module).__name__} declares no blocks, so "
                           + (f"each of the {len(blocks)} entries of its nn.ModuleList(s) (first: {blocks[0][0]}) is "
                              "an FSDP2 unit" if blocks else "the whole module is one FSDP2 unit (no nn.ModuleList)")
                           + "; block_classes, block_patterns or a resblocks() method choose others")
        tied = blocks_tied_outside(module, blocks) if shard_size > 1 else []
        if tied:
            rank_zero_info(f"{owner}: {len(tied)} block(s) share weights with the rest of the model "
                           f"(first: {tied[0]}), so they are sharded with it rather than as units of their own")
            blocks = [(name, block) for name, block in blocks if name not in tied]
        self.block_names = [name for name, _ in blocks]
        self.blocks = dict(blocks)
        return blocks

    def shard_averages(self, trainer: pl.Trainer, module: nn.Module) -> Callable[[], None] | None:
        """A fit's Lightning ``WeightAveraging`` copies sharded as the module
        (:func:`~dalle_lightning_plugins.strategies.weight_averaging.shard_averages`), where the root is sharded;
        returns the undo for the stage's end, or None."""
        undo = shard_averages(trainer, module) if isinstance(self.root, FSDPModule) else None
        self.averages_sharded = undo is not None
        return undo

    def new_step(self) -> None:
        """A training step starts: the units' forwards are counted from here (validation's do not count)."""
        if self.root is not None:
            self.root.units_ran.clear()

    def prepare(self, module: nn.Module, precision: Any, shard_size: int,
                fitting: bool) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
        """The precision plugin's conversion, the blocks, and (fitting) activation checkpointing on them: the stage's
        module and blocks. On a sharded node it runs on the user's module before it is sharded."""
        module = precision.convert_module(module)
        blocks = self.find_blocks(module, shard_size)
        if fitting and self.activation_checkpointing:
            assert self.checkpointing is not None
            self.checkpointing.apply(b for _, b in blocks)
        return module, blocks

    def after_validation_step(self) -> None:
        """WeightAveraging swaps the module's parameters with its sharded copy's at the epoch's end: the root unit,
        which a forward without backward leaves gathered, goes back to its shards after each validation step."""
        if self.averages_sharded and self.root is not None:
            reshard_all(self.root)

    def remove_checkpointing(self) -> None:
        """The blocks' own forward again (teardown)."""
        if self.checkpointing is not None:
            self.checkpointing.remove()

    def reuse(self, module: nn.Module, known: tuple[ShardedRoot, int], shard_size: int, precision: Any,
              fitting: bool) -> ShardedRoot:
        """The root a ``full_weights_after=False`` stage left on ``module`` (this Trainer's or an earlier one's):
        FSDP2 shards a module only once, so its units are reused; they must be on a mesh of the same shape."""
        root, size = known
        if size != shard_size:
            raise ValueError(
                f"{type(module).__name__} was sharded over {size} devices per node by an earlier Trainer, "
                f"this one has devices_per_node={shard_size}; build a new model (or keep devices_per_node)"
            )
        self.prepare(module, precision, shard_size, fitting)
        reshard_all(root)
        hook_lightning_module(root)
        self.root = root
        return root

    def build(self, module: nn.Module, precision: Any, mesh: DeviceMesh, root_device: torch.device, world_size: int, *,
              fitting: bool, whole: bool) -> nn.Module:
        """The stage's model: FSDP2 units over the module's own children, in place, at several devices per node (plain
        again after the stage, :func:`~dalle_lightning_plugins.strategies.plain_weights.to_plain`); the module itself,
        whole, at one device per node or when ``whole`` (a stage without training on whole weights). ``precision``
        converts the module (:meth:`prepare`)."""
        shard_size = mesh["shard"].size()
        prepare = functools.partial(self.prepare, precision=precision, shard_size=shard_size, fitting=fitting)
        if shard_size == 1 or whole:
            # One device per node: nothing to shard within a node. FSDP2 over a group of one would only add
            # copies and DTensor dispatch to every step; the model stays whole and PowerSGD does all the averaging.
            module, _ = prepare(module)
            compat.materialize_meta_tensors(module, root_device)  # ``init_module(empty_init=True)``
            module.to(root_device)
            # every rank starts from rank 0's parameters and buffers, as ddp's wrapper does when it is made
            broadcast_replicas(module, mesh["replicate"], world_size)
            if shard_size > 1:
                return module  # a stage without training, on whole weights: the module itself, as under ddp
            self.root = ShardedRoot(module, dict(module.named_children()))
            return self.root
        root = shard_in_place(module, prepare, mesh["shard"], root_device, mp_policy=self.mp_policy,
                               reshard_after_forward=self.reshard_after_forward, prefetch_depth=self.prefetch_depth)
        self.root = root  # from here a failure is the stage's: WholeWeights.leave gives the user's module back
        broadcast_replicas(module, mesh["replicate"], world_size)
        load_whole_into_shards(root)  # module.load_state_dict(whole values) in the stage, as under ddp
        return root

    def before_backward(self, closure_loss: torch.Tensor, shard_group: dist.ProcessGroup,
                        root_device: torch.device) -> tuple[list[str], list[nn.Parameter]]:
        """Checks and hooks a node of several devices needs before its backward; returns the units that did not
        run exactly once (none, or several times) and the parameters whose gradients must stay as they were
        (those of units no rank ran, where they had none)."""
        root = self.root
        assert root is not None
        self.backwards += 1  # the same count on every rank of the node: the verified backwards are the same ones
        verify = self.backwards <= VERIFY_FIRST or self.backwards % VERIFY_EVERY == 0
        idle, repeated = check_units_ran(root, self.block_names, shard_group, root_device, verify)
        # A unit no rank ran since the last backward takes no part in this one; FSDP2 would still hand its
        # parameters zero gradients (``reduce_scatter_unused_params``), and momentum or weight decay would then
        # move them. As under ddp, their gradients stay as they were (None after ``zero_grad``).
        read = root.reads.read if root.reads is not None else set()  # read whole in the step: they get gradients
        untouched = [p for name in idle for p in self.blocks[name].parameters() if p.grad is None and id(p) not in read]
        read.clear()
        if root.gathered_outside:
            # A loss from a forward outside ShardedRoot.forward (a second update through the embedding and
            # head only) carries no FSDP2 root hook: without one the root unit's gradients are never
            # reduce-scattered. The root's own pre-backward hook on the loss queues that reduction.
            root.gathered_outside = False
            compat.register_root_pre_backward(root, closure_loss)
        return idle + repeated, untouched

    @contextmanager
    def shards_read(self) -> Generator[None, None, None]:
        """For a backward or an optimizer step: the shards themselves, not whole reads, where a ``training_step``
        runs them (manual optimization; :mod:`~dalle_lightning_plugins.strategies.shard_reads`)."""
        with self.root.shards_read() if isinstance(self.root, ShardedRoot) else nullcontext():
            yield None

    def pickled(self) -> ShardedModel:
        """What a pickled strategy keeps: the options and the block names, without the sharded root (FSDP2 makes
        its classes per process, which pickle cannot name) or the stage's wrappers."""
        kept = copy.copy(self)  # the options, whichever they are; then the per-process state, as a fresh stage's
        kept.root, kept.blocks, kept.checkpointing, kept.averages_sharded, kept.backwards = None, {}, None, False, 0
        kept.block_names = list(self.block_names)
        return kept
