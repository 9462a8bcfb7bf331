"""The per-resblock scale rules over a scripted sequence of finite and non-finite update attempts."""

from __future__ import annotations

import math

import pytest
import torch

from dalle_lightning_plugins.precision.scale_rules import _NEVER, BlockScales, ScaleRules


def _flags(*bad: int, n: int = 3) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.bool)
    out[list(bad)] = True
    return out


def test_paper_defaults() -> None:
    rules = ScaleRules()
    assert rules.init_log2 == 13 and rules.cooldown == 125
    assert rules.growth_factor == pytest.approx(2 ** (1 / 1000)) and rules.backoff_factor == pytest.approx(0.5**0.5)
    assert (rules.min_log2, rules.max_log2) == (7, 24)
    scales = BlockScales(["a", "b"], rules, replicas=8)
    assert scales.scales().tolist() == [8 * 2.0**13, 8 * 2.0**13]  # M * 2^13


def test_growth_backoff_cooldown_clamp_scripted() -> None:
    # Quarter-binade growth, half-binade backoff, cooldown of 3 attempts, clamp [0, 2]: small numbers, same rules.
    rules = ScaleRules(
        init_log2=1.0, growth_factor=2**0.25, backoff_factor=2**-0.5, cooldown=3, min_log2=0.0, max_log2=2.0
    )
    s = BlockScales(["b0", "b1", "b2"], rules)
    # (flags of attempt t, expected step?, expected exponents after attempt t) -- worked out by hand from the rules.
    script = [
        (_flags(), True, [1.25, 1.25, 1.25]),  # t0 finite: all grow
        (_flags(1), False, [1.25, 0.75, 1.25]),  # t1 b1 overflows: skip, only b1 backs off
        (_flags(), True, [1.5, 1.0, 1.5]),  # t2 finite: an update was applied since b1's backoff
        (_flags(1), False, [1.5, 1.0, 1.5]),  # t3 b1 again, within cooldown (3-1 < 3) and not stuck: no backoff
        (_flags(0, 1), False, [1.0, 0.5, 1.5]),  # t4 b0 first backoff; b1 cooled (4-1 >= 3)
        (_flags(1), False, [1.0, 0.0, 1.5]),  # t5 b1 within cooldown but stuck (nothing applied since t4): backs off
        (_flags(1), False, [1.0, 0.0, 1.5]),  # t6 stuck again: -0.5, clamped at min_log2 = 0
        (_flags(), True, [1.25, 0.25, 1.75]),  # t7 finite
        (_flags(), True, [1.5, 0.5, 2.0]),  # t8 b2 reaches the max
        (_flags(), True, [1.75, 0.75, 2.0]),  # t9 clamped at max_log2
        (_flags(1), False, [1.75, 0.25, 2.0]),  # t10 b1 (last backoff t6, 4 >= 3)
        (_flags(), True, [2.0, 0.5, 2.0]),  # t11 finite
        (_flags(1), False, [2.0, 0.5, 2.0]),  # t12 cooling (12-10 < 3) and not stuck
        (_flags(1), False, [2.0, 0.0, 2.0]),  # t13 cooled (13-10 >= 3)
    ]
    for t, (flags, step, expected) in enumerate(script):
        assert s.update(flags) is step, f"attempt {t}"
        assert s.log2.tolist() == pytest.approx(expected), f"attempt {t}"
    assert s.updates == len(script)
    assert s.skipped == sum(not step for _, step, _ in script)
    assert s.nonfinite_counts.tolist() == [1, 8, 0]
    assert s.scales().tolist() == pytest.approx([4.0, 1.0, 4.0])


def test_a_scale_that_starts_too_high_recovers_without_waiting_for_the_cooldown() -> None:
    """Gradients that overflow at any scale above 2^8: the paper's rules with the default cooldown of 125.

    Consecutive overflows with no applied update back off at every attempt, so training resumes after
    (13 - 8) / 0.5 = 10 skipped attempts; with the cooldown counted through them it would take 10 x 125.
    """
    s = BlockScales(["a", "b"])
    applied_at = None
    for attempt in range(40):
        if s.update(s.log2 > 8.0):
            applied_at = attempt
            break
    assert applied_at == 10 and s.skipped == 10
    assert s.log2.tolist() == pytest.approx([8.001, 8.001], abs=1e-9)
    # In the steady state the cooldown holds again: occasional overflows skip their update but back off no scale
    # within 125 attempts of the last backoff.
    for attempt in range(50):
        s.update(torch.tensor([attempt % 10 == 0, False]))
    assert s.log2.tolist() == pytest.approx([8.001 + 0.045] * 2, abs=1e-9)


def test_a_block_that_overflows_at_every_attempt_after_one_applied_update_backs_off_again() -> None:
    """The pattern a 4-process fp16 CLIP met: the block backs off, one update goes through, then the block
    overflows at every attempt above 2^11. Read literally, the cooldown holds its scale for 125 skipped attempts;
    a block flagged on two attempts in a row is not overflowing now and then, so it backs off at the second."""
    s = BlockScales(["a", "b"])
    assert s.update(_flags(0, n=2)) is False  # 13 -> 12.5
    assert s.update(_flags(n=2)) is True  # one update goes through: 12.501
    applied = [s.update(torch.tensor([bool(s.log2[0] > 11.0), False])) for _ in range(10)]
    # attempt 2 skips under the cooldown, attempts 3 and 4 back off (12.001, 11.501), attempt 5 overflows again
    # (11.501 > 11) and backs off to 11.001, which still overflows: 11.001 -> 10.501 at attempt 6, then updates go on.
    assert applied == [False] * 5 + [True] * 5
    assert s.log2[0].item() == pytest.approx(10.501 + 0.005, abs=1e-9)
    assert s.log2[1].item() == pytest.approx(13.0 + 0.001 * 6, abs=1e-9)  # the other block never backed off


def test_non_block_nonfinite_skips_without_backoff() -> None:
    s = BlockScales(["a", "b"], ScaleRules(cooldown=0))
    assert s.update(_flags(n=2), other_nonfinite=True) is False
    assert s.log2.tolist() == [13.0, 13.0] and s.skipped == 1


def test_paper_growth_doubles_in_a_thousand_updates() -> None:
    s = BlockScales(["a"])
    for _ in range(1000):
        s.update(_flags(n=1))
    assert s.log2.item() == pytest.approx(14.0, abs=1e-9)  # float64 exponents: no drift


def test_state_dict_round_trip_continues_cooldown() -> None:
    rules = ScaleRules(cooldown=3)
    a = BlockScales(["x", "y"], rules)
    a.update(_flags(0, n=2))
    a.update(_flags(n=2))
    b = BlockScales(["x", "y"], rules)
    b.load_state_dict(a.state_dict())
    assert b.update(_flags(0, n=2)) is False
    assert b.log2[0].item() == pytest.approx(13 - 0.5 + 0.001)  # second overflow 2 attempts later: still cooling down
    a.update(_flags(0, n=2))
    assert b.state_dict() == a.state_dict()
    older = {k: v for k, v in a.state_dict().items() if k != "last_flagged"}  # written before the key existed
    c = BlockScales(["x", "y"], rules)
    c.load_state_dict(older)
    assert c.last_flagged.tolist() == [_NEVER] * 2 and c.log2.tolist() == a.log2.tolist()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 0.9}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"cooldown": -1}, "cooldown"),
        ({"init_log2": 30.0}, "init_log2"),
    ],
)
def test_bad_rules_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaleRules(**kwargs)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="replicas"):
        BlockScales(["a"], replicas=0)
    s = BlockScales(["a", "b"])
    with pytest.raises(ValueError, match="one per block"):
        s.update(torch.zeros(3))
    with pytest.raises(ValueError, match="resblocks"):
        s.load_state_dict(BlockScales(["a", "c"]).state_dict())
    assert math.isfinite(s.scales().sum().item())
