"""A Hydra callback every command runs before Hydra makes its run directory: the paths it writes are checked.

Hydra creates the run directory (under ``paths.work_dir``) before the app's own checks run, so an unwritable
``paths.work_dir`` (read-only, no permission, a path under a regular file) used to end in a long traceback after a
half-made directory. ``on_run_start`` and ``on_multirun_start`` come first: each configured path is checked
(``checks.output_dir`` / ``checks.output_file``), and a bad one is one line naming it, exit code 2, with nothing
created.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException
from typing_extensions import override

from dalle_lightning.cli import checks
from dalle_lightning.cli.common import fail


def resolved(config: DictConfig, key: str) -> Any:
    """The value at ``key``, or None when it cannot be resolved yet (e.g. ``${hydra:runtime.output_dir}`` of a
    sweep job, known only when the job starts)."""
    try:
        return OmegaConf.select(config, key, default=None, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return None


def prepare_hydra_config(config: DictConfig, dir_key: str) -> str:
    """Make ``${hydra:...}`` resolvable before Hydra's ``run_job`` does so itself, with the same values (Hydra sets
    the same config and the same ``runtime.output_dir`` again): the run (or sweep) directory, absolute."""
    HydraConfig.instance().set_config(config)
    run_dir = os.path.abspath(str(OmegaConf.select(config, dir_key)))
    if dir_key == "hydra.run.dir":
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = run_dir
        HydraConfig.instance().set_config(config)
    return run_dir


class RunGuard(Callback):
    """Checks, before anything is made, that this command can write where it will.

    ``dirs``: config keys of directories it creates or writes into (``paths.work_dir``, ``out_dir``);
    ``files``: config keys of files it writes (``output``). The run (or sweep) directory is checked too.
    """

    def __init__(self, dirs: Sequence[str] = (), files: Sequence[str] = ()) -> None:
        self.dirs, self.files = list(dirs), list(files)

    def check_paths(self, config: DictConfig, run_dir: str, dir_key: str) -> None:
        """One line, exit code 2, for the first path that cannot be written."""
        try:
            for key in self.dirs:
                if resolved(config, key) is not None:
                    checks.output_dir(config, key)
            for key in self.files:
                if resolved(config, key) is not None:
                    checks.output_file(config, key)
            checks.output_dir(OmegaConf.create({"run": run_dir}), "run")
        except ValueError as exc:
            message = str(exc)
            fail(message.replace("run=", f"{dir_key}=", 1) if message.startswith("run=") else message)

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check_paths(config, prepare_hydra_config(config, "hydra.run.dir"), "hydra.run.dir")

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.check_paths(config, prepare_hydra_config(config, "hydra.sweep.dir"), "hydra.sweep.dir")

