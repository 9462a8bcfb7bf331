"""The per-resblock gradient-scale state machine of the DALL-E paper (mixed-precision section).

Each resblock ``b`` has its own scale ``M * 2**x_b`` (``M`` = data-parallel replicas). After every optimizer
update attempt the scales move by these rules:

- the update was applied (every block finite): every scale is multiplied by ``growth_factor`` (2^(1/1000));
- some block was non-finite: the update is skipped, and each *flagged* block's scale is multiplied by
  ``backoff_factor`` (1/sqrt(2)) unless that block already backed off within the last ``cooldown`` (125)
  updates; unflagged blocks keep their scale (one bad block must not drag the others down);
- every exponent is clamped to ``[min_log2, max_log2]`` (2^7 .. 2^24 times ``M``).

The cooldown protects a scale that works: it stops a block that overflows now and then from backing off again
and again within ``cooldown`` attempts while updates still get applied. It does not hold while training is
stuck, in two cases where the paper's rule read literally skips up to ``cooldown`` updates in a row:

- no update at all was applied since the block's last backoff (every attempt since then overflowed): a scale
  that starts too high falls by 1/sqrt(2) per attempt until an update goes through, as a global dynamic loss
  scaler recovers, instead of one step per ``cooldown`` attempts (which from 2^13 takes thousands of skipped
  updates to clear a few powers of two);
- the block overflowed on the previous attempt too (two skipped attempts in a row flag it): an overflow that
  persists is not "now and then". Without this, a block that backs off, lets one update through, then overflows
  at every attempt skips the next ``cooldown`` updates (seen: a 4-process fp16 CLIP skipped every update from
  its third on). With the paper's ~5% skipped updates, two in a row flagging one block are rare, and the extra
  backoff is regained in 500 applied updates. Exponents (not scales) are stored, in
float64, so a million growth steps of 0.001 do not drift and ``M`` may change on resume.

Pure torch/python, no Lightning: the precision plugin owns one ``BlockScales`` and feeds it the flags.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_NEVER = -(2**62)  # "last backoff" of a block that never backed off: any cooldown has elapsed


@dataclass(frozen=True)
class ScaleRules:
    """The paper's constants, each configurable. Exponents are log2 of the scale divided by ``M``."""

    init_log2: float = 13.0
    growth_factor: float = 2 ** (1 / 1000)
    backoff_factor: float = 2**-0.5
    cooldown: int = 125
    min_log2: float = 7.0
    max_log2: float = 24.0

    def __post_init__(self) -> None:
        if not self.growth_factor >= 1.0:
            raise ValueError(f"growth_factor={self.growth_factor}, expected >= 1 (scales grow while finite)")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={self.backoff_factor}, expected in (0, 1) (scales shrink on overflow)")
        if int(self.cooldown) != self.cooldown or self.cooldown < 0:
            raise ValueError(f"cooldown={self.cooldown}, expected a non-negative integer number of updates")
        if not self.min_log2 <= self.init_log2 <= self.max_log2:
            raise ValueError(
                f"init_log2={self.init_log2}, expected within [min_log2={self.min_log2}, max_log2={self.max_log2}]"
            )


class BlockScales:
    """Scale exponents and bookkeeping for a fixed, named list of resblocks."""

    def __init__(self, names: Sequence[str], rules: ScaleRules | None = None, replicas: int = 1) -> None:
        if not names:
            raise ValueError("names=[], expected at least one resblock name")
        if int(replicas) != replicas or replicas < 1:
            raise ValueError(f"replicas={replicas}, expected a positive integer (data-parallel world size)")
        self.names = list(names)
        self.rules = rules or ScaleRules()
        self.replicas = int(replicas)
        n = len(self.names)
        self.log2 = torch.full((n,), float(self.rules.init_log2), dtype=torch.float64)
        self.last_backoff = torch.full((n,), _NEVER, dtype=torch.int64)
        self.last_flagged = torch.full((n,), _NEVER, dtype=torch.int64)  # last attempt that flagged each block
        self.nonfinite_counts = torch.zeros(n, dtype=torch.int64)
        self.updates = 0  # update attempts so far (applied + skipped): the clock of the cooldown
        self.skipped = 0
        self.last_applied = _NEVER  # attempt index of the last applied update

    def __len__(self) -> int:
        return len(self.names)

    def scales(self) -> Tensor:
        """Current scales ``M * 2**x`` (float64, CPU)."""
        return self.replicas * torch.exp2(self.log2)

    def update(self, nonfinite: Tensor, other_nonfinite: bool = False) -> bool:
        """Apply one update attempt's outcome and return whether the optimizer should step.

        ``nonfinite``: bool/0-1 vector, one entry per block (already agreed across ranks).
        ``other_nonfinite``: a non-finite gradient outside every block (e.g. a NaN loss): skip, back off nobody.
        """
        bad = torch.as_tensor(nonfinite).detach().to("cpu", torch.bool).reshape(-1)
        if bad.numel() != len(self):
            raise ValueError(f"nonfinite has {bad.numel()} entries, expected one per block ({len(self)})")
        rules = self.rules
        step = not (bool(bad.any()) or other_nonfinite)
        if step:
            self.log2 += math.log2(rules.growth_factor)
            self.last_applied = self.updates
        else:
            self.skipped += 1
            self.nonfinite_counts += bad.to(torch.int64)
            cooled = self.updates - self.last_backoff >= rules.cooldown
            stuck = self.last_backoff > self.last_applied  # nothing applied since this block's last backoff
            again = self.last_flagged == self.updates - 1  # this block made the previous attempt skip too
            may = bad & (cooled | stuck | again)
            self.log2[may] += math.log2(rules.backoff_factor)
            self.last_backoff[may] = self.updates
            self.last_flagged[bad] = self.updates
        self.log2.clamp_(rules.min_log2, rules.max_log2)
        self.updates += 1
        return step

    def state_dict(self) -> dict[str, Any]:
        """Plain python values, so a checkpoint loads under ``weights_only=True``."""
        return {
            "names": list(self.names),
            "log2": self.log2.tolist(),
            "last_backoff": self.last_backoff.tolist(),
            "last_flagged": self.last_flagged.tolist(),
            "nonfinite_counts": self.nonfinite_counts.tolist(),
            "updates": self.updates,
            "skipped": self.skipped,
            "last_applied": self.last_applied,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError(
                f"checkpoint scales are for resblocks {list(state['names'])[:3]}... ({len(state['names'])}), "
                f"expected this model's {self.names[:3]}... ({len(self.names)})"
            )
        self.log2 = torch.tensor(state["log2"], dtype=torch.float64)
        self.last_backoff = torch.tensor(state["last_backoff"], dtype=torch.int64)
        flagged = state.get("last_flagged")  # absent in checkpoints written before it existed: none is recent
        self.last_flagged = (torch.tensor(flagged, dtype=torch.int64) if flagged is not None
                             else torch.full_like(self.last_backoff, _NEVER))
        self.nonfinite_counts = torch.tensor(state["nonfinite_counts"], dtype=torch.int64)
        self.updates = int(state["updates"])
        self.skipped = int(state["skipped"])
        self.last_applied = int(state.get("last_applied", self.updates - 1))
