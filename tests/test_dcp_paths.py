"""A sharded checkpoint's files stay inside its directory (issue 69): DCP's ``.metadata`` names the file of every
chunk (``storage_data[...].relative_path``), and DCP's own reader opens ``directory / relative_path`` as it is. A
checkpoint the strategy wrote, its ``.metadata`` rewritten to name a file outside (``../``, an absolute path, a link
out, ``/dev/zero``), is refused in one line naming the ``.metadata`` and the entry, on every rank, before any file it
names is opened; so is a ``.metadata`` too large to be one, before it is read, and a chunk DCP would decompress.

Each crafted directory is first shown to be potent: DCP's stock reader loads the stranger's weights from outside.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dalle_lightning_plugins.io.dcp_checkpoint import load_sharded, save_sharded
from dalle_lightning_plugins.io.dcp_reader import MAX_METADATA_BYTES
from dalle_lightning_plugins.io.refusal import CheckpointRefused
from tests.helpers.distributed import run_distributed


def rewrite(checkpoint: Path, crafted: Path, rename: Callable[[str], str]) -> Path:
    """A copy of ``checkpoint`` whose ``.metadata`` (rewritten with plain pickle, as anyone can) names
    ``rename(name)`` as the file of each chunk."""
    shutil.copytree(checkpoint, crafted)
    with open(crafted / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = rename(info.relative_path)
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    return crafted


def redirect(checkpoint: Path, crafted: Path, name: str) -> Path:
    """:func:`rewrite` with every chunk's file ``name``."""
    return rewrite(checkpoint, crafted, lambda _: name)


def refused_line(load: Any) -> str:
    with pytest.raises(CheckpointRefused) as refused:
        load()
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def _state(value: float = 0.0) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((4,), value)}}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint as the strategy's writer makes it, and a stranger's data file beside it (other weights)."""
    checkpoint = save_sharded(tmp_path / "run" / "last.ckpt", _state(1.0), {"global_step": 1})
    stranger = save_sharded(tmp_path / "stranger.ckpt", _state(7.0), {"global_step": 1})
    return checkpoint, next(stranger.glob("*.distcp"))


def test_dcp_itself_follows_a_relative_path_out_of_the_directory(written: tuple[Path, Path], tmp_path: Path) -> None:
    """The threat is real: DCP's own reader loads the stranger's weights through ``../``."""
    checkpoint, stranger = written
    crafted = redirect(checkpoint, tmp_path / "run" / "crafted.ckpt", os.path.relpath(stranger, tmp_path / "run" / "crafted.ckpt"))
    state = _state()
    dcp.load(state, checkpoint_id=crafted, no_dist=True)
    assert torch.equal(state["state_dict"]["w"], torch.full((4,), 7.0))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "link", "device"])
def test_a_path_out_of_the_directory_is_refused_in_one_line(kind: str, written: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    checkpoint, stranger = written
    crafted = tmp_path / "run" / f"{kind}.ckpt"
    name = {"dotdot": os.path.relpath(stranger, crafted), "absolute": str(stranger), "link": "__0_0.distcp",
            "device": "/dev/zero"}[kind]
    redirect(checkpoint, crafted, name)
    if kind == "link":  # a name inside the directory that is a link to the stranger's file
        (crafted / "__0_0.distcp").unlink()
        (crafted / "__0_0.distcp").symlink_to(stranger)
    state = _state()
    message = refused_line(lambda: load_sharded(crafted, state))
    assert message.startswith(f"refusing checkpoint '{crafted / '.metadata'}': its storage_data['state_dict.w']."
                              f"relative_path '{name}'"), message
    assert "outside the checkpoint directory" in message, message
    assert torch.equal(state["state_dict"]["w"], torch.zeros(4))  # nothing loaded


def test_nothing_a_refused_metadata_names_is_opened(written: tuple[Path, Path], tmp_path: Path) -> None:
    """The outside file is a FIFO: opening it for reading would block until a writer came, and a writer's
    non-blocking open fails (ENXIO) unless a reader has it open. The refusal comes at once and no reader has it."""
    checkpoint, _ = written
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    crafted = redirect(checkpoint, tmp_path / "run" / "fifo.ckpt", "../../fifo")
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(CheckpointRefused, load_sharded, crafted,
                                                                           _state()).value), daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # it opened the FIFO and waits: release it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the reader opened the file outside the checkpoint")
    assert outcome and "'../../fifo' lies outside the checkpoint directory" in str(outcome[0])
    with pytest.raises(OSError):  # ENXIO: no process holds the FIFO open for reading
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)


def test_a_metadata_too_large_is_refused_before_it_is_read(written: tuple[Path, Path], tmp_path: Path) -> None:
    checkpoint, _ = written
    crafted = tmp_path / "run" / "large.ckpt"
    shutil.copytree(checkpoint, crafted)
    with open(crafted / ".metadata", "r+b") as f:  # sparse: the size without the disk
        f.truncate(MAX_METADATA_BYTES + 1)
    message = refused_line(lambda: load_sharded(crafted, _state()))
    assert message == (f"refusing checkpoint '{crafted}': its .metadata holds {MAX_METADATA_BYTES + 1} bytes; expected "
                       "at most 256 MiB (DCP's index of a checkpoint, a few MB for this code's), so it was not read")
    (crafted / ".metadata").unlink()
    (crafted / ".metadata").symlink_to(checkpoint / ".metadata")  # another checkpoint's, through a link
    assert refused_line(lambda: load_sharded(crafted, _state())).startswith(
        f"refusing checkpoint '{crafted}': its index file '.metadata' resolves to '{checkpoint / '.metadata'}', "
        "outside the checkpoint directory")


def test_a_chunk_dcp_would_decompress_is_refused(written: tuple[Path, Path], tmp_path: Path) -> None:
    """DCP expands a chunk whose ``transform_descriptors`` name zstd whole before any size check (a bomb); the
    plugins' writer never adds one."""
    checkpoint, _ = written
    crafted = tmp_path / "run" / "zstd.ckpt"
    shutil.copytree(checkpoint, crafted)
    with open(crafted / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    assert all(not info.transform_descriptors for info in metadata.storage_data.values())  # as written
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.zstd/1"]
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    assert refused_line(lambda: load_sharded(crafted, _state())) == (
        f"refusing checkpoint '{crafted / '.metadata'}': its storage_data['state_dict.w'].transform_descriptors="
        "['stream.zstd/1'] ask DCP to decompress or transform a chunk, which this code's writer never does; expected "
        "none; none of its files was opened")


def test_the_checkpoint_as_written_still_loads(written: tuple[Path, Path]) -> None:
    checkpoint, _ = written
    state = _state()
    assert load_sharded(checkpoint, state) == {"global_step": 1}
    assert torch.equal(state["state_dict"]["w"], torch.full((4,), 1.0))


def test_dalle_train_refuses_it_at_resume_in_one_line(written: tuple[Path, Path], tiny_world: Path,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``dalle-train resume=<the directory>``: exit code 2 and one line, before any process trains."""
    from dalle_lightning.cli import train
    from tests.conftest import run_app

    checkpoint, stranger = written
    crafted = redirect(checkpoint, tmp_path / "run" / "checkpoints" / "last.ckpt", str(stranger))
    with pytest.raises(SystemExit) as exit_info:
        run_app(train.main, f"paths.work_dir={tiny_world}", f"hydra.run.dir={tmp_path / 'new'}", "stage=dvae",
                f"output={tmp_path / 'dvae.pt'}", f"resume={crafted}")
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: refusing checkpoint '{crafted / '.metadata'}': its storage_data["
                                f"'state_dict.w'].relative_path '{stranger}' lies outside"), errors[0]
    assert not (tmp_path / "dvae.pt").exists()


# ------------------------------------------------------------------------------ the strategy, on 2 ranks
def _worker(rank: int, world_size: int, work_dir: str) -> dict[str, Any]:
    from tests.test_checkpoints_are_data import SaveAfterFirstEpoch, _fit, _refusal, _sharded
    from tests.test_strategy_common import external_launch_env

    external_launch_env(rank)
    work = Path(work_dir)
    sharded = work / "run" / "sharded.ckpt"
    _fit(rank, _sharded("sharded"), save=SaveAfterFirstEpoch(sharded))
    crafted = work / "run" / "crafted.ckpt"
    if rank == 0:  # rank 0's chunks (model, optimizer, its own state) read from a copy outside; rank 1's stay
        shutil.copytree(sharded, work / "stranger")
        rewrite(sharded, crafted, lambda name: f"../../stranger/{name}" if name == "__0_0.distcp" else name)
    dist.barrier()
    return {"refused": _refusal(lambda: _fit(rank, _sharded("sharded"), seed=7, ckpt_path=crafted)),
            "crafted": str(crafted)}


@pytest.mark.distributed
def test_the_strategy_refuses_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=240)
    for result in results:
        kind, message = result["refused"]
        assert kind == "CheckpointRefused" and "\n" not in message, (kind, message)
        assert message.startswith(f"refusing checkpoint '{result['crafted']}/.metadata': its storage_data["), message
        assert "relative_path '../../stranger/__0_0.distcp' lies outside the checkpoint directory" in message, message
