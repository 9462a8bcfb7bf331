"""``overlap="auto"``: the run itself times both exchange paths and keeps the faster one.

Overlapping the exchange between nodes with the backward hides a slow link, but on busy cores (the CPU runs the
backward, and every collective issued during it wakes communication threads that take their time from it) it
can cost more than it hides: over a fast link the end-of-backward path is then faster (docs/results.md, "the
strategy over a slow link"). Which one wins depends on the link and the machine, so neither is the right fixed
default. Both paths give the same update (tests/test_exchange_overlap.py), so switching between them is free.

The schedule depends only on the count of updates, the same on every rank: ``warmup`` updates on the overlapped
path (the first ones allocate buffers and are slower either way), then ``trials`` pairs alternating overlapped,
end of backward; then one all-reduce of the per-path medians, averaged over the ranks so every rank takes the
same decision, and the faster path for the rest of the fit. A path that never ran (a precision that cannot overlap)
counts as infinitely slow.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

OVERLAP_MODES = (True, False, "auto")


class OverlapChoice:
    """Which path each update takes under ``overlap`` (True, False or ``"auto"``); see the module docstring."""

    def __init__(self, mode: bool | str, warmup: int = 3, trials: int = 4) -> None:
        if mode not in OVERLAP_MODES or isinstance(mode, int) and not isinstance(mode, bool):
            raise ValueError(f"overlap={mode!r}, expected true, false or 'auto'")
        self.mode, self.warmup, self.trials = mode, warmup, trials
        self.reset()

    def reset(self) -> None:
        """A new fit times the paths again (the machine, the link or the model may have changed)."""
        self.updates = 0
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self.chosen: bool | None = None if self.mode == "auto" else bool(self.mode)
        self.medians_ms: tuple[float, float] | None = None  # (overlapped, end of backward), once decided

    def overlap_now(self) -> bool:
        """Whether this update's backward may take the overlapped path."""
        if self.chosen is not None:
            return self.chosen
        trial = self.updates - self.warmup
        return trial < 0 or trial % 2 == 0

    def record(self, seconds: float, overlapped: bool, device: torch.device) -> None:
        """After every update (on every rank): its duration and the path it took; decides after the trials."""
        if self.chosen is not None:
            return
        if self.updates >= self.warmup:
            self._times[overlapped].append(seconds)
        self.updates += 1
        if self.updates < self.warmup + 2 * self.trials:
            return
        medians = torch.tensor([statistics.median(self._times[path]) if self._times[path] else float("inf")
                                for path in (True, False)], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(medians)  # every rank compares the same sums: one decision
            medians /= dist.get_world_size()
        overlapped_s, end_s = (float(v) for v in medians.cpu())
        self.chosen = overlapped_s <= end_s
        self.medians_ms = (1e3 * overlapped_s, 1e3 * end_s)

    # A resumed run continues the schedule, and keeps the decision, of the run it resumes: the two paths give the
    # same update only within fp32 rounding, so the path of every update must be the one the run would have taken.

    def state_dict(self) -> dict[str, object]:
        return {"updates": self.updates, "times": {k: list(v) for k, v in self._times.items()},
                "chosen": self.chosen, "medians_ms": self.medians_ms}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.mode != "auto":
            return  # a fixed path was asked for
        self.updates = int(state["updates"])  # type: ignore[arg-type]
        self._times = {bool(k): list(v) for k, v in state["times"].items()}  # type: ignore[union-attr]
        self.chosen = state["chosen"]  # type: ignore[assignment]
        self.medians_ms = state["medians_ms"]  # type: ignore[assignment]
