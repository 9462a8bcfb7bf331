"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically.

Every rank writes its own shards in parallel (no gather of a 12B model on one rank). A checkpoint is a
directory: the DCP files of the model, optimizer and per-rank tensors (PowerSGD's Q and error buffers), plus
``meta.pt`` with the trainer's small metadata (loops, callbacks, schedulers, the per-rank plain values: see
``dalle_lightning_plugins.io.rank_state``), and last the completion marker
``complete`` (``dalle_lightning_plugins.io.checkpoint_io.checkpoint_problem`` rejects a directory without it). It is first
written to a sibling temporary directory and renamed into place by rank 0 only after every rank has finished, so a
crash never leaves a half-written checkpoint under the final name; a failed write (a full disk on any rank)
removes the temporary directory, keeps the previous checkpoint and raises on every rank.

For single-device use, :func:`export_full_state_dict` gathers a live sharded module into one plain state
dict (a collective), and :func:`checkpoint_to_full_state_dict` reads a saved checkpoint offline, in one
process without any process group. Every read goes through ``dalle_lightning_plugins.io.dcp_reader``: the
directory is data, and one that asks for more is refused in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dalle_lightning_plugins.io.atomic_files import temporary_name, torch_save, write_text
from dalle_lightning_plugins.io.dcp_reader import load_data, outside, read_dcp_metadata
from dalle_lightning_plugins.io.refusal import CheckpointRefused, torch_load

METADATA_FILENAME = "meta.pt"
COMPLETE_MARKER = "complete"  # written last into the temporary directory, before it is renamed into place
MODEL_KEY = "state_dict"


def rank_key(name: str, rank: int) -> str:
    """Key of a rank's own state: DCP deduplicates equal keys across ranks, so per-rank state needs its own."""
    return f"{name}_rank{rank}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank_zero(value: Any) -> Any:
    """Collective: rank 0's ``value`` on every rank (``value`` itself outside a multi-process group)."""
    box = [value]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def is_sharded_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def save_sharded(path: str | Path, state: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Collective: write ``state`` (DTensors, tensors, bytes) with DCP and ``metadata`` from rank 0, atomically.

    All ranks must pass the same ``path`` on a shared filesystem.
    """
    path = Path(path)
    tmp = Path(_from_rank_zero(temporary_name(path)))  # one unique name, rank 0's: every rank writes into it
    try:
        if _rank() == 0:
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(state, checkpoint_id=tmp)  # collective: a rank's failure raises on every rank
        error = None
        if _rank() == 0:
            try:
                torch_save(metadata, tmp / METADATA_FILENAME)
                write_text(tmp / COMPLETE_MARKER, "every rank's shards and the metadata are written\n")
            except Exception as exc:
                error = exc
        # Every rank raises if rank 0 failed (none waits at a barrier); every rank's shards are on disk before the
        # rename publishes them.
        if _from_rank_zero(error is not None):
            raise error if error is not None else OSError(f"rank 0 could not finish checkpoint {str(path)!r}")
        if _rank() == 0:
            _publish(tmp, path)
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _publish(tmp: Path, path: Path) -> None:
    """Rank 0: put the finished ``tmp`` under ``path``, the previous checkpoint moved aside first and then removed."""
    old = temporary_name(path)
    if path.is_file():
        path.unlink()
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_sharded(path: str | Path, state: dict[str, Any], weights_only: bool | None = None) -> dict[str, Any]:
    """Collective: load ``state`` in place from ``path`` (tensors copied in, other values replaced); return the
    metadata. Read as data (:mod:`dalle_lightning_plugins.io.dcp_reader`) unless ``weights_only`` is False."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"checkpoint {str(path)!r} is not a sharded checkpoint directory (no .metadata)")
    load_data(state, path, weights_only)
    return read_metadata(path, weights_only)


def read_metadata(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """The small metadata of a sharded checkpoint (no tensors loaded): what the loader must prepare for.

    ``weights_only`` as ``torch.load`` takes it (None: torch's default, True since 2.6), as Lightning's own
    sharded strategies read this file; a file that asks for more is refused in one line. DCP's index (``.metadata``)
    is read first, as the loader will read it (the files it names inside the directory, nothing but DCP's metadata
    in it), so that a check before the load (``dalle-train resume=``) refuses what the load would refuse."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"checkpoint {str(path)!r} is not a sharded checkpoint directory (no .metadata)")
    read_dcp_metadata(path, trust=weights_only is False)
    problem = outside(path, METADATA_FILENAME, "metadata file")  # a link out of the directory, a device
    if problem is not None:
        raise CheckpointRefused(f"refusing checkpoint {str(path)!r}: {problem}")
    return torch_load(path / METADATA_FILENAME, path / METADATA_FILENAME, weights_only, map_location="cpu")


def export_full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full, unsharded state dict of a sharded module on CPU (non-empty on rank 0 only)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)  # type: ignore[return-value]


def checkpoint_to_full_state_dict(path: str | Path, key: str = MODEL_KEY,
                                  weights_only: bool | None = None) -> dict[str, torch.Tensor]:
    """Offline, single process: the full model state dict stored under ``key`` in a sharded checkpoint.

    The result loads into the plain (unsharded) module with ``module.load_state_dict``. Read as
    :func:`load_sharded` reads: as data unless ``weights_only`` is False.
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"checkpoint {str(path)!r} is not a sharded checkpoint directory (no .metadata)")
    prefix = f"{key}."
    stored = read_dcp_metadata(path, trust=weights_only is False).state_dict_metadata
    whole: dict[str, Any] = {
        name[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata)
        else None
        for name, md in stored.items() if name.startswith(prefix)}
    if not whole:
        raise KeyError(f"checkpoint {str(path)!r} has no {key!r}; found {sorted({n.split('.')[0] for n in stored})}")
    state = {key: whole}
    load_data(state, path, weights_only, no_dist=True)
    return state[key]
