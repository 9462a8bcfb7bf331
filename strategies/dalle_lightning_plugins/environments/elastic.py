"""What a worker that a launcher restarted needs to come back where its run stopped, by itself.

``torchrun --max-restarts=N`` (with a c10d rendezvous) restarts every node's workers when one fails or a node
comes back; a requeued SLURM job runs again. The restarted processes are new: this module gives them

- which launch it belongs to and whether the launcher restarted it: :mod:`dalle_lightning_plugins.environments.launch_identity`;
- :func:`init_default_group`: the default process group exactly as Lightning makes it (backend, ranks,
  timeout), on a store of this round only. torchrun's agents share one store over all rounds of a launch, and
  the keys a process group writes there carry no round: a restarted rank can read the address a rank of the
  round before published and fail to connect ("Gloo connectFullMesh failed ... Connection refused"), which
  costs one restart each time (pytorch/pytorch#135712; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents'
  environment is torch's own way out, which this makes unnecessary);
- :func:`agree_on_checkpoint`: one checkpoint every rank holds complete, the same on every rank (named by its path
  relative to the work directory, so nodes that mount the shared file system at different paths agree).

Plain ``torch.distributed`` and Lightning's cluster environments only: any LightningModule's run can use it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from dalle_lightning_plugins import compat

ROUND_KEY = "dalle_lightning_plugins/round_store"  # "<port>:<token>" of this round's store, in the agents' store
TOKEN_KEY = "dalle_lightning_plugins/token"  # the same token, inside this round's store
PROBE_TIMEOUT = timedelta(seconds=2)  # a published store that does not answer within this is an earlier round's
_joined: set[str] = set()  # tokens of the round stores this process has joined


def round_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A store for this round's process group: rank 0 serves a new one on a free port and publishes it, with a
    random token, in the agents' store at ``host:port``; every other rank takes the published store whose token
    answers, so a value left by an earlier round (its server died with its rank 0) is never used."""
    shared = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        token = secrets.token_hex(8)
        store.set(TOKEN_KEY, token)
        shared.set(ROUND_KEY, f"{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        published, token = shared.get(ROUND_KEY).decode().split(":")  # waits for the first round's rank 0
        if token in _joined:  # this process's own earlier group (a second fit): its store may still answer
            time.sleep(0.1)
            continue
        try:
            socket.create_connection((host, int(published)), timeout=PROBE_TIMEOUT.total_seconds()).close()
        except OSError:  # nobody listens: an earlier round's store (asked quietly: TCPStore logs each failed try)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"no store of this round at {host} within {timeout.total_seconds():g} s; "
                                          f"expected rank 0 to publish one under {ROUND_KEY}") from None
            time.sleep(0.1)
            continue
        try:
            store = dist.TCPStore(host, int(published), world_size, is_master=False, timeout=PROBE_TIMEOUT)
            if store.get(TOKEN_KEY).decode() == token:
                store.set_timeout(timeout)
                _joined.add(token)
                return store
        except (RuntimeError, dist.DistError):
            pass  # an earlier round's store: its rank 0 is gone, or the port serves something else now
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"no store of this round at {host} within {timeout.total_seconds():g} s; "
                                      f"expected rank 0 to publish one under {ROUND_KEY}")
        time.sleep(0.1)


def init_default_group(strategy: Any) -> bool:
    """Initialise the default process group before ``Trainer.fit`` as the strategy would (its backend, ranks and
    timeout); Lightning then finds it made and keeps it. Under torchrun's shared store, on :func:`round_store`.
    Returns False (and makes nothing) where Lightning's launcher starts the processes or there is one process."""
    env = getattr(strategy, "cluster_environment", None)
    if env is None or isinstance(env, LightningEnvironment) or env.world_size() < 2 or dist.is_initialized():
        # Lightning's own launcher: its first process starts the others inside fit, and the others see LOCAL_RANK
        # (creates_processes_externally) while it does not, so only some ranks would join a group made here
        return False
    if not env.creates_processes_externally:
        return False
    timeout = compat.strategy_timeout(strategy) or timedelta(minutes=30)
    backend = compat.process_group_backend(strategy)
    rank, world_size = env.global_rank(), env.world_size()
    address = {"MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port)}  # (Lightning's may set them)
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timeout}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs["store"] = round_store(env.main_address, env.main_port, rank, world_size, timeout)
    device = getattr(strategy, "root_device", None)
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    # Lightning's own line for this event, through its logger, so the run reads as Lightning's would
    logging.getLogger("lightning.fabric.utilities.distributed").info(
        f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}"
        + (" (on a store of this round)" if "store" in kwargs else ""))
    with environment(address):  # torch's env:// reads them; the group keeps its store, the process its variables
        dist.init_process_group(**kwargs)
    return True


@contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` holds ``values`` for the duration (None: the variable unset), then what it held before (a
    variable that was unset is removed again)."""
    before = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (one process: ``[value]``), over gloo whatever the default backend, so no device
    need be chosen before the strategy chooses it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    if group is not None:
        dist.destroy_process_group(group)
    return out


def agree_on_checkpoint(complete: Sequence[str]) -> str | None:
    """Collective: the newest checkpoint that every rank holds complete. ``complete`` is this rank's complete
    checkpoints, newest first, each named as every rank names it (its path relative to the work directory, not an
    absolute path, which differs between nodes that mount the file system at different places); a file system
    that shows one rank a checkpoint another does not yet see (or a rank that lost it) makes all take the newest
    they share, in rank 0's order. None when they share none."""
    lists = all_gather_objects(list(complete))
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return next((path for path in lists[0] if path in common), None)
