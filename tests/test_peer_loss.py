"""A lost peer is told from a bug by the error's type (``dalle_lightning_plugins/environments/peer_loss.py``): a lost peer ends
a rank with one line and exit code 75, which a launcher restarts; a bug keeps its traceback and exits 1 as any
Python error does, however its message reads."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset

from dalle_lightning.cli.common import one_line_errors
from dalle_lightning.run.exits import lost_peer
from dalle_lightning_plugins.compression.exchange import ExchangeError
from dalle_lightning_plugins.environments.peer_loss import LOST_PEER_EXIT, PeerLost

ROOT = Path(__file__).resolve().parents[1]
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
               "[10.0.0.2]:39133")  # what a survivor's all_reduce raised when its peer was SIGKILLed (torch 2.14)
NCCL = "NCCL error in: ProcessGroupNCCL.cpp:3474, {}, NCCL version 2.27.5\n{}"


@pytest.fixture
def two_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # one process has no peer to lose


class _Slow(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(1.5)  # past the loader's timeout, short enough for its shutdown to wait out
        return torch.zeros(1)


@pytest.mark.usefixtures("two_processes")
def test_a_dataloader_timeout_is_not_a_lost_peer() -> None:
    batches = iter(DataLoader(_Slow(), num_workers=1, timeout=0.5))
    with pytest.raises(RuntimeError, match="DataLoader timed out") as caught:
        next(batches)
    del batches  # its worker ends here, not in the next test
    assert not lost_peer(caught.value)


@pytest.mark.usefixtures("two_processes")
def test_a_runtime_error_mentioning_nccl_is_a_bug_and_keeps_its_traceback() -> None:
    bug = RuntimeError("NCCL error: unhandled cuda error (timeout waiting for the gloo peer?)")
    assert not lost_peer(bug)
    after_oom = dist.DistBackendError(NCCL.format("unhandled cuda error", "ncclUnhandledCudaError: Call to CUDA "
                                                  "function failed.\nCuda failure 'out of memory'"))
    assert not lost_peer(after_oom)  # an NCCL error code that is not the remote one: the device, a bug
    remote = dist.DistBackendError(NCCL.format("remote process exited or there was a network error",
                                               "ncclRemoteError: A call failed possibly due to a network error or a "
                                               "remote process exiting prematurely."))
    assert lost_peer(remote)
    with pytest.raises(RuntimeError, match="unhandled cuda error"):  # re-raised as it was: Python prints it, exit 1
        one_line_errors(lambda cfg: (_ for _ in ()).throw(bug))(OmegaConf.create({}))


@pytest.mark.usefixtures("two_processes")
def test_the_strategies_wrap_a_lost_peer_only() -> None:
    gloo = RuntimeError(GLOO_CLOSED)
    assert lost_peer(gloo) and lost_peer(dist.DistNetworkError("connect failed"))
    assert lost_peer(RuntimeError("Application timeout caused pair closure"))  # both nodes' error in a 30 s link cut
    assert not lost_peer(RuntimeError("my loader: Application timeout caused pair closure?"))  # not gloo's own
    assert lost_peer(dist.DistStoreError("wait timeout"))
    wrapped = RuntimeError("node 0 (rank 0): the inter-node gradient exchange with node(s) [1] failed ...")
    wrapped.__cause__ = ExchangeError("the exchange of bucket b0", gloo)  # sharded_powersgd's backward hook path
    assert lost_peer(wrapped) and isinstance(ExchangeError("x", gloo), PeerLost)
    mismatch = RuntimeError("[enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] "
                            "op.preamble.length <= op.nbytes. 32 vs 16")  # mismatched collectives: a bug
    assert not lost_peer(mismatch)
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_one_process_has_no_peer_to_lose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not lost_peer(PeerLost("node 0 (rank 0): ..."))


def test_a_killed_peer_is_a_lost_peer_one_line_and_exit_75(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = str(ROOT / "tests" / "helpers" / "lost_peer_pair.py")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    peer = subprocess.Popen([sys.executable, script, "peer", port], env=env, stderr=subprocess.DEVNULL)
    survivor = subprocess.run([sys.executable, script, "survivor", port], env=env, capture_output=True, text=True,
                              timeout=120)
    assert peer.wait(timeout=30) == -9
    lines = [line for line in survivor.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert survivor.returncode == LOST_PEER_EXIT, survivor.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in survivor.stderr, lines
    assert lines[0].startswith("error: [") and "Connection closed by peer" in lines[0], lines  # gloo's own words
