"""Files shared by the processes of a run have one writer, and the write helper never exposes or collides on a
temporary file: the demo's 2-process prior step once died because both processes renamed one fixed ``.tmp``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dalle_lightning_plugins.io.atomic_files import PARTIAL, atomic_path, write_json
from tests.resume_utils import train_args
from tests.test_sharded_stages import free_port

WRITES = 300


def _hammer(path: str, writer: int, errors: mp.Queue) -> None:
    try:
        for i in range(WRITES):
            write_json(path, {"writer": writer, "i": i, "payload": list(range(2000))})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"writer {writer}: {type(exc).__name__}: {exc}")


def test_two_processes_writing_one_path_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "metrics.json"
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(target), w, errors)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, failures[0]
    assert [p.exitcode for p in procs] == [0, 0]
    blob = json.loads(target.read_text())  # complete: the last writer's whole file
    assert blob["payload"] == list(range(2000)) and blob["i"] == WRITES - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    write_json(target, {"v": 1})
    with pytest.raises(OSError, match="disk full"):
        with atomic_path(target) as tmp:
            tmp.write_text('{"v": 2, "trunc')
            raise OSError(28, "disk full")
    assert json.loads(target.read_text()) == {"v": 1}
    assert not list(tmp_path.glob(f"*{PARTIAL}"))


def test_written_files_get_the_usual_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    path = write_json(tmp_path / "m.json", {})
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


# Run dalle-train with the function that writes metrics.json traced: each call appends "pid local_rank path" to
# a log. Lightning's launcher starts the second process by re-running this same script, so both are traced.
TRACED_TRAIN = """
import os
import dalle_lightning.cli.train as train

real = train.write_json

def traced(*args, **kwargs):
    path = next(str(a) for a in args if isinstance(a, (str, os.PathLike)))
    with open(os.environ["WRITES_LOG"], "a") as log:
        log.write(f"{os.getpid()} {os.environ.get('LOCAL_RANK', '-')} {path}\\n")
    return real(*args, **kwargs)

train.write_json = traced
if __name__ == "__main__":
    train.main()
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_train_writes_metrics_from_rank_zero_only(resume_work: Path, tmp_path: Path) -> None:
    script = tmp_path / "traced_train.py"
    script.write_text(TRACED_TRAIN)
    log = tmp_path / "writes.log"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), OMP_NUM_THREADS="1",
               WRITES_LOG=str(log))
    env.pop("RANK", None), env.pop("LOCAL_RANK", None)
    overrides = train_args(resume_work, "prior", "one_writer", "strategy=sharded_powersgd",
                           "strategy.devices_per_node=1", "trainer.devices=2", "trainer.max_steps=2",
                           batch_size=4)
    proc = subprocess.run([sys.executable, str(script), *overrides], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    writes = [line.split() for line in log.read_text().splitlines() if line.endswith("metrics.json")]
    assert len(writes) == 1, f"metrics.json written {len(writes)} times: {writes}"
    _, local_rank, path = writes[0]
    assert local_rank in ("-", "0"), f"metrics.json written by local rank {local_rank}"  # the launching process
    metrics = json.loads(Path(path).read_text())["metrics"]
    # the strategy's exchange reaches the run's report: bytes between the 2 simulated nodes, time per step
    assert metrics["powersgd/inter_node_bytes_per_rank"] > 0 and metrics["strategy/reduce_ms_per_step"] > 0
    assert Path(path).parent == resume_work / "runs" / "prior" / "one_writer"
