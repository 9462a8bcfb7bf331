"""Which checkpoint ``dalle-train resume=...`` continues from.

Every training run keeps ``checkpoints/last.ckpt`` in its Hydra run directory (``<paths.runs>/<stage>/<time>/``):
a file single-process, a sharded directory under ``strategy=sharded_powersgd``. ``resume=auto`` picks the newest
of the stage's (the last one written, so a run that was itself resumed and then killed again is continued, not
its predecessor); ``resume=PATH`` names one; ``resume=null`` starts from scratch.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

AUTO = "auto"
LAST = "last.ckpt"


def newest_checkpoint(runs: Path, stage: str, exclude: Path | None = None) -> Path | None:
    """The most recently written ``<runs>/<stage>/*/checkpoints/last.ckpt`` (not under ``exclude``), or None."""
    found = [p for p in (runs / stage).glob(f"*/checkpoints/{LAST}")
             if exclude is None or exclude.resolve() not in p.resolve().parents]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def resume_checkpoint(cfg: DictConfig, run_dir: Path | None = None) -> str | None:
    """The checkpoint ``cfg.resume`` asks for, as a path for ``Trainer.fit(ckpt_path=...)``; None to start afresh.

    ``run_dir`` (this run's own directory) is never a candidate for ``auto``. Raises a one-line ``ValueError`` or
    ``FileNotFoundError`` for a value that names no checkpoint."""
    value = cfg.get("resume")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"resume={value!r}; expected null, auto, or the path of a checkpoint (checkpoints/{LAST})")
    if cfg.stage.name == "tokenizer":
        raise ValueError(f"resume={value} with stage=tokenizer; expected resume=null (the tokenizer trains without "
                         "checkpoints)")
    if value == AUTO:
        runs = Path(cfg.paths.runs)
        found = newest_checkpoint(runs, cfg.stage.name, run_dir)
        if found is None:
            raise FileNotFoundError(f"resume=auto found no checkpoint {runs / cfg.stage.name}/*/checkpoints/{LAST}; "
                                    f"expected an earlier {cfg.stage.name} run of this work_dir, or resume=PATH")
        return str(found)
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(f"resume={value}: no such checkpoint; expected a checkpoint file or sharded "
                                f"checkpoint directory (<run>/checkpoints/{LAST}), or resume=auto")
    return str(path)
