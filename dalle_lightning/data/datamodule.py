"""LightningDataModules over WebDataset shards: image-text pairs (dVAE, CLIP) and token pairs (prior).

Both read any WebDataset shards (local paths, brace patterns, lists, remote URLs), split them among ranks
and loader workers so each consumer sees different samples, shuffle with a buffer, and batch. A shard that
cannot be read (empty, truncated, not a tar) or a sample that cannot be used (corrupt image, missing/empty
caption, non-UTF-8 text, bad token arrays, a wrong code count, an out-of-range code or id) is skipped, counted
by reason and logged; it never stops training. The counts (``skipped``, ``skip_counts()``) include the loader
workers' (``data.skips``); ``dalle_lightning_callbacks.skipped_samples`` sums them over ranks into metrics. A training pass that
yields no batch at all is an error naming the shards (``data.epoch_loader``), not an endless run of empty epochs.

The training order is a function of the seed and the epoch alone (shards, samples, and each sample's
augmentation), a new one every epoch (``data.resumable_loader``). A data module's ``state_dict`` is where
training is in it (the epoch and the batches of it trained on); Lightning keeps it in checkpoints, and a resumed
run continues the epoch with the batch the interrupted run would have drawn next.
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from dalle_lightning.data.epoch_loader import NonEmptyLoader
from dalle_lightning.data.resumable_loader import ResumableLoader
from dalle_lightning.data.shards import consumer_index, split_for
from dalle_lightning.data.skips import SharedCounts, SkipCounter, read_shards
from dalle_lightning.data.splits import Split, probe, resolve_splits
from dalle_lightning.data.tar_members import IMAGE_KEYS
from dalle_lightning.data.transforms import (CONVERSIONS, WHITE, ImageTooLarge, background_colour, center_square_resize,
                                             decode_image, paper_augment, to_tensor)

log = logging.getLogger(__name__)

EPOCH_KEY = "__epoch__"  # set on every raw sample: per-sample draws (augmentation) depend on (seed, epoch, sample)


RANK_SPLITS = ("samples", "shards")
CUT_CAPTION = "caption cut to text_len"


class ShardStream(IterableDataset):
    """One pass over this consumer's part of the shards: tar members grouped into samples, shuffled, decoded.

    ``epoch`` (``set_epoch``) reseeds shard and sample shuffling so each epoch has a new order, identical across
    reruns; every raw sample carries it as ``__epoch__`` for the decoder's own draws.

    ``split`` says how ranks (and loader workers) share the data:

    - ``"samples"``: every consumer reads the same shuffled stream and keeps its own sample of each complete
      group of ``consumers`` samples. Every rank yields exactly as many samples, hence as many batches, which
      distributed training needs: a rank that runs out first would leave the others waiting in a collective
      (every sharded forward is one). A sample that fails to decode is replaced by this consumer's previous
      good one (and counted), so the counts stay equal. Costs reading every shard on every rank: right for
      small sets and few ranks.
    - ``"shards"``: each consumer reads its own shards (``split_for``): sequential reads of disjoint data, for
      large corpora. The shards must hold equal numbers of usable samples per rank, or ranks fall out of step.
    """

    def __init__(self, urls: list[str], decode: Any, rank: int, world_size: int, shuffle: int, seed: int,
                 split: str = "samples", skipped: SkipCounter | None = None,
                 keep: Callable[[dict[str, Any]], bool] | None = None) -> None:
        super().__init__()
        if split not in RANK_SPLITS:
            raise ValueError(f"rank_split={split!r}; expected one of {RANK_SPLITS}")
        self.urls, self.decode, self.rank, self.world_size = urls, decode, rank, world_size
        self.shuffle, self.seed, self.epoch, self.split = shuffle, seed, 0, split
        self.skipped = skipped  # where unreadable shards are counted (None: logged only)
        self.keep = keep  # which raw samples belong to this split (data.splits.HoldOut), before any shuffling
        self.replaced = 0  # undecodable samples stood in for by the previous good one ("samples" split)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        urls = list(self.urls)
        if self.shuffle:
            rng.shuffle(urls)
        consumer, consumers = consumer_index(self.rank, self.world_size)
        by_sample = self.split == "samples" and consumers > 1
        mine = urls if by_sample else split_for(urls, self.rank, self.world_size)
        # Every consumer reads every shard in the "samples" split: only the first counts a shard it cannot read.
        stream = read_shards(mine, self.skipped if not by_sample or consumer == 0 else None, self.keep)
        stream = ({**sample, EPOCH_KEY: self.epoch} for sample in stream)
        if self.shuffle:
            stream = wds.filters._shuffle(stream, self.shuffle, initial=min(100, self.shuffle), rng=rng)
        if not by_sample:
            for sample in stream:
                out = self.decode(sample)
                if out is not None:
                    yield out
            return
        previous, group = None, []
        for sample in stream:
            group.append(sample)
            if len(group) < consumers:
                continue  # a partial last group is dropped on every consumer alike
            out = self.decode(group[consumer])
            group = []
            if out is None:
                if previous is None:
                    continue  # nothing to stand in yet (the first sample of the epoch is bad)
                self.replaced += 1
                out = previous
            previous = out
            yield out


class WebDataModule(pl.LightningDataModule):
    """Shared plumbing: shard resolution, rank split, loaders. Subclasses define ``decode(sample)``.

    ``train_shards`` and ``val_shards`` may be ``auto``: found under ``world`` (``data.splits``: ``train/`` and
    ``val/`` folders, or one folder of shards with validation held out of the last training shard)."""

    unit = "sample"  # what a split holds, for messages

    def __init__(
        self,
        train_shards: str | Sequence[str] | None = None,
        val_shards: str | Sequence[str] | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        rank_split: str = "samples",
        world: str | None = None,
        val_holdout: float = 0.1,
        world_key: str = "paths.world",
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if rank_split not in RANK_SPLITS:
            raise ValueError(f"rank_split={rank_split!r}; expected one of {RANK_SPLITS}")
        self.rank_split = rank_split
        self.train_shards, self.val_shards = train_shards, val_shards
        self.world, self.val_holdout, self.world_key = world, val_holdout, world_key
        self._splits: tuple[Split, Split | None] | None = None
        self.batch_size, self.num_workers = batch_size, num_workers
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.skipped = SkipCounter(workers=num_workers)
        self._train: ShardStream | None = None
        self._resume: dict[str, Any] | None = None  # a checkpoint's position, used by the next training pass

    def decode(self, sample: dict[str, Any]) -> dict[str, Any] | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def splits(self) -> tuple[Split, Split | None]:
        """The training and validation splits (``data.splits``), resolved once (and said once)."""
        if self._splits is None:
            if self.train_shards is None:
                raise ValueError("data.train_shards=None; expected auto (the shards under the world folder), a "
                                 "directory of .tar shards, a shard or a brace pattern")
            self._splits = resolve_splits(self.world, self.train_shards, self.val_shards, self.val_holdout,
                                          world_key=self.world_key)
        return self._splits

    def has_validation(self) -> bool:
        """Whether a validation split exists (a ``val/`` folder, given shards, or a held-out slice)."""
        return self.splits()[1] is not None

    def stream(self, split: Split, shuffle: int, decode: Any = None) -> ShardStream:
        rank, world = self._rank()
        return ShardStream(split.urls, decode or self.decode, rank, world, shuffle, self.seed, self.rank_split,
                           self.skipped, keep=split.keep)

    def probe_decode(self, sample: dict[str, Any]) -> Any:
        """Decode one sample as validation does (no augmentation draws), for ``probe``."""
        return self.decode(sample)

    def check_readable(self) -> None:
        """Each split's first samples decode (``data.splits.probe``): an unreadable split fails before training."""
        for split in self.splits():
            if split is not None:
                self.probe_split(split)

    def probe_split(self, split: Split) -> None:
        """``data.splits.probe`` of one split with this module's decoder (training's, or ``dalle-encode``'s). The
        probe counts into counters of its own, so the run's counts are those of its passes over the data."""
        counters = {name: getattr(self, name) for name in ("skipped", "converted") if hasattr(self, name)}
        self.skipped = SkipCounter(quiet=True)
        if "converted" in counters:
            self.converted = SharedCounts(counters["converted"].names)
        try:
            probe(split, lambda urls: read_shards(urls, self.skipped), self.probe_decode, self.skipped.summary,
                  self.unit)
        finally:
            for name, counter in counters.items():
                setattr(self, name, counter)

    def skip_counts(self) -> dict[str, int]:
        """Skipped shards and samples of this process and its loader workers, by reason (every reason listed)."""
        return dict(self.skipped)

    @override
    def setup(self, stage: str) -> None:
        # Resolve and read a few samples of each split now, so a missing or unreadable shard fails before any model
        # work, not at the first validation after hours of training.
        if stage == "fit":
            self.check_readable()

    def _loader(self, dataset: ShardStream, train: bool = False) -> DataLoader:
        # An own generator for the workers' base seed: from torch's global one, every pass (validation too) would
        # shift the model's draws, and a resumed run, which does not repeat every pass, would draw differently.
        kwargs: dict[str, Any] = dict(batch_size=self.batch_size, num_workers=self.num_workers,
                                      persistent_workers=False, pin_memory=False,
                                      generator=torch.Generator().manual_seed(self.seed))
        # A pass without a single batch is an error (not an endless run, nor a validation loss never measured).
        if train:  # epoch-seeded and resumable
            return ResumableLoader(dataset, position=self._position, seed=self.seed, shards=dataset.urls,
                                   skipped=self.skipped.summary, **kwargs)
        return NonEmptyLoader(dataset, shards=dataset.urls, skipped=self.skipped.summary, split="validation", **kwargs)

    @override
    def train_dataloader(self) -> DataLoader:
        self._train = self.stream(self.splits()[0], self.shuffle_buffer)
        return self._loader(self._train, train=True)

    def _order(self) -> dict[str, Any]:
        """What the training order depends on besides the epoch: resuming with other values cannot be exact."""
        _, world = self._rank()
        return {"seed": self.seed, "batch_size": self.batch_size, "world_size": world, "num_workers": self.num_workers,
                "rank_split": self.rank_split, "shuffle_buffer": self.shuffle_buffer,
                "shards": [url.rsplit("/", 1)[-1] for url in self.splits()[0].urls]}

    def _position(self) -> tuple[int, int]:
        """(epoch, batches of it already trained on) for the training pass about to start (``ResumableLoader``).

        A resumed run's first pass starts where its checkpoint says: Lightning builds that pass before it moves its
        own epoch counter past an epoch the checkpoint had finished."""
        resume, self._resume = self._resume, None
        if resume is not None:
            return resume["epoch"], resume["batches"]
        return (self.trainer.current_epoch if self.trainer is not None else 0), 0

    @override
    def state_dict(self) -> dict[str, Any]:
        """Where training is in the data, for checkpoints: the epoch and the batches of it trained on.

        Read from the fit loop, not counted at the loader: the loader runs ahead of training (Lightning fetches a
        batch before the one it trains on is done), and a checkpoint comes after the update of its last batch. After
        an epoch's last batch the position is the start of the next epoch, where training goes on."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit" or self.train_shards is None:
            return {}
        progress = trainer.fit_loop.epoch_loop.batch_progress
        epoch, batches = trainer.current_epoch, progress.current.processed
        if progress.is_last_batch and batches:
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "batches": batches, "order": self._order()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        saved, now = state_dict.get("order", {}), self._order()
        changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
        if changed:
            log.warning("the training data order changed since the checkpoint (%s); the resumed epoch continues "
                        "after %d batches of the new order, not exactly where it stopped", "; ".join(changed),
                        state_dict["batches"])
        self._resume = {"epoch": int(state_dict["epoch"]), "batches": int(state_dict["batches"])}

    @override
    def val_dataloader(self) -> DataLoader | list:
        val = self.splits()[1]
        if val is None:
            return []
        return self._loader(self.stream(val, 0))


def caption_text(sample: dict[str, Any], skipped: SkipCounter, key: str) -> str | None:
    """The sample's caption, stripped; None (skipped and counted) when missing, not UTF-8 or empty."""
    raw = sample.get("txt")
    if raw is None:
        skipped.skip("missing caption", key)
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        skipped.skip("caption is not UTF-8", key)
        return None
    if not text:
        skipped.skip("empty caption", key)
        return None
    return text


class ImageTextDataModule(WebDataModule):
    """Image-caption pairs (the shapes world, or img2dataset output with jpg/png + txt).

    Batches: {"image": FloatTensor[B,3,S,S] in [0,1], "text": list[str]}. ``augment`` applies the paper's
    crop-resize-crop (and ``random_flip``) to training images only; validation uses a centre crop. Images are
    decoded as a viewer shows them (``transforms.decode_image``): transparency composited onto ``background``,
    EXIF orientation applied, 16-bit greyscale scaled; ``conversion_counts()`` says how many needed each.
    """

    unit = "image-caption sample"

    def __init__(self, image_size: int = 64, augment: bool = False, random_flip: bool = False,
                 background: Sequence[int] = WHITE, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if image_size <= 0:
            raise ValueError(f"image_size={image_size} must be positive")
        self.image_size, self.augment, self.random_flip = image_size, augment, random_flip
        self.background = background_colour(background)
        self.converted = SharedCounts(CONVERSIONS, workers=self.num_workers)

    def conversion_counts(self) -> dict[str, int]:
        """Decoded images that needed each of ``transforms.CONVERSIONS``, over this process and its loader workers."""
        return dict(self.converted)

    def augment_rng(self, sample: dict[str, Any]) -> random.Random:
        """The draws of one sample's augmentation: a function of (seed, epoch, shard, key), so they are the same
        whichever rank or loader worker decodes the sample, and again when a resumed run re-reads it."""
        shard = str(sample.get("__url__", "")).rsplit("/", 1)[-1]
        return random.Random(f"{self.seed}/{sample.get(EPOCH_KEY, 0)}/{shard}/{sample.get('__key__')}")

    def decode(self, sample: dict[str, Any], train: bool = True) -> dict[str, Any] | None:
        key = f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}"
        data = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if data is None:
            self.skipped.skip("missing image", key)
            return None
        text = caption_text(sample, self.skipped, key)
        if text is None:
            return None
        try:
            img = decode_image(data, self.background, lambda name: self.converted.add(name, key))
        except ImageTooLarge as exc:  # a decompression bomb: refused before its pixels were decoded
            self.skipped.skip("image too large", key, str(exc))
            return None
        except Exception as exc:  # PIL raises many types for corrupt files
            self.skipped.skip("corrupt image", key, type(exc).__name__)
            return None
        if train and self.augment:
            img = paper_augment(img, self.image_size, self.augment_rng(sample), flip=self.random_flip)
        else:
            img = center_square_resize(img, self.image_size)
        return {"image": to_tensor(img), "text": text}

    @override
    def val_dataloader(self) -> DataLoader | list:
        val = self.splits()[1]
        if val is None:
            return []
        return self._loader(self.stream(val, 0, lambda s: self.decode(s, train=False)))

    def probe_decode(self, sample: dict[str, Any]) -> Any:
        return self.decode(sample, train=False)


class TokenDataModule(WebDataModule):
    """Token shards written by ``dalle-encode`` (``codes.npy`` image codes, ``ids.npy`` caption ids, ``txt``).

    Batches: {"text": LongTensor[B, text_len] (0 = padding), "image": LongTensor[B, grid*grid],
    "caption": list[str]} (the caption string, for evaluation only).
    With a ``tokenizer`` and ``bpe_dropout`` > 0 the caption is re-encoded with BPE dropout (paper: 10%).
    """

    unit = "token sample"

    def __init__(self, text_len: int = 256, image_tokens: int | None = None, tokenizer: Any = None,
                 bpe_dropout: float = 0.0, image_grid: int | None = None, image_vocab_size: int | None = None,
                 text_vocab_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text_len, self.tokenizer, self.bpe_dropout = text_len, tokenizer, bpe_dropout
        # Expected codes per sample: given, or the prior's grid squared (None: no check).
        self.image_tokens = image_tokens if image_tokens is not None else (image_grid**2 if image_grid else None)
        self.image_vocab_size, self.text_vocab_size = image_vocab_size, text_vocab_size
        if bpe_dropout and tokenizer is None:
            raise ValueError(f"bpe_dropout={bpe_dropout} needs a tokenizer to re-encode captions")
        # Captions with more ids than the prior's positions: cut, and never silently (data/converted/*).
        self.converted = SharedCounts((CUT_CAPTION,), workers=self.num_workers)

    def conversion_counts(self) -> dict[str, int]:
        """Samples whose caption had more ids than ``text_len`` and was cut, once per sample."""
        return dict(self.converted)

    def _bad_tokens(self, codes: np.ndarray, ids: np.ndarray) -> str | None:
        """Why a sample's arrays cannot train this prior (one reason of ``data.skips.REASONS``), or None."""
        if self.image_tokens is not None and codes.size != self.image_tokens:
            return "wrong image token count"
        if self.image_vocab_size is not None and codes.size and (codes.min() < 0 or codes.max() >= self.image_vocab_size):
            return "image code out of range"
        if self.text_vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= self.text_vocab_size):
            return "caption id out of range"
        return None

    def decode(self, sample: dict[str, Any]) -> dict[str, Any] | None:
        key = f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}"
        try:
            codes = np.load(io.BytesIO(sample["codes.npy"]))
            ids = np.load(io.BytesIO(sample["ids.npy"]))
            if not (np.issubdtype(codes.dtype, np.integer) and np.issubdtype(ids.dtype, np.integer)):
                raise TypeError(f"dtypes {codes.dtype}, {ids.dtype}")
        except Exception as exc:
            self.skipped.skip("bad token arrays", key, type(exc).__name__)
            return None
        reason = self._bad_tokens(codes, ids)
        if reason is not None:
            self.skipped.skip(reason, key, f"{codes.size} codes in [{codes.min(initial=0)}, {codes.max(initial=0)}], "
                                           f"{ids.size} ids in [{ids.min(initial=0)}, {ids.max(initial=0)}]")
            return None
        if self.tokenizer is not None and self.bpe_dropout:
            text = caption_text(sample, self.skipped, key)
            if text is None:
                return None
            self.tokenizer.set_dropout(self.bpe_dropout)
            ids = np.asarray(self.tokenizer.encode(text))
        else:  # the caption string only feeds evaluation (the contrastive score), so a bad one is not fatal
            text = bytes(sample.get("txt") or b"").decode("utf-8", errors="replace").strip()
        text_ids = torch.zeros(self.text_len, dtype=torch.long)
        if ids.size > self.text_len and self.converted.add(CUT_CAPTION, key) and self.converted[CUT_CAPTION] == 1:
            log.warning("%s: a caption of %d ids cut to text_len=%d (counted as data/converted/%s); expected token "
                        "shards encoded with the prior's text_len: re-encode them (dalle-encode force=true) with the "
                        "tokenizer the prior reads", key, ids.size, self.text_len, CUT_CAPTION.replace(" ", "_"))
        ids = torch.from_numpy(ids.astype(np.int64))[: self.text_len]
        text_ids[: ids.numel()] = ids
        image = torch.from_numpy(codes.astype(np.int64)).reshape(-1)
        return {"text": text_ids, "image": image, "caption": text}
