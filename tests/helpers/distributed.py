"""Run a function in N real torch.distributed processes on 127.0.0.1 (gloo by default), for tests and benchmarks.

    from tests.helpers.distributed import run_distributed

    def worker(rank: int, world_size: int, scale: float) -> float:   # module level, so spawn can import it
        t = torch.tensor([rank * scale]); dist.all_reduce(t); return t.item()

    assert run_distributed(worker, 2, 10.0) == [10.0, 10.0]

Why this shape:
- ``forkserver`` start method with torch and Lightning preloaded: workers fork from a clean server process that
  has imported them but run nothing (no thread pools or gloo state to inherit), so they start at once instead of
  each paying the imports (``import lightning.pytorch`` alone takes about 10 s of a loaded 2-core machine: 5 s
  per launch of 2 workers, measured). The server is reused across calls. The project and its plugins are not
  preloaded: each worker imports them itself, so an import's effects happen in the worker.
- The parent hosts the rendezvous TCPStore on port 0 and hands the chosen port to the workers, so there is no
  race for a "free" port between concurrent test runs.
- Results travel as ``torch.save`` bytes (tensors welcome) rather than shared-memory handles, which would die
  with the worker that owns them.
- A worker that raises makes the parent kill the others and raise ``WorkerError`` with the worker's traceback;
  a run exceeding ``timeout`` is killed and raises ``TimeoutError``. Nothing is left running either way.
- Each worker uses ``threads`` intra-op threads (default 1): the CI machine has 2 cores shared by everything.
- ``start_method="fork"`` instead forks the workers from the calling process, with everything it has imported
  (Lightning, Hydra, the project): for workers that would otherwise spend seconds importing them, when the caller
  runs no threads and no process group of its own; where it compiled with autograd before
  (``tests/helpers/fork_safety.py``), the fork server instead.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.fork_safety import autograd_survives_fork

HOST = "127.0.0.1"
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch"]


class WorkerError(RuntimeError):
    """A worker process raised; the message carries its rank and traceback."""


def host_store(world_size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store, hosted by the parent on a port the OS picks (read it from ``.port``).

    The parent owns it so it outlives any crashing worker, and port 0 means no race for a "free" port between
    concurrent test runs.
    """
    return dist.TCPStore(HOST, 0, world_size + 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


def join_group(rank: int, world_size: int, port: int, backend: str, timeout: float,
               store_timeout: float | None = None) -> None:
    """In a worker: join the default process group at the parent's store, with collective ``timeout`` seconds.

    Sets the launcher variables too (``MASTER_ADDR`` ... ``WORLD_SIZE``), as torchrun would, so Lightning and
    the strategies see an externally launched process.
    """
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    store = dist.TCPStore(HOST, port, world_size + 1, is_master=False,
                          timeout=timedelta(seconds=store_timeout if store_timeout is not None else timeout))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))


@contextmanager
def group_of_one() -> Iterator[None]:
    """A default process group of this process alone (gloo on an in-process store), for a DTensor or an FSDP2 unit
    in a single-process test; one another test left is used if it is a group of one."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1, "another test left a default process group of several ranks"
    try:
        yield None
    finally:
        if owned:
            dist.destroy_process_group()


def stop(procs: list[Any]) -> None:
    """Kill whatever still runs and reap every process, so a failed test leaves nothing behind."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: Any, backend: str, threads: int,
    pg_timeout: float, args: tuple, results: Any,
) -> None:
    try:
        if not isinstance(port, int):  # forked workers learn the port once the parent has started the store
            port = port.get()
        torch.set_num_threads(threads)
        join_group(rank, world_size, port, backend, pg_timeout)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, _dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))


def _describe_failures(name: str, rank: int, payload: str, results: Any, pending: int, grace: float = 2.0) -> str:
    """The first failure often makes its peers fail too ("connection closed by peer"); wait ``grace`` seconds
    for the other reports and list them all, first arrival first, so the root cause is visible."""
    failures = [(rank, payload)]
    end = time.monotonic() + grace
    while time.monotonic() < end and pending > 1:
        try:
            r, ok, p = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        pending -= 1
        if not ok:
            failures.append((r, p))
    return "\n".join(f"rank {r} of {name} raised:\n{p}" for r, p in failures)


TIMEOUT_SCALE_ENV = "DALLE_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """How much longer than written a run may take: ``make test-oldest`` runs at a lower priority beside the suite
    (``.ci/run``), where a spawned worker can wait a minute for a core; its timeouts detect hangs, not slowness."""
    value = os.environ.get(TIMEOUT_SCALE_ENV, "1")
    try:
        scale = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={value!r}; expected a number >= 1") from None
    if not scale >= 1:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={value!r}; expected a number >= 1")
    return scale


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
    start_method: str = "forkserver",
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes forming one process group.

    Returns the per-rank return values, ordered by rank. ``fn`` and ``args`` must be picklable (``fn`` defined at
    module level). Raises ``WorkerError`` if any worker raises or dies, ``TimeoutError`` after ``timeout`` seconds.
    ``start_method``: ``"forkserver"`` (fresh workers with torch preloaded) or ``"fork"`` (see the module docstring).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if start_method not in ("forkserver", "fork"):
        raise ValueError(f"start_method={start_method!r}; expected 'forkserver' or 'fork'")
    name = getattr(fn, "__name__", repr(fn))
    timeout *= timeout_scale()
    if start_method == "fork" and not autograd_survives_fork():
        start_method = "forkserver"  # a compile test ran in this process: forked workers could not backward
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The fork server imports torch and Lightning once; every worker forks from it instead of importing them
        # again, which on a loaded 2-core machine saves several seconds per process.
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)

    def start_store() -> dist.TCPStore:
        return host_store(world_size, timeout)

    # Forked workers are forked before the store exists: its server thread must not be copied into them mid-lock.
    ports = ctx.SimpleQueue() if start_method == "fork" else None
    store = None if ports is not None else start_store()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, ports if store is None else store.port, backend,
                                          threads, timeout, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        if store is None:
            store = start_store()
            for _ in procs:
                ports.put(store.port)
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"distributed run of {name} exceeded {timeout:.0f}s; ranks {missing} did not finish")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise WorkerError(f"rank {dead[0]} of {name} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise WorkerError(_describe_failures(name, rank, payload, results, world_size - len(out)))
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        stop(procs)
        results.close()
        del store
    return [out[r] for r in range(world_size)]
