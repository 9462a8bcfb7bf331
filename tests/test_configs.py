"""Every config composes and builds, so a config that cannot build fails here instead of in a user's run.

Each option of each ``dalle-train`` group is composed with every stage it applies to (``tests/config_matrix.py``
reads which from the files), then instantiated as far as this machine allows: the data module, the network on
the meta device (no memory, so the paper's 12B prior too), the LightningModule, every callback, the logger, the
strategy and the precision plugin, the Trainer (unless it asks for GPUs this machine lacks), and the Hydra plugins
and callbacks a config brings. Tiny trained artifacts stand in for the pipeline's, so ``${meta:...}`` lookups and
the callbacks that load a model resolve. The other apps' configs compose and load what those apps load.

``pytest -s tests/test_configs.py`` prints ``configs: composed N, instantiated M (...)``; the last test checks
that every option file was composed and that the counts reach a floor computed from the group listing.
"""

from __future__ import annotations

import inspect
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from dalle_lightning.cli import checks
from dalle_lightning.cli.common import check_keys, instantiate_dict, strategy_and_precision
from dalle_lightning.cli.train import TOP_LEVEL_KEYS
from tests.config_matrix import APPS, CONF, Combination, combinations, groups, load, stages, train_defaults

COMBINATIONS = combinations()
REQUIRED = {"data.train_shards": "'/data/shards/{00000..00099}.tar'"}  # values a config leaves to the user (???)
OPT_IN_GROUPS = {"sweep"}  # appended with +sweep=...; every other group of ours has a default in train.yaml
TALLY: dict[str, tuple[int, int]] = {}  # combination id -> (objects built, Trainers built)


@pytest.fixture(scope="module")
def work(tiny_artifacts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny artifacts plus a tiny CLIP (the FID callback and the apps load one): ``paths.work_dir``."""
    from dalle_lightning.artifacts import save_model

    work = tmp_path_factory.mktemp("configs")
    for path in tiny_artifacts.iterdir():
        if path.is_file():  # not the run directories of tests that ran an app on them first
            shutil.copy(path, work / path.name)
    clip = {"_target_": "dalle_lightning.models.clip.create"}
    save_model(work / "clip.pt", clip, instantiate(clip))
    return work


@pytest.fixture(scope="module")
def config_dir() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def compose_app(app: str, overrides: list[str], work: Path, run_dir: Path) -> DictConfig:
    """``app``'s config with the Hydra node, the run directory set, and any required (???) value filled in."""
    base = [*overrides, f"paths.work_dir={work}", f"hydra.runtime.output_dir={run_dir}"]
    cfg = compose(app, overrides=base, return_hydra_config=True)
    missing = missing_keys(OmegaConf.to_container(cfg, resolve=False))
    if missing:
        assert missing <= REQUIRED.keys(), f"no test value for the required key(s) {sorted(missing - REQUIRED.keys())}"
        cfg = compose(app, overrides=[*base, *(f"{key}={REQUIRED[key]}" for key in sorted(missing))],
                      return_hydra_config=True)
    return cfg


def missing_keys(node: Any, prefix: str = "") -> set[str]:
    """Dotted keys whose value is ``???`` (without resolving anything; Hydra's own node left out)."""
    if isinstance(node, dict):
        return set().union(*(missing_keys(v, f"{prefix}{k}.") for k, v in node.items() if prefix or k != "hydra"))
    return {prefix[:-1]} if node == "???" else set()


@contextmanager
def hydra_runtime(cfg: DictConfig) -> Iterator[None]:
    """``${hydra:...}`` resolves as in a run (the checkpoint and logger directories); restored afterwards."""
    instance = HydraConfig.instance()
    before = instance.cfg
    instance.set_config(cfg)
    try:
        yield
    finally:
        instance.cfg = before


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """Every value but Hydra's own, resolved: a lookup that cannot resolve fails here."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


def build_model(node: DictConfig) -> torch.nn.Module:
    """The network on the meta device: a factory that takes ``device`` is given it, the rest build inside."""
    if "device" in inspect.signature(get_method(node._target_)).parameters:
        return instantiate(node, device="meta")
    with torch.device("meta"):
        return instantiate(node)


def trainer_fits_here(cfg: DictConfig) -> bool:
    devices = cfg.trainer.devices
    return cfg.trainer.accelerator == "cpu" or torch.cuda.device_count() >= (devices if devices > 0 else 1)


def build_hydra_parts(hydra: DictConfig) -> list[Any]:
    """The sweeper, launcher and callbacks a config brings (Hydra's own basic ones only Hydra may build)."""
    nodes = [hydra.launcher, hydra.sweeper, *hydra.callbacks.values()]
    built = [instantiate(n) for n in nodes if n and not n._target_.startswith("hydra._internal.")]
    sampler = hydra.sweeper.get("sampler")
    if sampler is not None and "_target_" in sampler:
        built.append(instantiate(sampler))
    return built


def build_train(cfg: DictConfig) -> tuple[list[Any], int]:
    """Everything ``dalle-train`` builds before ``fit`` that needs no process group: (objects, Trainers built)."""
    check_keys(cfg, TOP_LEVEL_KEYS)
    resolved(cfg)
    fits = trainer_fits_here(cfg)
    if fits:
        checks.training(cfg)
    built: list[Any] = [instantiate(cfg.data), *build_hydra_parts(cfg.hydra)]
    if "module" not in cfg:  # the tokenizer stage trains no network
        return built, 0
    model = build_model(cfg.model)
    callbacks = instantiate_dict(cfg.callbacks)
    logger = instantiate(cfg.logger)
    plugins = strategy_and_precision(cfg)
    built += [model, instantiate(cfg.module, model=model), *callbacks, logger, *plugins.get("plugins", [])]
    if not isinstance(plugins["strategy"], str):
        built.append(plugins["strategy"])
    if not fits:
        return built, 0
    built.append(instantiate(cfg.trainer, callbacks=callbacks, logger=logger, **plugins))
    return built, 1


def build_app(app: str, cfg: DictConfig) -> list[Any]:
    """What each of the other apps loads or makes from its config."""
    from dalle_lightning.artifacts import load_artifact
    from dalle_lightning.generation.generate import Generator
    from dalle_lightning.data.tokenizer import CaptionTokenizer
    from dalle_lightning.world.render import render
    from dalle_lightning.world.scene import sample_scenes

    resolved(cfg)
    if app in ("generate", "eval"):
        return [Generator.from_files(cfg.prior, cfg.dvae, cfg.tokenizer, cfg.clip, device=cfg.device)]
    if app == "encode":
        return [CaptionTokenizer.load(cfg.tokenizer, text_len=cfg.text_len),
                load_artifact(cfg.dvae, stage="dvae", key="dvae")[0]]
    assert app == "world", f"no builder for the {app} app"
    return [render(sample_scenes(cfg.seed, "train", 1, cfg.image_size)[0], cfg.image_size)]


def is_default(combo: Combination) -> bool:
    """The option train.yaml picks for this stage: these build in `make test-fast`, the rest in the full suite."""
    return train_defaults().get(combo.group, "").replace("${stage}", combo.stage) == combo.option


@pytest.mark.parametrize(
    "combo", [pytest.param(c, id=c.id, marks=() if is_default(c) else pytest.mark.slow) for c in COMBINATIONS]
)
def test_combination_composes_and_builds(combo: Combination, config_dir: None, work: Path, tmp_path: Path) -> None:
    cfg = compose_app("train", combo.overrides(), work, tmp_path)
    assert cfg.stage.name == combo.stage
    assert cfg.hydra.runtime.choices[combo.group] == combo.option
    with hydra_runtime(cfg):
        built, trainers = build_train(cfg)
    assert built
    TALLY[combo.id] = (len(built), trainers)


@pytest.mark.parametrize("app", APPS)
def test_app_config_composes_and_builds(app: str, config_dir: None, work: Path, tmp_path: Path) -> None:
    cfg = compose_app(app, [], work, tmp_path)
    with hydra_runtime(cfg):
        built = build_app(app, cfg) + build_hydra_parts(cfg.hydra)
    assert built
    TALLY[f"app={app}"] = (len(built), 0)


def test_a_mistyped_shapes_key_is_an_error(config_dir: None, work: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigCompositionException, match="max_step"):
        compose_app("train", ["stage=dvae", "shapes.dvae.max_step=3"], work, tmp_path)
    cfg = compose_app("train", ["stage=dvae", "+shape.dvae.max_steps=3"], work, tmp_path)
    with pytest.raises(KeyError, match="shape"):
        check_keys(cfg, TOP_LEVEL_KEYS)


def test_each_shapes_entry_holds_exactly_the_keys_the_run_reads() -> None:
    """A misspelt key in an entry of experiment/shapes.yaml would otherwise sit there unread."""
    text = (CONF / "experiment" / "shapes.yaml").read_text()
    read = set(re.findall(r"\$\{shapes\.\$\{stage\.name\}\.(\w+)\}", text))
    # Spans only one stage has are read where that stage's files use them, with the paper's value as fallback.
    own: dict[str, set[str]] = {stage: set() for stage in stages()}
    for path in CONF.rglob("*.yaml"):
        for stage, key in re.findall(r"\$\{oc\.select:shapes\.(\w+)\.(\w+),", path.read_text()):
            own[stage].add(key)
    entries = load(CONF / "experiment" / "shapes.yaml")["shapes"]
    assert set(entries) == set(stages())
    assert {stage: set(entry) for stage, entry in entries.items()} == {s: read | own[s] for s in stages()}


def test_layout_stage_files_hold_the_stage_and_its_module_experiments_are_global() -> None:
    for stage in stages():
        assert set(load(CONF / "stage" / f"{stage}.yaml")) <= {"stage", "output", "module"}, stage
    for option in groups()["experiment"]:
        assert (CONF / "experiment" / f"{option}.yaml").read_text().startswith("# @package _global_\n"), option
    ours = {g for g in groups() if not g.startswith("hydra/")}
    assert ours - OPT_IN_GROUPS <= set(train_defaults()), "a group without a default in train.yaml"


def test_counts_reach_the_floor() -> None:
    """Runs last: every option file composed at least once, and the tally of the tests above."""
    listed = {(group, option) for group, options in groups().items() for option in options}
    assert listed == {(c.group, c.option) for c in COMBINATIONS}, "an option that applies to no stage"
    expected = [c.id for c in COMBINATIONS] + [f"app={app}" for app in APPS]
    if set(TALLY) != set(expected):
        pytest.skip("the counts are taken when every combination of this module ran and passed")
    floor = len(listed) + len(APPS)
    instantiated = sum(1 for objects, _ in TALLY.values() if objects)
    objects, trainers = (sum(column) for column in zip(*TALLY.values()))
    print(f"\nconfigs: composed {len(expected)}, instantiated {instantiated} ({objects} objects, {trainers} Trainers); "
          f"floor {floor} ({len(listed)} option files + {len(APPS)} apps)")
    assert len(expected) >= floor and instantiated >= floor
