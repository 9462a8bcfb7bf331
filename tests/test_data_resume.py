"""The training order is resumable: a new order every epoch, a function of (seed, epoch) alone, and a pass that can
start after the batches a checkpoint says were trained on, whatever the ranks and loader workers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dalle_lightning.data.datamodule import ImageTextDataModule
from tests.test_data import _good, _write


@pytest.fixture
def shards(tmp_path: Path) -> str:
    for s in range(3):
        _write(tmp_path / f"{s:06d}.tar", [_good(s * 8 + i) for i in range(8)])
    return str(tmp_path)


def _module(shards: str, epoch: int = 0, workers: int = 0, augment: bool = False, rank: int = 0,
            world: int = 2) -> ImageTextDataModule:
    dm = ImageTextDataModule(train_shards=shards, image_size=16, batch_size=3, num_workers=workers, seed=5,
                             shuffle_buffer=10, augment=augment)
    dm.trainer = SimpleNamespace(current_epoch=epoch, global_rank=rank, world_size=world)  # what the data module reads
    return dm


def _pass(dm: ImageTextDataModule) -> list[tuple[list[str], torch.Tensor]]:
    return [(batch["text"], batch["image"]) for batch in dm.train_dataloader()]


def _texts(batches: list[tuple[list[str], torch.Tensor]]) -> list[str]:
    return [t for texts, _ in batches for t in texts]


def test_every_epoch_has_its_own_order_the_same_on_every_rerun(shards: str) -> None:
    dm = _module(shards)
    loader = dm.train_dataloader()
    orders = []
    for epoch in range(3):  # one loader, as Lightning keeps it: the epoch is read at the start of each pass
        dm.trainer.current_epoch = epoch
        orders.append([t for batch in loader for t in batch["text"]])
    assert len({tuple(o) for o in orders}) == 3
    assert orders[2] == _texts(_pass(_module(shards, epoch=2)))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_continues_with_the_next_batch(shards: str, workers: int) -> None:
    """Rank 1 of 2 (every rank keeps its own sample of each pair), with augmentation: the resumed pass yields the
    uninterrupted pass's batches after the third, pixels included."""
    whole = _pass(_module(shards, epoch=1, workers=workers, augment=True, rank=1))
    assert len(whole) == 4  # 12 samples of this rank in batches of 3
    dm = _module(shards, epoch=1, workers=workers, augment=True, rank=1)
    dm.load_state_dict({"epoch": 1, "batches": 3, "order": dm._order()})
    resumed = _pass(dm)
    assert [t for t, _ in resumed] == [t for t, _ in whole[3:]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed, whole[3:]))
    assert _texts(_pass(dm)) == _texts(whole)  # only the first pass after loading starts part-way


def test_augmentation_depends_on_the_sample_not_on_who_decodes_it(shards: str) -> None:
    one = {t: img for texts, imgs in _pass(_module(shards, augment=True, world=1)) for t, img in zip(texts, imgs)}
    workers = {t: img for texts, imgs in _pass(_module(shards, augment=True, world=1, workers=2))
               for t, img in zip(texts, imgs)}
    assert one.keys() == workers.keys() and all(torch.equal(one[t], workers[t]) for t in one)
    later = {t: img for texts, imgs in _pass(_module(shards, epoch=1, augment=True, world=1))
             for t, img in zip(texts, imgs)}
    assert any(not torch.equal(one[t], later[t]) for t in one)  # a new epoch draws new crops


def _with_progress(dm: ImageTextDataModule, epoch: int, processed: int, last: bool) -> ImageTextDataModule:
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed), is_last_batch=last)
    dm.trainer = SimpleNamespace(current_epoch=epoch, global_rank=0, world_size=2, state=SimpleNamespace(fn="fit"),
                                 fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    return dm


def test_state_is_the_trained_batches_and_after_an_epoch_the_next_one(shards: str) -> None:
    mid = _with_progress(_module(shards), 2, 3, last=False).state_dict()
    assert (mid["epoch"], mid["batches"]) == (2, 3)
    end = _with_progress(_module(shards), 2, 4, last=True).state_dict()
    assert (end["epoch"], end["batches"]) == (3, 0)
    assert mid["order"]["seed"] == 5 and mid["order"]["world_size"] == 2 and len(mid["order"]["shards"]) == 3


def test_a_changed_order_is_named_in_a_warning(shards: str, caplog: pytest.LogCaptureFixture) -> None:
    state = _with_progress(_module(shards), 0, 2, last=False).state_dict()
    other = ImageTextDataModule(train_shards=shards, image_size=16, batch_size=4, seed=5, shuffle_buffer=10)
    other.trainer = SimpleNamespace(current_epoch=0, global_rank=0, world_size=2)
    other.load_state_dict(state)
    assert "batch_size 3 -> 4" in caplog.text
