"""The matmul peak a training step is measured against, taken in the same process as the step.

A step's fraction of peak only means something against the GEMM rate of the same process, threads and dtype at
the same moment (the 2 cores are often shared), so the benchmarks call :func:`matmul_peak` right before and right
after each measured run and keep the higher figure.
"""

from __future__ import annotations

import time

import torch


def matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 6) -> float:
    """Best GFLOP/s of a ``size x size x size`` matrix product in ``dtype`` (best of ``reps``, after a warm-up)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def best_seconds(step, steps: int, warmup: int = 2) -> float:
    """Fastest of ``steps`` calls of ``step()`` after ``warmup`` calls: the least disturbed run on shared cores."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def timed_against_peak(step, dtype: torch.dtype, steps: int) -> tuple[float, float]:
    """``(seconds, peak)``: the fastest of ``steps`` calls of ``step()`` and the ``dtype`` matmul peak (GFLOP/s),
    the better of a measurement right before and one right after the run."""
    before = matmul_peak(dtype)
    seconds = best_seconds(step, steps)
    return seconds, max(before, matmul_peak(dtype))


def executed_flops(step) -> int:
    """FLOPs one call of ``step()`` executes in matrix products and convolutions (forward and backward), counted
    by ``torch.utils.flop_counter``: includes work a sparse kernel computes and then masks."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()
