"""Which shards each split reads, for a download as img2dataset leaves it: ``train/`` and ``val/`` folders of
``.tar`` shards, or one folder of shards with no validation split at all.

A split given as ``auto`` is found under its world folder (``paths.world`` for images, ``paths.tokens`` for token
shards):

- training reads ``<world>/train`` when that folder exists, else the ``.tar`` shards directly in ``<world>``;
- validation reads ``<world>/val`` when that folder exists, else a held-out slice of the training samples: the
  samples of the *last* training shard whose key hashes into the first ``val_holdout`` share. Training skips
  exactly those samples, and every stage (tokenizer, dVAE, CLIP, ``dalle-encode``) holds out the same ones, so a
  validation figure is never measured on what was trained on. Only one shard is read for validation, however
  large the corpus.

Every choice is said in one log line; every failure is one line naming the config key, its value, what was
expected and the fix. ``probe`` reads the first few samples of a split before any training or encoding, so an
unreadable split fails at once rather than after the first epoch.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dalle_lightning.data.shards import resolve_shards

log = logging.getLogger(__name__)

AUTO = "auto"
PROBE_SAMPLES = 4  # decodable samples that show a split is readable
PROBE_BUDGET = 256  # raw samples read at most before a split is judged unreadable


@dataclass(frozen=True)
class HoldOut:
    """The samples of shard ``url`` whose key hashes below ``share``: validation's and not training's.

    ``side`` is ``"val"`` (keep only those) or ``"train"`` (keep all others). A plain class, not a closure, so a
    loader worker started by spawn can receive it."""

    url: str
    share: float
    side: str

    def held(self, sample: dict[str, Any]) -> bool:
        if sample.get("__url__") != self.url:
            return False
        return zlib.crc32(str(sample.get("__key__")).encode()) / 2**32 < self.share

    def __call__(self, sample: dict[str, Any]) -> bool:
        return self.held(sample) == (self.side == "val")


@dataclass(frozen=True)
class Split:
    """The shards of one split, the config key that named them (for messages) and the samples it keeps."""

    key: str
    spec: Any
    urls: list[str]
    keep: HoldOut | None = None

    def describe(self) -> str:
        """``data.val_shards='...'`` as the user wrote it (with the folder ``auto`` found), for one-line messages."""
        found = f" ({', '.join(sorted({os.path.dirname(u) for u in self.urls}))})" if self.spec == AUTO else ""
        return f"{self.key}={self.spec!r}{found}"


def _fail(message: str) -> None:
    raise FileNotFoundError(message)


def train_urls(key: str, spec: Any, world: str | None, world_key: str) -> list[str]:
    """The training shards: ``spec`` itself, or with ``auto`` ``<world>/train`` or the shards directly in ``world``."""
    if spec != AUTO:
        return resolve_shards(spec, key=key)
    expected = ("expected an img2dataset download: a folder of .tar shards, or one with train/ and val/ folders of "
                f"them; set {world_key}=<that folder>, or {key}=<shards> (a directory, a shard, or "
                f"\"{key}='/data/{{00000..00099}}.tar'\" with the inner quotes)")
    if world is None:
        _fail(f"{key}=auto needs {world_key}; {expected}")
    folder = Path(str(world))
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        _fail(f"{key}=auto: {world_key}={str(world)!r} {what}; {expected}")
    if (folder / "train").is_dir():
        return resolve_shards(str(folder / "train"), key=key)
    found = sorted(str(p) for p in folder.glob("*.tar"))
    if not found:
        _fail(f"{key}=auto: {world_key}={str(world)!r} holds neither a train/ folder nor .tar shards; {expected}")
    log.info("%s has no train/ folder: training on the %d .tar shards in it", world_key, len(found))
    return found


def _val_shards(spec: Any, key: str) -> list[str]:
    """``resolve_shards`` for a validation split, whose one-line error also names the way to go without one."""
    try:
        return resolve_shards(spec, key=key)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}; or {key}=null for no validation") from None


def resolve_splits(world: str | None, train: Any, val: Any, val_holdout: float, prefix: str = "data.",
                   world_key: str = "paths.world", announce: bool = True,
                   keys: tuple[str, str] | None = None) -> tuple[Split, Split | None]:
    """The training split and the validation split (None: no validation) of a data config.

    ``val=auto`` without a ``val/`` folder holds out ``val_holdout`` of the last training shard's samples (0: no
    validation); ``announce`` says so in one log line. ``keys`` name the two splits in messages (default
    ``<prefix>train_shards``, ``<prefix>val_shards``), ``prefix`` the holdout key."""
    train_key, val_key = keys or (f"{prefix}train_shards", f"{prefix}val_shards")
    urls = train_urls(train_key, train, world, world_key)
    training = Split(train_key, train, urls)
    if val is None:
        return training, None
    if val != AUTO:
        return training, Split(val_key, val, _val_shards(val, val_key))
    folder = Path(str(world)) / "val" if world is not None else None
    if folder is not None and folder.is_dir():
        return training, Split(val_key, val, _val_shards(str(folder), val_key))
    if not isinstance(val_holdout, (int, float)) or isinstance(val_holdout, bool) or not 0 <= val_holdout < 1:
        raise ValueError(f"{prefix}val_holdout={val_holdout!r}; expected a share in [0, 1) of the last training shard's "
                         "samples to hold out for validation")
    if val_holdout == 0:
        if announce:
            log.info("%s=auto: no val/ folder in %s and %sval_holdout=0: no validation split", val_key,
                     world_key, prefix)
        return training, None
    last = urls[-1]
    if announce:
        log.info("%s=auto: no val/ folder in %s, so validation holds out the samples of %s whose key hashes into "
                 "its first %g%% (%sval_holdout=%g), and the training split leaves them out; %s=null: no validation",
                 val_key, world_key, os.path.basename(last), 100 * val_holdout, prefix, val_holdout, val_key)
    return (Split(train_key, train, urls, HoldOut(last, float(val_holdout), "train")),
            Split(val_key, val, [last], HoldOut(last, float(val_holdout), "val")))


def probe(split: Split, samples: Callable[[list[str]], Iterator[dict[str, Any]]],
          decode: Callable[[dict[str, Any]], Any], summary: Callable[[], str], unit: str) -> None:
    """Read the split's first samples (at most ``PROBE_BUDGET``) until ``PROBE_SAMPLES`` decode; none at all is a
    one-line ``ValueError`` naming the split's key, what was skipped, and the fix. A split with fewer samples than
    that, all readable, passes."""
    good = seen = 0
    for sample in samples(split.urls):
        if split.keep is not None and not split.keep(sample):
            continue
        seen += 1
        good += decode(sample) is not None
        if good >= PROBE_SAMPLES or seen >= PROBE_BUDGET:
            break
    if good:
        return
    fix = "fix or remove those shards" + (", or set it to null to train without validation"
                                          if split.key.endswith("val_shards") or split.key.endswith(".val") else "")
    names = ", ".join(os.path.basename(u) for u in split.urls[:3]) + (f" and {len(split.urls) - 3} more"
                                                                       if len(split.urls) > 3 else "")
    raise ValueError(f"{split.describe()}: no readable {unit} in its {len(split.urls)} shard(s) ({names}): "
                     f"{seen} sample(s) read, skipped: {summary()}; expected WebDataset shards of {unit}s: {fix}")

