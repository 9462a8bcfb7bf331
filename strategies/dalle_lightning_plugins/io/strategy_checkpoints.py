"""The checkpoints of :class:`~dalle_lightning_plugins.strategies.sharded_powersgd.ShardedPowerSGDStrategy`: one file as
``ddp`` writes it, or sharded DCP directories, with each rank's PowerSGD state and buffers, so a resumed run continues exactly.

A part the strategy holds (:class:`StrategyCheckpoints`), handed the module, its root, the optimizers, the checkpoint
IO and the ranks at each call: the strategy's module holds the Lightning glue, and this one what goes to and comes
from disk.

* ``"full"``: the model and optimizers gathered whole on rank 0 (:mod:`dalle_lightning_plugins.io.full_checkpoint`),
  plus each rank's PowerSGD state and buffers in lists by rank; ``load_from_checkpoint`` reads it.
* ``"sharded"``: ``torch.distributed.checkpoint`` directories, every rank its own shards
  (:mod:`dalle_lightning_plugins.io.dcp_checkpoint`).
* Either form, or a ``ddp`` file, resumes a run.

Both are data: each rank's own state is tensors and plain values (:mod:`dalle_lightning_plugins.io.rank_state`),
never a pickled blob, so a full file loads with ``torch.load(weights_only=True)`` and a directory through
:mod:`dalle_lightning_plugins.io.dcp_reader`. Loading passes on the ``weights_only`` it is given, as ``ddp`` does
(None: torch's default, True), and a file that asks for more is refused in one line
(:mod:`dalle_lightning_plugins.io.refusal`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dalle_lightning_plugins.io.checkpoint_io import PathLike
from dalle_lightning_plugins.io.dcp_checkpoint import (
    export_full_state_dict,
    is_sharded_checkpoint,
    load_sharded,
    rank_key,
    read_metadata,
    save_sharded,
)
from dalle_lightning_plugins.io.dcp_reader import read_dcp_metadata
from dalle_lightning_plugins.io.rank_state import from_legacy, join, split, template
from dalle_lightning_plugins.io.refusal import CheckpointRefused, refusal
from dalle_lightning_plugins.strategies.plain_weights import from_plain, is_plain, to_plain
from dalle_lightning_plugins.io.full_checkpoint import (
    gather_plain_to_rank0,
    gather_to_rank0,
    like,
    load_optimizer_state,
    optimizer_state_by_index,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

CHECKPOINT_FORMATS = ("full", "sharded")  # one file as ddp writes it; a DCP directory of every rank's shards
POWERSGD_KEY = "powersgd"
OVERLAP_CHOICE_KEY = "overlap_choice"  # overlap="auto"'s schedule and decision, inside each rank's state
SHARDED_EXTRAS_KEY = "sharded_extras"  # checkpoint keys (besides the model) saved through DCP: name -> DTensor
# Buffers stay whole on every rank and differ by the last step (each rank's forward updates rank 0's broadcast
# running statistics with its own batch, as under ddp); DCP keeps one copy of a key that every rank saves (any
# rank's), so each rank's own go under a key of its own (a full checkpoint: a list by rank). Metadata: their names.
# A resume gives every rank rank 0's (the ranks sharing buffers: their first rank's), as every ddp rank loads its file.
RANK_BUFFERS_KEY = "rank_buffers"


@dataclass(frozen=True)
class Ranks:
    """The process facts a checkpoint's collectives need, handed over by the strategy."""

    global_rank: int
    world_size: int


class StrategyCheckpoints:
    """Save and load of the strategy's checkpoints, a part the strategy holds and calls from Lightning's checkpoint
    hooks. It owns the format and whether a save made a whole module sharded for the moment; the module, its sharded
    root, the optimizers, the checkpoint IO, the ranks and each rank's own state are handed to each call."""

    def __init__(self, checkpoint_format: str) -> None:
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format={checkpoint_format!r}, expected one of {CHECKPOINT_FORMATS}")
        self.format = checkpoint_format
        self._whole_after_save = False  # see _sharded_for_checkpoint

    @property
    def _full_checkpoints(self) -> bool:
        return self.format == "full"

    def _sharded_for_checkpoint(self, root: nn.Module | None) -> None:
        """A checkpoint of a module left whole after a stage (``full_weights_after``, e.g. ``trainer.save_checkpoint``
        after ``fit``) is made from its shards, which take the whole values again (no collective); the save that
        follows makes the module whole again, so the optimizer's (sharded) parameters are the module's meanwhile."""
        if root is not None and is_plain(root):
            from_plain(root)
            self._whole_after_save = True

    def module_state(self, module: nn.Module, root: nn.Module | None) -> dict[str, Any]:
        """The LightningModule's state dict: whole on rank 0 (``checkpoint_format="full"``) or sharded (DTensors)."""
        self._sharded_for_checkpoint(root)
        if self._full_checkpoints:
            return export_full_state_dict(module)
        return get_model_state_dict(module)

    def optimizer_state(self, module: nn.Module, root: nn.Module | None, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        self._sharded_for_checkpoint(root)
        if self._full_checkpoints:  # as ``optimizer.state_dict()`` under ddp, whole on rank 0
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return optimizer_state_by_index(get_optimizer_state_dict(module, optimizer, options=options))
        return get_optimizer_state_dict(module, optimizer)

    def save(self, checkpoint: dict[str, Any], path: PathLike, *, module: nn.Module, root: nn.Module | None,
             io: CheckpointIO, ranks: Ranks, rank_state: dict[str, Any]) -> None:
        """Collective: ``checkpoint`` to ``path`` in the strategy's format; ``rank_state`` is this rank's own state
        (PowerSGD's and what a subclass adds). Rank 0 may still be writing when it returns: the caller's barrier
        follows."""
        if self._full_checkpoints:
            self._save_full(checkpoint, path, module, io, ranks, rank_state)
        else:
            self._save_sharded(checkpoint, path, module, ranks, rank_state)
        if self._whole_after_save:  # see _sharded_for_checkpoint
            self._whole_after_save = False
            to_plain(root)

    def _save_sharded(self, checkpoint: dict[str, Any], path: PathLike, module: nn.Module, ranks: Ranks,
                      rank_state: dict[str, Any]) -> None:
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = optim_state
        # Parameter-shaped state of other parts (a sharded EMA): keyed by parameter name, holding DTensors.
        extras = [k for k, v in checkpoint.items() if _holds_dtensors(v)]
        for key in extras:
            state[key] = checkpoint.pop(key)
        checkpoint[SHARDED_EXTRAS_KEY] = {key: sorted(state[key]) for key in extras}
        # This rank's own state: its tensors in DCP under its own key, its plain values (with a place for each
        # tensor) in the metadata, a list by rank (rank 0 writes the metadata).
        skeleton, tensors = split(rank_state, "the strategy's per-rank state")
        if tensors:
            state[rank_key(POWERSGD_KEY, ranks.global_rank)] = tensors
        checkpoint[POWERSGD_KEY] = gather_plain_to_rank0(skeleton)
        buffers = _own_buffers(module, state["state_dict"])
        checkpoint[RANK_BUFFERS_KEY] = sorted(buffers)
        if buffers:
            state[rank_key(RANK_BUFFERS_KEY, ranks.global_rank)] = buffers
        save_sharded(path, state, checkpoint)

    def _save_full(self, checkpoint: dict[str, Any], path: PathLike, module: nn.Module, io: CheckpointIO,
                   ranks: Ranks, rank_state: dict[str, Any]) -> None:
        """Collective: one file as ``ddp`` writes it (model and optimizers whole, from rank 0), plus each rank's
        PowerSGD state and buffers in lists by global rank, so a resume on the same mesh continues exactly."""
        extras = [k for k, v in checkpoint.items() if _holds_dtensors(v)]
        for key in extras:  # a sharded EMA: whole tensors, as the callback writes them under ddp
            checkpoint[key] = {n: v.full_tensor().cpu() for n, v in checkpoint[key].items()}
        checkpoint[SHARDED_EXTRAS_KEY] = extras
        checkpoint[POWERSGD_KEY] = gather_to_rank0(rank_state, "the strategy's per-rank state")
        # the gathered state dict is empty off rank 0: names from the module
        buffers = _own_buffers(module, module.state_dict())
        checkpoint[RANK_BUFFERS_KEY] = gather_to_rank0(buffers, "the rank's buffers")
        if ranks.global_rank == 0:
            io.save_checkpoint(checkpoint, path)

    def load(self, path: PathLike, weights_only: bool | None, *, module: pl.LightningModule,
             optimizers: list[Optimizer], io: CheckpointIO, ranks: Ranks) -> tuple[dict[str, Any], Any]:
        """Either form: a sharded DCP directory, or one file (this strategy's ``"full"`` format or ``ddp``'s).

        ``weights_only`` as ``ddp`` takes it: passed on to ``torch.load`` unchanged, so None means torch's default
        (True since 2.6, or what ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says). Lightning 2.6 passes
        ``Trainer.fit(weights_only=...)`` on only to strategies that restore before setup (``ddp``); this one, as its
        own FSDP and ModelParallel strategies, restores after setup and is called with None. A file that asks for
        more than data is refused in one line (:class:`~dalle_lightning_plugins.io.refusal.CheckpointRefused`).
        Returns the checkpoint and this rank's own state, for the strategy to take back (None: the checkpoint has none
        for this rank, as a ``ddp`` file or another world size's: a fresh start)."""
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]
        if is_sharded_checkpoint(path):
            return self._load_sharded(path, weights_only, module, optimizers, ranks)
        return self._load_full(path, weights_only, module, optimizers, io, ranks)

    def _load_full(self, path: PathLike, weights_only: bool | None, module: pl.LightningModule,
                   optimizers: list[Optimizer], io: CheckpointIO, ranks: Ranks) -> tuple[dict[str, Any], Any]:
        try:
            checkpoint = io.load_checkpoint(path, weights_only=weights_only)
        except pickle.UnpicklingError as exc:  # torch's dozen lines, which do not name the file
            raise refusal(path, exc) from None
        options = StateDictOptions(full_state_dict=True, strict=module.strict_loading)
        set_model_state_dict(module, checkpoint["state_dict"], options=options)
        for opt, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
            load_optimizer_state(opt, saved)
        # Per-rank state of a run on a mesh of this size; a ddp file (or another world size) has none: fresh.
        powersgd, buffers = checkpoint.pop(POWERSGD_KEY, None), checkpoint.pop(RANK_BUFFERS_KEY, None)
        rank, world = ranks.global_rank, ranks.world_size
        own = None
        if optimizers and isinstance(powersgd, list) and len(powersgd) == world:
            own = _own_part(powersgd[rank], path, f"{POWERSGD_KEY}[{rank}]", weights_only, world)
        if isinstance(buffers, list) and len(buffers) == world:
            _copy_buffers(module, _own_part(buffers[rank], path, f"{RANK_BUFFERS_KEY}[{rank}]", weights_only, world))
        params = dict(module.named_parameters())
        for key in checkpoint.pop(SHARDED_EXTRAS_KEY, []):
            checkpoint[key] = {n: like(v, params[n].detach()) for n, v in checkpoint[key].items()}
        return checkpoint, own

    def _load_sharded(self, path: PathLike, weights_only: bool | None, module: pl.LightningModule,
                      optimizers: list[Optimizer], ranks: Ranks) -> tuple[dict[str, Any], Any]:
        rank, world = ranks.global_rank, ranks.world_size
        # Read first on every rank, so that a directory that asks for more is refused before any collective.
        stored = read_dcp_metadata(path, trust=weights_only is False).state_dict_metadata
        saved = read_metadata(path, weights_only)
        key, buffers_key = rank_key(POWERSGD_KEY, rank), rank_key(RANK_BUFFERS_KEY, rank)
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for idx, opt in enumerate(optimizers):
            state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, opt)
        # Per-rank state: tensors under the rank's key and plain values in the metadata; or, as written before, one
        # byte string under the key (read as data); another world size's: none (fresh), as in a full checkpoint.
        skeletons = saved.pop(POWERSGD_KEY, None)
        skeleton = skeletons[rank] if isinstance(skeletons, list) and len(skeletons) == world else None
        legacy = key in stored
        tensors = template(skeleton) if skeleton is not None else {}
        if optimizers and legacy:
            state[key] = b""
        elif optimizers and tensors:
            state[key] = tensors
        buffer_names = saved.pop(RANK_BUFFERS_KEY, None) or []
        if buffers_key in stored:
            state[buffers_key] = b""
        elif buffer_names and skeletons is not None and len(skeletons) == world:
            state[buffers_key] = {n: torch.empty_like(module.get_buffer(n), device="cpu") for n in buffer_names}
        extras = saved.get(SHARDED_EXTRAS_KEY, [])
        params = dict(module.named_parameters())
        for extra in extras:  # older checkpoints list the keys only, with an entry for every parameter
            names = extras[extra] if isinstance(extras, dict) else list(params)
            state[extra] = {n: torch.empty_like(params[n].detach()) for n in names}
        metadata = load_sharded(path, state, weights_only)
        metadata.pop(POWERSGD_KEY, None)
        metadata.pop(RANK_BUFFERS_KEY, None)
        for extra in extras:
            metadata[extra] = state[extra]
        set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=module.strict_loading))
        if buffers_key in state:
            _copy_buffers(module, _own_part(state[buffers_key], path, f"key {buffers_key!r}", weights_only, world))
        for idx, opt in enumerate(optimizers):
            set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"])
        own = None
        if optimizers and legacy:
            own = _own_part(state[key], path, f"key {key!r}", weights_only, world)
        elif optimizers and skeleton is not None:
            own = join(skeleton, state.get(key, {}))
        return metadata, own


def _own_part(value: Any, path: PathLike, part: str, weights_only: bool | None, world_size: int) -> Any:
    """Collective: this rank's own state as stored (a byte string in a checkpoint written before it was kept as
    tensors and plain values: read as data). A refusal on any rank is raised on every rank, which would
    otherwise go on to wait for it in training's first collective."""
    try:
        value, error = from_legacy(value, path, part, weights_only), None
    except CheckpointRefused as exc:
        error = str(exc)
    errors: list[str | None] = [error]
    if dist.is_initialized() and world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointRefused(first)
    return value


def _own_buffers(module: nn.Module | None, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's whole (unsharded) buffers that belong in the state dict, on CPU."""
    if module is None:
        return {}
    return {n: b.detach().cpu().clone() for n, b in module.named_buffers()
            if n in state_dict and not isinstance(b, DTensor)}


def _copy_buffers(module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """This rank's own buffers from a checkpoint, in place (each keeps its device)."""
    with torch.no_grad():
        for name, value in values.items():
            module.get_buffer(name).copy_(value)


def _holds_dtensors(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, DTensor) for v in value.values())
