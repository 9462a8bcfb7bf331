"""Input checks the commands run before any model loads: each bad value is one line naming the key, the value and
what is expected (``ValueError``, reported by ``one_line_errors`` with exit code 2).

Hydra hands over whatever the command line said (``lr=abc`` arrives as the string ``'abc'``); without these checks
such a value fails deep inside a library, after minutes of loading or training, with a traceback.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def value(cfg: DictConfig, key: str) -> Any:
    """The value at a dotted ``key`` (None when absent)."""
    return OmegaConf.select(cfg, key, default=None)


def _fail(key: str, got: Any, expected: str) -> None:
    raise ValueError(f"{key}={got!r}; expected {expected}")


def integer(cfg: DictConfig, key: str, minimum: int | None = None, optional: bool = False,
            allowed: Iterable[int] = ()) -> None:
    """An int (not a bool), at least ``minimum``, or one of ``allowed`` (e.g. -1 for "unlimited")."""
    got = value(cfg, key)
    if got is None and optional:
        return
    extra = list(allowed)
    ok = isinstance(got, int) and not isinstance(got, bool) and (got in extra or minimum is None or got >= minimum)
    if not ok:
        what = "an integer" if minimum is None else f"an integer >= {minimum}"
        if extra:
            what += " or " + " or ".join(str(a) for a in extra)
        _fail(key, got, what + (" (or null)" if optional else ""))


def number(cfg: DictConfig, key: str, low: float | None = None, high: float | None = None,
           low_open: bool = False, optional: bool = False) -> None:
    """A real number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    got = value(cfg, key)
    if got is None and optional:
        return
    ok = isinstance(got, (int, float)) and not isinstance(got, bool) and got == got
    if ok and low is not None:
        ok = got > low if low_open else got >= low
    if ok and high is not None:
        ok = got <= high
    if not ok:
        bounds = {(True, True): f" in {'(' if low_open else '['}{low}, {high}]",
                  (True, False): f" {'>' if low_open else '>='} {low}", (False, True): f" <= {high}",
                  (False, False): ""}[(low is not None, high is not None)]
        _fail(key, got, "a number" + bounds + (" (or null)" if optional else ""))


def boolean(cfg: DictConfig, key: str) -> None:
    got = value(cfg, key)
    if not isinstance(got, bool):
        _fail(key, got, "true or false")


def boolean_or_auto(cfg: DictConfig, key: str) -> None:
    got = value(cfg, key)
    if not isinstance(got, bool) and got != "auto":
        _fail(key, got, "true, false or auto")


def device(cfg: DictConfig, key: str = "device") -> None:
    """``auto``, ``cpu``, or ``cuda``/``cuda:N`` on a machine that has that GPU."""
    import torch

    got = value(cfg, key)
    if got in ("auto", "cpu"):
        return
    if isinstance(got, str) and (got == "cuda" or got.startswith("cuda:")):
        index = got.partition(":")[2]
        if not torch.cuda.is_available():
            _fail(key, got, "cpu (this machine has no CUDA device)")
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            _fail(key, got, f"cuda or cuda:N with N < {torch.cuda.device_count()}")
        return
    _fail(key, got, "auto, cpu or cuda")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(key: str, got: str, folder: Path) -> None:
    """The nearest existing ancestor of ``folder`` (itself included) is a directory a file can be created in
    (tried, then removed)."""
    anchor = _nearest_existing(folder)
    if not anchor.is_dir():
        _fail(key, got, f"a path under a directory, but {str(anchor)!r} is a file")
    probe = anchor / f".dalle-write-test-{uuid.uuid4().hex[:8]}"
    try:
        probe.touch()
    except OSError as exc:
        _fail(key, got, f"a writable location ({str(anchor)!r}: {exc.strerror or type(exc).__name__})")
    else:
        probe.unlink(missing_ok=True)


def output_file(cfg: DictConfig, key: str) -> None:
    """A file path that can be written: not a directory, its parent a writable directory (or creatable)."""
    got = value(cfg, key)
    if got is None:
        return
    if not isinstance(got, str) or not got:
        _fail(key, got, "a file path")
    path = Path(os.path.abspath(got))
    if path.is_dir():
        _fail(key, got, "a file path, not a directory")
    _check_writable(key, got, path.parent)


def output_dir(cfg: DictConfig, key: str) -> None:
    """A directory path that can be created or written: not a file, nor under one."""
    got = value(cfg, key)
    if not isinstance(got, str) or not got:
        _fail(key, got, "a directory path")
    path = Path(os.path.abspath(got))
    if path.exists() and not path.is_dir():
        _fail(key, got, "a directory, not a file")
    _check_writable(key, got, path)


def input_file(cfg: DictConfig, key: str, what: str, optional: bool = False) -> None:
    """An existing file (``what`` says which, e.g. "a trained dVAE file (dalle-train stage=dvae)")."""
    got = value(cfg, key)
    if got is None and optional:
        return
    if not isinstance(got, str) or not Path(got).is_file():
        _fail(key, got, f"an existing file: {what}")


def models(cfg: DictConfig, optional_clip: bool = True) -> None:
    """The artifact paths of ``dalle-generate`` and ``dalle-eval`` exist (their kinds are checked on reading)."""
    input_file(cfg, "prior", "a trained prior (dalle-train stage=prior)")
    input_file(cfg, "dvae", "a trained dVAE (dalle-train stage=dvae)")
    input_file(cfg, "tokenizer", "a tokenizer.json (dalle-train stage=tokenizer)")
    input_file(cfg, "clip", "a trained CLIP (dalle-train stage=clip)", optional=optional_clip)


def choice(cfg: DictConfig, key: str, allowed: Iterable[str]) -> None:
    """One of the names in ``allowed``."""
    allowed = list(allowed)
    if value(cfg, key) not in allowed:
        _fail(key, value(cfg, key), "one of " + "|".join(allowed))


def rerank(cfg: DictConfig) -> None:
    """``rerank`` names a reranker, and one that uses the contrastive model has one."""
    from dalle_lightning.generation.selection import RERANKERS

    choice(cfg, "rerank", RERANKERS)
    if cfg.rerank == "both" and value(cfg, "clip") is None:
        _fail("rerank", cfg.rerank, "clip or prior when clip=null (both needs the contrastive model)")


def sampling(cfg: DictConfig) -> None:
    """The sampling settings ``dalle-generate`` and ``dalle-eval`` share, and the device they run on."""
    rerank(cfg)
    integer(cfg, "batch_size", minimum=1)
    number(cfg, "temperature", low=0, low_open=True)
    integer(cfg, "top_k", minimum=1, optional=True)
    number(cfg, "top_p", low=0, high=1, low_open=True, optional=True)
    number(cfg, "cond_scale")
    integer(cfg, "seed")
    device(cfg)
    models(cfg)


def training(cfg: DictConfig) -> None:
    """``dalle-train``'s values that libraries would otherwise reject late (or with a traceback)."""
    integer(cfg, "seed")
    boolean(cfg, "stage.force")
    boolean(cfg, "verbose")
    choice(cfg, "float32_matmul_precision", ("highest", "high", "medium"))
    output_file(cfg, "output")
    if cfg.stage.name == "tokenizer":
        return
    integer(cfg, "trainer.max_steps", minimum=1, allowed=(-1,))
    integer(cfg, "trainer.max_epochs", minimum=1, allowed=(-1,), optional=True)
    integer(cfg, "trainer.accumulate_grad_batches", minimum=1)
    integer(cfg, "trainer.log_every_n_steps", minimum=1)
    number(cfg, "trainer.gradient_clip_val", low=0, low_open=True, optional=True)
    integer(cfg, "data.batch_size", minimum=1)
    integer(cfg, "data.num_workers", minimum=0)
    integer(cfg, "data.shuffle_buffer", minimum=0)
    for key in ("lr", "weight_decay", "eps"):
        if value(cfg, f"module.optimizer.{key}") is not None:
            number(cfg, f"module.optimizer.{key}", low=0, low_open=key != "weight_decay")
    accelerator = value(cfg, "trainer.accelerator")
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            _fail("trainer.accelerator", accelerator, "cpu or auto (this machine has no CUDA device)")


def saved_models(cfg: DictConfig) -> None:
    """Every saved model a callback loads (``*.from_saved`` nodes: the prior's FID features and contrastive scorer)
    exists, before anything is built or trained: one line naming the callback's key and the fix."""
    callbacks = value(cfg, "callbacks") or {}
    for name, node in callbacks.items():
        if not OmegaConf.is_dict(node):
            continue
        for field, sub in node.items():
            if not (OmegaConf.is_dict(sub) and str(sub.get("_target_", "")).endswith(".from_saved")):
                continue
            path = sub.get("path")
            if isinstance(path, str) and not Path(path).is_file():
                stage = "clip" if "rerank" in str(sub._target_) else "the stage that writes it"
                _fail(f"callbacks.{name}.{field}.path", path,
                      f"an existing file: the trained CLIP (`dalle-train stage={stage}` writes paths.clip), or "
                      f"train without this callback ('~callbacks.{name}')")
            if isinstance(path, str) and "rerank" in str(sub._target_):  # read as data now, not after the data
                from dalle_lightning.artifacts import read_record

                read_record(path, "clip", f"callbacks.{name}.{field}.path")
