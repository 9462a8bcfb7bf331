"""``ShardedPowerSGDStrategy`` trains a LightningModule as Lightning's ``ddp`` does, behaviour by behaviour.

Each case of :mod:`tests.helpers.conformance` runs on 2 CPU gloo processes with the same seed under ``ddp``, under
the strategy at ``devices_per_node=2`` (1 node of 2: FSDP2, no compression) and at ``devices_per_node=1`` (2 nodes
of 1: PowerSGD at full rank). What a case returns (final weights of the whole model on each rank, predictions,
logged values, counters) must equal ``ddp``'s on the same rank within what the arithmetic allows: FSDP2's
reduce-scatter sums in another order than DDP's all-reduce, and full-rank PowerSGD adds a QR; 16-bit cases
round more. Where ``ddp``'s ranks agree exactly, the strategy's must too. A case that fails or hangs (past
``CASE_LIMIT`` seconds) fails its test with the first line of its error.

``python -m tests.test_strategy_conformance`` prints the table: per case and layout, pass or the first line of
the failure, and the largest difference to ``ddp``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.conformance import CASE_LIMIT, CASES, LAYOUTS, NO_DDP_REFERENCE, WORLD, marker, run_cases
from tests.helpers.distributed import WorkerError, run_distributed

# Largest difference to ddp the arithmetic allows, by layout; 16-bit cases by their format's rounding.
TOLERANCE = {"dpn2": 1e-5, "dpn1": 1e-4}
LOOSE = {"precision_bf16_mixed": 2e-2, "precision_bf16_true": 5e-2, "precision_16_mixed_gradscaler": 5e-3}
# Documented differences (docs/plugins.md): keys of a case a layout need not match.
DOCUMENTED: dict[tuple[str, str], set[str]] = {}

# Behaviours the strategy refuses, with the one-line error that names the limit and the way out.
REFUSED: dict[tuple[str, str], str] = {
    ("block_skipped_on_some_ranks", "dpn2"): "ran forward on some ranks of a node only",
}

Outcome = list[dict[str, torch.Tensor]] | str  # per-rank results, or the first line of the failure


def run_plan(plan: list[tuple[str, str]], workdir: Path) -> dict[tuple[str, str], Outcome]:
    """Run ``(case, layout)`` pairs, many per launch; after a failure, relaunch with the pairs not yet run."""
    outcomes: dict[tuple[str, str], Outcome] = {}
    remaining = list(plan)
    while remaining:
        error = ""
        try:
            run_distributed(run_cases, WORLD, remaining, str(workdir), timeout=CASE_LIMIT * len(remaining) + 60,
                            start_method="fork")
        except (WorkerError, TimeoutError) as err:
            error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"
        for i, item in enumerate(remaining):
            found = [marker(workdir, *item, rank) for rank in range(WORLD)]
            loaded = [torch.load(f, weights_only=False) if f.is_file() else None for f in found]
            # a peer's "connection reset" follows the root cause: list the root cause first
            failures = sorted((x for x in loaded if isinstance(x, str)), key=lambda x: "Connection" in x)
            if failures or any(x is None for x in loaded):
                outcomes[item] = failures[0] if failures else error or "no result"
                remaining = remaining[i + 1:]
                break
            outcomes[item] = loaded  # type: ignore[assignment]
        else:
            remaining = []
    return outcomes


def compare(case: str, layout: str, outcomes: dict[tuple[str, str], Outcome]) -> tuple[str, float]:
    """("pass" or the failure, largest difference to ddp) of one case under one layout."""
    got, ref = outcomes[(case, layout)], outcomes[(case, "ddp")]
    if (case, layout) in REFUSED:
        refused = isinstance(got, str) and REFUSED[(case, layout)] in got
        return ("pass" if refused else f"expected the refusal {REFUSED[(case, layout)]!r}, got {str(got)[:80]}"), 0.0
    if isinstance(got, str):
        return got, float("nan")
    if isinstance(ref, str):
        return f"ddp failed: {ref}", float("nan")
    skip = DOCUMENTED.get((case, layout), set())
    worst = 0.0
    problems = []
    for rank, (mine, theirs) in enumerate(zip(got, ref)):
        if set(mine) != set(theirs):
            return f"rank {rank}: keys differ from ddp: {sorted(set(mine) ^ set(theirs))[:4]}", float("nan")
        for key, value in mine.items():
            if not torch.isfinite(value).all():
                problems.append(f"rank {rank} {key} not finite")
            if case in NO_DDP_REFERENCE or key in skip:
                continue
            if value.shape != theirs[key].shape:
                problems.append(f"rank {rank} {key} shape {tuple(value.shape)} != ddp {tuple(theirs[key].shape)}")
                continue
            diff = float((value - theirs[key]).abs().max()) if value.numel() else 0.0
            worst = max(worst, diff)
            if diff > LOOSE.get(case, TOLERANCE[layout]):
                problems.append(f"rank {rank} {key} differs from ddp by {diff:.3g}")
    # where ddp's ranks agree exactly (parameters), the strategy's must too
    for key in got[0]:
        if key not in skip and all(torch.equal(r[key], ref[0][key]) for r in ref) and case not in NO_DDP_REFERENCE:
            if not all(torch.equal(r[key], got[0][key]) for r in got):
                problems.append(f"{key} differs between ranks (ddp's ranks agree)")
    if case in NO_DDP_REFERENCE:
        for key in got[0]:
            if not all(torch.equal(r[key], got[0][key]) for r in got):
                problems.append(f"{key} differs between ranks")
    return (problems[0] if problems else "pass"), worst


# In the fast suite (one launch of about 10 s): the behaviours that once failed worst. The rest: the full suite.
FAST = ("fit_twice", "manual_second_forward", "new_trainer_same_model", "unused_on_some_ranks", "save_load_checkpoint")
SLOW = tuple(c for c in CASES if c not in FAST)


@pytest.fixture(scope="module")
def fast_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Outcome]:
    return run_plan([(case, layout) for case in FAST for layout in LAYOUTS], tmp_path_factory.mktemp("fast"))


@pytest.fixture(scope="module")
def slow_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Outcome]:
    return run_plan([(case, layout) for case in SLOW for layout in LAYOUTS], tmp_path_factory.mktemp("slow"))


def check(case: str, layout: str, outcomes: dict[tuple[str, str], Outcome]) -> None:
    verdict, worst = compare(case, layout, outcomes)
    assert verdict == "pass", f"{case} under {layout}: {verdict} (largest difference to ddp {worst:.3g})"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dpn2", "dpn1"])
@pytest.mark.parametrize("case", FAST)
def test_behaves_as_ddp(case: str, layout: str, fast_outcomes: dict[tuple[str, str], Outcome]) -> None:
    check(case, layout, fast_outcomes)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dpn2", "dpn1"])
@pytest.mark.parametrize("case", SLOW)
def test_behaves_as_ddp_more(case: str, layout: str, slow_outcomes: dict[tuple[str, str], Outcome]) -> None:
    check(case, layout, slow_outcomes)


def table(outcomes: dict[tuple[str, str], Outcome]) -> str:
    rows = ["| behaviour | ddp | dpn=2 | dpn=1 |", "| --- | --- | --- | --- |"]
    for case in dict.fromkeys(c for c, _ in outcomes):
        cells = []
        ref = outcomes.get((case, "ddp"), "not run")
        cells.append(ref if isinstance(ref, str) else "pass")
        for layout in ("dpn2", "dpn1"):
            if (case, layout) not in outcomes:
                cells.append("not run")
                continue
            verdict, worst = compare(case, layout, outcomes)
            if (case, layout) in REFUSED and verdict == "pass":
                verdict, worst = "refused: " + str(outcomes[(case, layout)]).split(";")[0], float("nan")
            cells.append(verdict if not verdict == "pass" else f"pass ({worst:.1g})")
            if not verdict.startswith(("pass", "refused")) and worst == worst:
                cells[-1] += f" (max diff {worst:.3g})"
        rows.append(f"| `{case}` | " + " | ".join(c.replace("|", "/")[:140] for c in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    cases = argv or list(CASES)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_plan([(c, layout) for c in cases for layout in LAYOUTS], Path(tmp))
    print(table(result))
    print(f"\nwall time {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
