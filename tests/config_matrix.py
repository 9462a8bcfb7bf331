"""The combinations the config test composes: every option of every ``dalle-train`` group, with each stage it
applies to, read from the config files themselves so that a new option is composed without anyone listing it.

Which stages an option applies to, first rule that places it:

1. an option named after a stage (``data/dvae``, ``model/prior_paper``, ``sweep/dvae_grid``) applies to that stage;
2. an option whose defaults list overrides ``/model`` (``experiment/paper_dvae``) applies to that model's stage
   (to every stage when it picks the model by ``${stage}``, as ``experiment/shapes_long``);
3. a base that other options of its group list in their defaults (``data/images``, ``callbacks/common``,
   ``trainer/cpu``) applies to every stage those options apply to;
4. an option of a group that only the Trainer reads (trainer, strategy, precision, logger) applies to the stages
   that train a LightningModule (their stage file has ``module``); any other option applies to every stage.

A group that ``train.yaml`` picks by ``${stage}`` (model, data, callbacks) has only options of rules 1 and 3: an
option there that names no stage applies to none, and the coverage test fails on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAINER_GROUPS = frozenset({"trainer", "strategy", "precision", "logger"})  # rule 4
APPS = ("encode", "eval", "generate", "world")  # the other apps' primary configs


@dataclass(frozen=True)
class Combination:
    """One option of one group composed with one stage of ``dalle-train``."""

    group: str
    option: str
    stage: str

    @property
    def id(self) -> str:
        return self.stage if self.group == "stage" else f"{self.group}={self.option}@{self.stage}"

    def overrides(self) -> list[str]:
        """The command line that selects this combination (``+group=`` for a group train.yaml does not list)."""
        if self.group == "stage":
            return [f"stage={self.option}"]
        listed = self.group in train_defaults() or self.group.startswith("hydra/")
        return [f"stage={self.stage}", f"{'' if listed else '+'}{self.group}={self.option}"]


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


@cache
def groups() -> dict[str, tuple[str, ...]]:
    """Every config group under ``conf/`` (``hydra/launcher`` included) -> its options, from the files."""
    found: dict[str, list[str]] = {}
    for path in sorted(CONF.rglob("*.yaml")):
        if path.parent != CONF:
            found.setdefault(path.parent.relative_to(CONF).as_posix(), []).append(path.stem)
    return {group: tuple(options) for group, options in found.items()}


@cache
def train_defaults() -> dict[str, str]:
    """train.yaml's defaults list: group -> default option (``${stage}`` where the stage picks it)."""
    entries = load(CONF / "train.yaml")["defaults"]
    return {key: value for entry in entries if isinstance(entry, dict) for key, value in entry.items()}


def stages() -> tuple[str, ...]:
    return groups()["stage"]


def trainer_stages() -> set[str]:
    """Stages that train a LightningModule with a Trainer: their stage file configures ``module``."""
    return {stage for stage in stages() if "module" in load(CONF / "stage" / f"{stage}.yaml")}


def defaults_of(group: str, option: str) -> list[Any]:
    return load(CONF / group / f"{option}.yaml").get("defaults", [])


def named_stage(option: str) -> str | None:
    """The stage an option is named after (``dvae`` and ``dvae_paper`` -> ``dvae``), if any."""
    return next((s for s in stages() if option == s or option.startswith(f"{s}_")), None)


def applicable(group: str, option: str) -> set[str]:
    """The stages ``group/option`` composes with (the module docstring's rules, in order)."""
    if group == "stage":
        return {option}
    stage = named_stage(option)
    if stage is not None:
        return {stage}
    for entry in defaults_of(group, option):
        if isinstance(entry, dict) and "override /model" in entry:
            if "${stage}" in entry["override /model"]:  # a network per stage (experiment/shapes_long): every stage
                return set(stages())
            return applicable("model", entry["override /model"])
    users = [o for o in groups()[group] if option in defaults_of(group, o)]
    if users:
        return set().union(*(applicable(group, o) for o in users))
    if "${stage}" in str(train_defaults().get(group, "")):
        return set()
    return trainer_stages() if group in TRAINER_GROUPS else set(stages())


def combinations() -> list[Combination]:
    """Every (group, option, stage) to compose, in a stable order."""
    return [Combination(group, option, stage)
            for group, options in groups().items() for option in options
            for stage in sorted(applicable(group, option))]
