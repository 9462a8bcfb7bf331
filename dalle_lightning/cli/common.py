"""What every command-line app shares: config validation, one-line errors, quiet libraries, instantiation helpers.

Every bad input ends the app with one line, ``error: <key>=<value>; expected ...``, and exit code 2, printed by
rank 0 only: the app's own checks (``one_line_errors``), Hydra's errors about the command line (a mistyped key, a
missing config group option, an unknown ``--option``: ``hydra_app``), and library errors about a value. Set
``DALLE_DEBUG=1`` for the traceback instead. Libraries' INFO logs (open_clip's model-config lines, ...) are off
unless ``verbose=true``.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
import logging
import re
import signal
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import hydra
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from dalle_lightning.artifacts import register_resolvers
from dalle_lightning.run.exits import Stopped, _stop_on_sigterm, lost_peer, lost_peer_exit, process_rank, stopped_exit
from dalle_lightning.run.run_lock import release_all, run_id
from dalle_lightning import hardware
from dalle_lightning_plugins.io.atomic_files import AtomicWriteError
from dalle_lightning_plugins.io.refusal import CheckpointRefused

log = logging.getLogger("dalle_lightning")

register_resolvers()
if not OmegaConf.has_resolver("run_id"):  # run and sweep directory names (cli/run_lock.py)
    OmegaConf.register_new_resolver("run_id", run_id)


def check_keys(cfg: DictConfig, allowed: Iterable[str], where: str = "config") -> None:
    """A mistyped top-level key (e.g. from an experiment file) is an error, not silently ignored."""
    unknown = sorted(set(cfg.keys()) - set(allowed) - {"hydra"})
    if unknown:
        raise KeyError(f"unknown {where} key(s) {unknown}; expected one of {sorted(allowed)}")


def fail(message: str) -> None:
    """Print ``error: <first line of message>`` (rank 0 only) and exit with code 2."""
    text = message.strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # a KeyError's message arrives quoted
    line = text.splitlines()[0] if text else "unknown error"
    if process_rank() == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(2)


def one_line_errors(main: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Bad input ends the app with one line naming the value, not a traceback (set DALLE_DEBUG=1 for it)."""

    @functools.wraps(main)
    def wrapper(cfg: DictConfig) -> Any:
        try:
            return main(cfg)
        except (FileNotFoundError, ValueError, KeyError, FloatingPointError, InstantiationException,
                AtomicWriteError, CheckpointRefused) as exc:  # the strategy's refusal of a sharded checkpoint
            if os.environ.get("DALLE_DEBUG"):
                raise
            if isinstance(exc, InstantiationException) and exc.__cause__ is not None:
                exc = exc.__cause__  # Hydra wraps the constructor's own error; show that one
            if isinstance(exc, InterpolationResolutionError):  # a ValueError too: a value an artifact gives
                fail(_hydra_error_line(exc))
            fail(str(exc) or type(exc).__name__)
        except (RecursionError, MemoryError) as exc:  # an input nested or sized past what a reader could hold
            if os.environ.get("DALLE_DEBUG"):
                raise
            fail(resource_line(exc))
        except RuntimeError as exc:  # torch.distributed.DistError and the strategies' PeerLost are ones
            if not os.environ.get("DALLE_DEBUG") and CPU_ALLOCATION_FAILED in str(exc):
                fail(resource_line(exc))
            if os.environ.get("DALLE_DEBUG") or not lost_peer(exc):
                raise  # a bug: its traceback on stderr, exit code 1
            lost_peer_exit(exc)

    return wrapper


CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"  # torch's RuntimeError for a failed malloc


def resource_line(exc: BaseException) -> str:
    """One line for a command that ran out of stack or memory (a value nested thousands deep, a size that asks
    for more memory than there is), never a traceback of thousands of frames."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    what = "nests deeper" if isinstance(exc, RecursionError) else "asks for more memory"
    return (f"an input {what} than this command can read ({type(exc).__name__}{': ' + first if first else ''}); "
            "expected inputs a dalle-lightning command wrote (DALLE_DEBUG=1 shows where)")


QUIET_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's own call of a torch API torch deprecated, at every fit
    r"The dirpath has changed from",  # every resumed run writes its own run directory (docs/resume.md)
    # FSDP2's nag about a unit returning a view (nn.Linear on 3-D input does): only an in-place op on it would
    # lose the unit's hook, and the models' residual adds are out of place (tests/test_strategy_exact_models.py)
    r"FSDP2-wrapped module \(\w+\) returned a view tensor",
    # the summary's size estimate under bf16-mixed (precision=auto on bf16 hardware), at every fit
    r"Precision [\w-]+ is not supported by the model summary",
)
# Lightning's advertisements (litlogger, litmodels) at every fit, from its rank-zero loggers
QUIET_LOG_LINES = ("💡 Tip:",)
LIGHTNING_INFO_LOGS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(QUIET_LOG_LINES)


def quiet_libraries(main: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Libraries' INFO logs off unless ``verbose=true`` (the project's own stay); on ranks other than 0, the
    project's INFO and WARNING logs off too, so a distributed run prints once."""

    @functools.wraps(main)
    def wrapper(cfg: DictConfig) -> Any:
        if not cfg.get("verbose", False):
            for message in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            for name in LIGHTNING_INFO_LOGS:
                logging.getLogger(name).addFilter(_not_a_tip)
            logging.getLogger().setLevel(logging.WARNING)
            logging.getLogger("dalle_lightning").setLevel(logging.INFO)
        if process_rank() != 0:
            logging.getLogger("dalle_lightning").setLevel(logging.ERROR)
        return main(cfg)

    return wrapper


def fast_path_errors_in_run_dir(main: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """The full errors of fast paths that fell back (``dalle_lightning_plugins.fast_paths``) go to the run
    directory, ``<hydra run dir>/fast_path_errors.log``, beside the run's log, unless the user named a file in
    ``DALLE_LIGHTNING_FAST_PATH_ERRORS``; the variable is restored when the app returns (tests run several apps in
    one process), and processes the app starts (Lightning's launcher) inherit it."""

    @functools.wraps(main)
    def wrapper(cfg: DictConfig) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from dalle_lightning_plugins.fast_paths import ERRORS_ENV

        if os.environ.get(ERRORS_ENV) or not HydraConfig.initialized():
            return main(cfg)
        os.environ[ERRORS_ENV] = str(Path(HydraConfig.get().runtime.output_dir) / "fast_path_errors.log")
        try:
            return main(cfg)
        finally:
            os.environ.pop(ERRORS_ENV, None)

    return wrapper


def _hydra_error_line(exc: BaseException) -> str:
    """One line from Hydra's multi-line composition errors: its first line, the cause's first line, the hint."""
    resolved = re.match(r"(KeyError|ValueError|UnsafeFile|FileNotFoundError) raised while resolving "
                        r"interpolation: (.*)", str(exc).strip())
    if isinstance(exc, InterpolationResolutionError) and resolved:
        # A value read from an artifact (${meta:...}): the artifact's own one line, under the key that read it
        # (OmegaConf keeps the cause only in the message).
        text = resolved.group(2).splitlines()[0].strip()
        if resolved.group(1) == "KeyError" and len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        key = getattr(exc, "full_key", None)
        return f"{key}: {text}" if key else text
    lines = [line.strip().rstrip(".") for line in str(exc).splitlines() if line.strip()]
    parts = lines[:1]
    options = getattr(exc, "options", None)
    if options:
        parts.append(f"expected one of {sorted(options)}")
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])
    hints = [line for line in lines[1:] if line.startswith("To append")]
    return "; ".join(parts + hints) or type(exc).__name__


def check_options(argv: list[str]) -> None:
    """An unknown ``--option`` (or a malformed known one) is one line with exit code 2, as Hydra would not say."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def one_line(message: str) -> None:
        raise argparse.ArgumentError(None, message)

    parser.error = one_line  # type: ignore[method-assign]
    try:
        parsed, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        fail(f"{exc.message}; run with --help for the options")
    options = [a for a in unknown if a.startswith("-")]
    if options:
        fail(f"unknown option(s) {options}; expected key=value overrides or one of --help, --cfg, --info, --multirun")
    for arg in [*getattr(parsed, "overrides", []), *unknown]:
        key, eq, value = arg.partition("=")
        brace_range = re.search(r"\{[^{}]*\.\.[^{}]*\}", value)  # {00000..00099}, not a Hydra dict {a: 1}
        if eq and brace_range and not value.startswith(("'", '"')) and "${" not in value:
            # Hydra's grammar reads an unquoted brace as a dictionary ("mismatched input '{' expecting <EOF>")
            fail(f"{key}={value}: a brace pattern needs Hydra's own quotes inside the shell's; expected "
                 f"\"{key}='{value}'\"")


def rank_zero_app(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Run a single-process app on global rank 0 only: launched by torchrun or srun on several processes, the
    others return at once instead of writing the same outputs (markers, samples, reports) a second time."""

    @functools.wraps(task)
    def wrapper(cfg: DictConfig) -> Any:
        rank = process_rank()
        if rank != 0:
            logging.getLogger("dalle_lightning").debug("rank %d: this command runs on rank 0 only", rank)
            return None
        return task(cfg)

    return wrapper


def hydra_app(config_name: str, every_rank: bool = False) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """``@hydra.main`` on the project's configs, with one-line errors for both the app and Hydra itself.

    Hydra prints its own errors (a mistyped key, an unknown config option) over several lines and exits with 1;
    with ``HYDRA_FULL_ERROR`` set it raises them instead, and this wrapper turns them into one line, exit code 2.
    Unless ``every_rank`` (training: every process of a distributed run takes part), the app runs on global rank 0
    only, so each output has one writer.
    """

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        body = task if every_rank else rank_zero_app(task)
        hydra_main = hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")(
            one_line_errors(quiet_libraries(fast_path_errors_in_run_dir(body))))

        @functools.wraps(task)
        def main() -> Any:
            check_options(sys.argv[1:])
            debug = bool(os.environ.get("DALLE_DEBUG") or os.environ.get("HYDRA_FULL_ERROR"))
            before = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"
            # Training hands SIGTERM to Lightning (cli/stopped.py); the other commands stop with one line here.
            previous = _stop_on_sigterm() if not every_rank else None
            try:
                return hydra_main()
            except (HydraException, OmegaConfBaseException) as exc:
                if debug:
                    raise
                fail(_hydra_error_line(exc))
            except (Stopped, KeyboardInterrupt) as exc:  # outside a fit (cli/stopped.py reports those)
                if debug:
                    raise
                signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
                stopped_exit(config_name, signum)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
                release_all()  # a run that failed holds its locks no longer (the process may go on: tests)
                if before is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = before

        return main

    return decorate


def instantiate_dict(nodes: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` node of a dict-of-nodes config (callbacks), in key order."""
    if not nodes:
        return []
    return [instantiate(node) for _, node in nodes.items() if node is not None and "_target_" in node]


def strategy_and_precision(cfg: DictConfig) -> dict[str, Any]:
    """Trainer kwargs for the strategy and precision groups (a registered name, or a plugin object), and the
    trainer config's own ``plugins`` (instantiated here, since these kwargs replace the config's list). The name
    ``auto`` becomes ``bf16-mixed`` where the accelerator computes bf16 natively and ``32-true`` elsewhere."""
    kwargs: dict[str, Any] = {}
    strat = cfg.strategy
    kwargs["strategy"] = instantiate(strat) if "_target_" in strat else strat.name
    plugins = [instantiate(node) for node in (cfg.trainer.get("plugins") or [])]  # the checkpoint writer
    prec = cfg.precision
    accelerator = str(cfg.trainer.get("accelerator", "cpu"))
    if "_target_" in prec:
        plugins.append(instantiate(prec))
    elif prec.name == hardware.AUTO:  # the hardware's fast format (dalle_lightning/hardware.py)
        kwargs["precision"] = hardware.auto_precision(accelerator)
        log.info("precision=auto: %s", kwargs["precision"])
    else:
        kwargs["precision"] = prec.name
    kwargs["plugins"] = plugins
    sixteen = "16" in str(kwargs.get("precision", "")) or str(prec.get("dtype", "")) in hardware.SIXTEEN_BIT
    if sixteen and not hardware.native_bf16(accelerator):
        log.warning("precision %s computes in 16 bits, which this %s emulates (100-160x slower than fp32 on an AVX2 "
                    "CPU: benchmarks/matmul_dtypes.py); precision=auto picks fp32 here",
                    kwargs.get("precision") or f"{prec.get('_target_')} dtype={prec.get('dtype')}", accelerator)
    return kwargs


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _conf_dir() -> str:
    """The Hydra config tree: the checkout's top-level ``conf/``, or the copy an installed wheel carries as
    ``dalle_lightning/conf`` (pyproject maps one onto the other)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"no Hydra configs found in {package / 'conf'} or {package.parent / 'conf'}")


CONF_DIR = _conf_dir()
