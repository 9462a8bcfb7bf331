"""Opening a checkpoint never runs code from it: what ``ShardedPowerSGDStrategy`` writes is data, and a file that asks
for more is refused in one line (the file, the global it asked for, what to do), where ``ddp`` refuses it too.

A stranger's own LightningModule (a residual MLP of its own, SGD with momentum) on 2 gloo processes as 2 nodes of 1
device, PowerSGD at rank 1, so every rank's error buffers and Q are real per-rank state. Each format the strategy
writes loads with ``torch.load(weights_only=True)`` (full) or the DCP reader (sharded), a full checkpoint is one
``torch.save`` (under either of its names), and a fit resumed from either (from another initialisation) ends bit-equal
to the uninterrupted fit; so do checkpoints of both formats in the layout written before (each rank's state a
``torch.save``'d byte string, read as data). Crafted files carry a ``__reduce__`` that would create a marker file: in
the full file, in a legacy per-rank blob, in a sharded checkpoint's metadata file, in DCP's own ``.metadata`` and in
a DCP value. The marker is never created, unless the user says they trust the file.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from unittest import mock
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dalle_lightning_plugins.io.dcp_checkpoint import (
    COMPLETE_MARKER,
    METADATA_FILENAME,
    checkpoint_to_full_state_dict,
    load_sharded,
    read_metadata,
    save_sharded,
)
from dalle_lightning_plugins.io.dcp_reader import load_data, read_dcp_metadata
from dalle_lightning_plugins.io.rank_state import as_data, from_wire, join, split, template, to_wire
from dalle_lightning_plugins.io.refusal import CheckpointRefused
from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy
from tests.helpers.distributed import run_distributed
from tests.test_strategy_common import external_launch_env

WORLD, STEPS_PER_EPOCH, BATCH = 2, 3, 4


class Payload:
    """Unpickled carelessly, creates ``marker`` (``open(marker, "w")``): the code a crafted file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _blob(value: Any) -> bytes:
    """A rank's state as checkpoints held it before it was stored as tensors and plain values."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# ------------------------------------------------------------------------------ a stranger's own project
class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                    nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


class Classifier(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), Residual(16), Residual(16), nn.Linear(16, 3))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SaveAfterFirstEpoch(Callback):
    """Saves after epoch 0, counting this process's ``torch.save`` calls under either of torch's names for it
    (``torch.save`` is ``torch.serialization.save``): a checkpoint is one write, not one plus blobs under an alias."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.saves = 0

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != 0:
            return
        save = torch.save

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.saves += 1
            return save(*args, **kwargs)

        with mock.patch.object(torch, "save", counted), mock.patch.object(torch.serialization, "save", counted):
            trainer.save_checkpoint(self.path)


def _data(rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = WORLD * BATCH * STEPS_PER_EPOCH
    dataset = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, WORLD, rank, shuffle=False))


def _fit(rank: int, strategy: Any, *, seed: int = 0, save: SaveAfterFirstEpoch | None = None,
         **fit: Any) -> dict[str, torch.Tensor]:
    """Two epochs (resumed from ``fit["ckpt_path"]`` if given); the whole weights afterwards."""
    module = Classifier(seed)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[save] if save else [])
    trainer.fit(module, _data(rank), **fit)
    return {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for n, v in module.state_dict().items()}


def _sharded(fmt: str = "full") -> ShardedPowerSGDStrategy:
    return ShardedPowerSGDStrategy(devices_per_node=1, powersgd_rank=1, checkpoint_format=fmt, timeout=60,
                                   block_classes=[Residual])


def _refusal(run: Any) -> tuple[str, str]:
    """How ``run()`` ended: (exception type, message); ("", "") if it did not raise."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the test compares what was raised
        return type(exc).__name__, str(exc)
    return "", ""


def _craft(work: Path, full: Path, marker: Path) -> dict[str, Path]:
    """Rank 0: the legacy-layout and crafted files, made from the strategy's own checkpoints."""
    saved = torch.load(full, weights_only=True)
    legacy = {**saved, "powersgd": [_blob(s) for s in saved["powersgd"]],
              "rank_buffers": [_blob(b) for b in saved["rank_buffers"]],
              # plain values naming a stranger's callable: data, which a fit never builds (under ddp neither)
              "hyper_parameters": {"_target_": "builtins.open", "file": str(marker), "mode": "w"}}
    files = {"legacy": work / "legacy.ckpt", "full_payload": work / "full-payload.ckpt",
             "blob_payload": work / "blob-payload.ckpt", "meta_payload": work / "meta-payload.ckpt"}
    torch.save(legacy, files["legacy"])
    torch.save({**saved, "stranger": Payload(marker)}, files["full_payload"])
    files["trusted"] = work / "trusted.ckpt"  # the same, opened with weights_only=False: the user's call, honoured
    torch.save({**saved, "stranger": Payload(work / "trusted-marker")}, files["trusted"])
    evil_blob = _blob({**saved["powersgd"][1], "stranger": Payload(marker)})  # rank 1's only: every rank refuses
    torch.save({**legacy, "powersgd": [legacy["powersgd"][0], evil_blob]}, files["blob_payload"])
    files["legacy_sharded"] = _legacy_sharded(work / "sharded.ckpt", work / "legacy-sharded.ckpt")
    shutil.copytree(work / "sharded.ckpt", files["meta_payload"])
    meta = torch.load(files["meta_payload"] / METADATA_FILENAME, weights_only=True)
    torch.save({**meta, "stranger": Payload(marker)}, files["meta_payload"] / METADATA_FILENAME)
    return files


def _legacy_sharded(new: Path, old: Path) -> Path:
    """``new`` in the sharded layout written before: each rank's state one byte string under its key in DCP, whole
    tensors (written offline, as one process; DCP reshards them on load)."""
    stored = read_dcp_metadata(new).state_dict_metadata
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in stored.items()}
    load_data(flat, new, weights_only=True, no_dist=True)
    meta = torch.load(new / METADATA_FILENAME, weights_only=True)
    for rank, skeleton in enumerate(meta.pop("powersgd")):
        prefix = f"powersgd_rank{rank}."
        tensors = {k.removeprefix(prefix): flat.pop(k) for k in list(flat) if k.startswith(prefix)}
        flat[f"powersgd_rank{rank}"] = _blob(join(skeleton, tensors))
    assert not meta["rank_buffers"]  # the stranger's model has no buffers
    dcp.save(flat, checkpoint_id=old, no_dist=True)
    torch.save(meta, old / METADATA_FILENAME)
    (old / COMPLETE_MARKER).write_text("")
    return old


def _worker(rank: int, world_size: int, work_dir: str) -> dict[str, Any]:
    external_launch_env(rank)
    work = Path(work_dir)
    marker = work / "marker"
    full, sharded = work / "full.ckpt", work / "sharded.ckpt"
    saving = SaveAfterFirstEpoch(full)
    out: dict[str, Any] = {"straight": _fit(rank, _sharded("full"), save=saving),
                           "straight_sharded": _fit(rank, _sharded("sharded"), save=SaveAfterFirstEpoch(sharded)),
                           "saves": saving.saves}
    files = [_craft(work, full, marker) if rank == 0 else None]
    dist.broadcast_object_list(files, src=0)
    crafted = files[0]
    assert crafted is not None
    # Every format resumes, from another initialisation: weights_only=True as a user passes it, or Lightning's None.
    out["resumed_full"] = _fit(rank, _sharded("full"), seed=7, ckpt_path=full, weights_only=True)
    out["resumed_sharded"] = _fit(rank, _sharded("sharded"), seed=7, ckpt_path=sharded)
    out["resumed_legacy"] = _fit(rank, _sharded("full"), seed=7, ckpt_path=crafted["legacy"])
    out["resumed_legacy_sharded"] = _fit(rank, _sharded("sharded"), seed=7, ckpt_path=crafted["legacy_sharded"])
    out["refused"] = {name: _refusal(lambda p=crafted[name]: _fit(rank, _sharded(), ckpt_path=p))
                      for name in ("full_payload", "blob_payload", "meta_payload")}
    # Trusted by the user: Lightning 2.6 does not pass Trainer.fit(weights_only=False) on to a strategy that restores
    # after setup (its own FSDP neither), so torch's own switch, which the refusal names, is the way in.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        out["trusted"] = _fit(rank, _sharded("full"), seed=7, ckpt_path=crafted["trusted"], weights_only=False)
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    ddp = DDPStrategy(process_group_backend="gloo")
    out["ddp_refused"] = _refusal(lambda: _fit(rank, ddp, ckpt_path=crafted["full_payload"]))
    dist.barrier()
    out["marker"] = marker.exists()
    out["crafted"] = {k: str(v) for k, v in crafted.items()}
    return out


@pytest.mark.distributed
def test_strategy_checkpoints_are_data_and_payloads_are_refused_in_one_line(tmp_path: Path) -> None:
    results = run_distributed(_worker, WORLD, str(tmp_path), timeout=240)
    full, sharded = tmp_path / "full.ckpt", tmp_path / "sharded.ckpt"

    # Data only: the full file under torch.load(weights_only=True), each rank's PowerSGD state as tensors (error
    # buffers that carry something); the sharded directory through the allow-list, its per-rank state as tensors.
    saved = torch.load(full, weights_only=True)
    assert [type(s) for s in saved["powersgd"]] == [dict, dict]
    assert all(any(e.abs().sum() > 0 for e in s["error"].values()) for s in saved["powersgd"])
    stored = read_dcp_metadata(sharded).state_dict_metadata
    per_rank = {k: v for k, v in stored.items() if k.startswith(("powersgd_rank", "rank_buffers_rank"))}
    assert per_rank and all(isinstance(v, TensorStorageMetadata) for v in per_rank.values()), per_rank
    assert len(read_metadata(sharded, weights_only=True)["powersgd"]) == WORLD
    assert [r["saves"] for r in results] == [1, 0]  # one write per full checkpoint, on rank 0, as under ddp

    for r in results:  # bit-equal resumes
        for name in ("resumed_full", "resumed_sharded", "resumed_legacy", "resumed_legacy_sharded", "straight_sharded",
                     "trusted"):
            assert r[name].keys() == r["straight"].keys()
            bad = [k for k in r["straight"] if not torch.equal(r[name][k], r["straight"][k])]
            assert not bad, f"{name}: {bad} differ from the uninterrupted fit"

    crafted = results[0]["crafted"]
    expected = {"full_payload": (crafted["full_payload"], ""), "blob_payload": (crafted["blob_payload"], "powersgd[1]"),
                "meta_payload": (str(Path(crafted["meta_payload"]) / METADATA_FILENAME), "")}
    for r in results:
        for name, (path, part) in expected.items():
            kind, message = r["refused"][name]
            assert kind == "CheckpointRefused" and "\n" not in message, (name, kind, message)
            assert f"'{path}'" in message and "the global io.open" in message
            assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in message  # what to do
            assert part in message, (name, message)
        kind, message = r["ddp_refused"]
        assert kind == "UnpicklingError" and "io.open" in message  # ddp refuses the same file (in many lines)
    assert not any(r["marker"] for r in results) and not (tmp_path / "marker").exists()
    assert (tmp_path / "trusted-marker").exists()  # the user's trust is honoured


# ------------------------------------------------------------------------------ one process: the pieces
def test_sharded_reader_refuses_a_payload_in_every_part(tmp_path: Path) -> None:
    """A DCP value, the metadata file and DCP's own ``.metadata``: each refused in one line naming where."""
    marker = tmp_path / "marker"
    good = {"state_dict": {"w": torch.arange(4.0)}, "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    value = save_sharded(tmp_path / "value.ckpt", {**good, "optimizer_0": {"param_groups": [{"lr": Payload(marker)}]}},
                         {"global_step": 1})
    meta = save_sharded(tmp_path / "meta.ckpt", good, {"global_step": Payload(marker)})
    dcp_meta = save_sharded(tmp_path / "dcp-meta.ckpt", good, {"global_step": 1})
    (dcp_meta / ".metadata").write_bytes(pickle.dumps(Payload(marker)))

    def template() -> dict[str, Any]:
        return {"state_dict": {"w": torch.zeros(4)}, "optimizer_0": {"param_groups": [{"lr": 0.0}]}}

    cases = {value: (lambda: load_sharded(value, template()), f"'{value}' (key 'optimizer_0.param_groups.0.lr')"),
             meta: (lambda: load_sharded(meta, template()), f"'{meta / METADATA_FILENAME}'"),
             dcp_meta: (lambda: load_sharded(dcp_meta, template()), f"'{dcp_meta / '.metadata'}'")}
    for path, (load, where) in cases.items():
        with pytest.raises(CheckpointRefused) as refused:
            load()
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"refusing checkpoint {where}: it asks for the global io.open"), message
    with pytest.raises(CheckpointRefused, match="the global io.open"):
        checkpoint_to_full_state_dict(dcp_meta)
    assert not marker.exists()
    load_sharded(meta, template(), weights_only=False)  # the caller trusts the file: read as torch reads it
    assert marker.exists()

    state = template()  # the same layout without the payload loads, bytes and all
    assert load_sharded(save_sharded(tmp_path / "good.ckpt", good, {"global_step": 1}), state) == {"global_step": 1}
    assert state["optimizer_0"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(state["state_dict"]["w"], torch.arange(4.0))


def test_dcp_metadata_reads_through_the_allow_list_as_pickle_reads_it(tmp_path: Path) -> None:
    """What DCP writes into ``.metadata`` for a model and its Adam state in every dtype class, read through the
    allow-list, equals what plain ``pickle`` makes of it."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "flags": torch.ones(2, dtype=torch.bool)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        reference = pickle.load(f)
    read = read_dcp_metadata(tmp_path)
    assert read.state_dict_metadata == reference.state_dict_metadata
    assert read.storage_data == reference.storage_data and read.planner_data == reference.planner_data
    assert any(isinstance(v, BytesStorageMetadata) for v in read.state_dict_metadata.values())


def test_per_rank_state_is_tensors_and_plain_values() -> None:
    """Split for DCP and joined back equal, every tensor a CPU copy, and so across the wire as raw bytes (every
    dtype, 0-d and empty tensors); anything else is refused at the save, in one line naming its place."""
    live = torch.arange(6.0).reshape(2, 3)
    state = {"q": {"blocks.0.fc1.weight": live}, "step": 3, "medians": (1.5, None), "times": {True: [0.1]},
             "counts": torch.zeros(0, dtype=torch.int64), "numpy_float": np.float64(2.0)}
    skeleton, tensors = split(state)
    assert not any(isinstance(v, torch.Tensor) for v in _leaves(skeleton))
    loaded = template(skeleton)
    assert {k: (v.shape, v.dtype) for k, v in loaded.items()} == {k: (v.shape, v.dtype) for k, v in tensors.items()}
    back = join(skeleton, tensors)
    assert torch.equal(back["q"]["blocks.0.fc1.weight"], live) and back["q"]["blocks.0.fc1.weight"] is not live
    assert back["medians"] == (1.5, None) and back["times"] == {True: [0.1]} and back["step"] == 3
    buf = io.BytesIO()
    torch.save(as_data(state), buf)
    buf.seek(0)
    wired = from_wire(*to_wire({**state, "bf16": torch.ones(3, dtype=torch.bfloat16), "flag": torch.tensor(True)}))
    assert torch.equal(wired["q"]["blocks.0.fc1.weight"], live) and wired["bf16"].dtype == torch.bfloat16
    assert wired["flag"].shape == () and bool(wired["flag"]) and wired["counts"].shape == (0,)
    reloaded = torch.load(buf, weights_only=True)  # numpy's float64 became a float: no numpy global in the file
    assert reloaded["step"] == 3 and type(reloaded["numpy_float"]) is float
    with pytest.raises(TypeError, match=r"^state\['q'\]\['x'\] is a pathlib.PosixPath; per-rank checkpoint state"):
        as_data({"q": {"x": Path("/")}})


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]

