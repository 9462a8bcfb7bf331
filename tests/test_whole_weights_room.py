"""``full_weights_after="auto"`` decides whether a whole copy of the model fits each rank. The copy lands on the CPU
after a stage (as ``ddp`` leaves a module), one per process of the node, so the host's share always counts; on a GPU
the device's free memory counts too, since validate, test and predict run on whole weights there. Before, a GPU's
free memory alone decided: 80 GB free on the device passed a model the host could not hold once per rank.

The decision's inputs are faked here on the CPU; the CUDA test (run by ``make gpu-check``'s cuda_tests step) reads a
real device."""

from __future__ import annotations

import pytest
import torch

from dalle_lightning_plugins.strategies import whole_weights
from dalle_lightning_plugins.strategies.whole_weights import free_bytes_per_rank, host_bytes_per_rank

GIB = 2.0**30


def test_on_a_gpu_the_host_share_bounds_the_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(80 * GIB), int(80 * GIB)))
    monkeypatch.setattr(whole_weights, "host_bytes_per_rank", lambda processes: 64 * GIB / processes)
    assert free_bytes_per_rank(torch.device("cuda", 0), 8) == 8 * GIB  # 8 ranks share 64 GiB of host memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(2 * GIB), int(80 * GIB)))
    assert free_bytes_per_rank(torch.device("cuda", 0), 8) == 2 * GIB  # a nearly full GPU still counts


def test_on_the_cpu_the_host_share_is_the_room() -> None:
    share = free_bytes_per_rank(torch.device("cpu"), 4)
    assert 0 < share <= host_bytes_per_rank(1) / 4 * 1.01  # the machine's available memory over its 4 processes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_gpu_never_counts_more_than_the_host_holds() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    room = free_bytes_per_rank(device, 1)
    assert 0 < room <= min(torch.cuda.mem_get_info(device)[0], host_bytes_per_rank(1) * 1.01)
