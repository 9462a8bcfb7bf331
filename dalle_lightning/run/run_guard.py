"""A Hydra callback every command runs before Hydra makes its run directory: the paths it writes are checked, and
the run takes the lock of each output and of its run directory (one run per output, ``run_lock``).

Hydra creates the run directory (under ``paths.work_dir``) before the app's own checks run, so an unwritable
``paths.work_dir`` (read-only, no permission, a path under a regular file) used to end in a long traceback after a
half-made directory. ``on_run_start`` and ``on_multirun_start`` come first: each configured path is checked
(``checks.output_dir`` / ``checks.output_file``), and a bad one is one line naming it, exit code 2, with nothing
created. The run (or sweep) directory's name is fixed here, once (``${run_id:}`` draws a new one on every
resolution), so that Hydra, the app and Lightning's launcher (which passes ``hydra.run.dir`` to the processes it
starts) all see the same one. In a sweep, each job locks its outputs and its own directory when it starts and
unlocks them when it ends, so jobs with distinct outputs run side by side and jobs sharing one refuse. The ranks of
one run share its directory: rank 0 writes its log, ``.hydra/`` and checkpoints there, every other rank its own
log beside them (``rank_logs``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException
from typing_extensions import override

from dalle_lightning import inside
from dalle_lightning.plain_yaml import escaped
from dalle_lightning.cli import checks
from dalle_lightning.run import run_lock
from dalle_lightning.cli.common import fail, process_rank


def resolved(config: DictConfig, key: str) -> Any:
    """The value at ``key``, or None when it cannot be resolved yet (e.g. ``${hydra:runtime.output_dir}`` of a
    sweep job, known only when the job starts)."""
    try:
        return OmegaConf.select(config, key, default=None, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return None


def prepare_hydra_config(config: DictConfig, dir_key: str) -> str:
    """Fix the run (or sweep) directory's name in ``config`` and make ``${hydra:...}`` resolvable before Hydra's
    ``run_job`` does so itself, with the same values (Hydra sets the same config and ``runtime.output_dir`` again).
    Returns the directory, absolute."""
    HydraConfig.instance().set_config(config)
    run_dir = os.path.abspath(str(OmegaConf.select(config, dir_key)))
    section, _, field = dir_key.rpartition(".")
    node = OmegaConf.select(config, section)
    with read_write(node):
        node[field] = run_dir
    if dir_key == "hydra.run.dir":
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = run_dir
    HydraConfig.instance().set_config(config)
    return run_dir


def rank_logs(config: DictConfig, run_dir: str) -> None:
    """On a rank other than 0 of a run whose ranks share one run directory (torchrun, Lightning's launcher): its
    log file beside rank 0's (``train.rank1.log``), and no second copy of ``.hydra/`` (rank 0 writes it)."""
    rank = process_rank()
    if rank == 0:
        return
    handler = OmegaConf.select(config, "hydra.job_logging.handlers.file")
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None
        if handler is not None and "filename" in handler:
            name = OmegaConf.select(config, "hydra.job.name") or "run"
            handler.filename = os.path.join(run_dir, f"{name}.rank{rank}.log")


class RunGuard(Callback):
    """Checks, before anything is made, that this command can write where it will.

    ``dirs``: config keys of directories it creates or writes into (``paths.work_dir``, ``out_dir``);
    ``files``: config keys of files it writes (``output``). The run (or sweep) directory is checked too.
    ``locks``: config keys of the outputs only one run at a time may write (``output``, ``out_dir``).
    """

    def __init__(self, dirs: Sequence[str] = (), files: Sequence[str] = (), locks: Sequence[str] = ()) -> None:
        self.dirs, self.files, self.locks = list(dirs), list(files), list(locks)

    def lock(self, config: DictConfig, run_dir: str, dir_key: str, folder: str | None = None) -> None:
        """Take this run's locks (launching process only): each output, then its run directory (made here, so a run
        refused for its output leaves no directory; a sweep job's lock stays inside ``folder``, its sweep); one line
        if one is held, or if a lock file is a link out of its folder."""
        if not run_lock.launching_process():
            return
        try:
            for key in self.locks:
                target = resolved(config, key)
                if target is not None:
                    run_lock.acquire(key, str(target), run_dir)
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            run_lock.acquire(dir_key, run_dir, run_dir, directory_lock=True, folder=folder)
        except (run_lock.OutputLocked, inside.LinkOut) as exc:
            run_lock.release_all()
            fail(str(exc))

    @staticmethod
    def check_links(config: DictConfig, run_dir: str, dir_key: str) -> None:
        """No link leads the run (or sweep) directory out of where it may have been handed, before anything is
        written there (one line, exit code 2): its way down from ``paths.work_dir`` when it is made inside it (a
        handed work_dir's ``runs/`` as a link elsewhere), and every link in it when it exists already (a handed run
        or sweep continued: Hydra writes ``multirun.yaml``, ``.hydra/*.yaml`` and the log by name, Lightning the
        ``checkpoints/``, without looking). A ``paths.work_dir`` given as a link is the user's own choice."""
        work_dir = resolved(config, "paths.work_dir")
        try:
            if isinstance(work_dir, str) and work_dir and Path(run_dir).is_relative_to(os.path.abspath(work_dir)):
                inside.check(run_dir, work_dir, dir_key)
            inside.check_tree(run_dir, dir_key)
        except inside.LinkOut as exc:
            fail(str(exc))

    def check_paths(self, config: DictConfig, run_dir: str, dir_key: str) -> None:
        """One line, exit code 2, for the first path that cannot be written."""
        try:
            for key in self.dirs:
                if resolved(config, key) is not None:
                    checks.output_dir(config, key)
            for key in self.files:
                if resolved(config, key) is not None:
                    checks.output_file(config, key)
            checks.output_dir(OmegaConf.create({"run": escaped(run_dir)}), "run")  # the resolved path, as text
        except ValueError as exc:
            message = str(exc)
            fail(message.replace("run=", f"{dir_key}=", 1) if message.startswith("run=") else message)

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = prepare_hydra_config(config, "hydra.run.dir")
        self.check_links(config, run_dir, "hydra.run.dir")
        self.check_paths(config, run_dir, "hydra.run.dir")
        self.lock(config, run_dir, "hydra.run.dir")
        rank_logs(config, run_dir)

    @override
    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        run_lock.release_all()

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = prepare_hydra_config(config, "hydra.sweep.dir")
        self.check_links(config, sweep_dir, "hydra.sweep.dir")
        self.check_paths(config, sweep_dir, "hydra.sweep.dir")

    @override
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # a sweep's job, in its own directory (a run locked at its start)
            self.lock(config, str(config.hydra.runtime.output_dir), "hydra.sweep.dir",
                      folder=str(config.hydra.sweep.dir))

    @override
    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            run_lock.release_all()

