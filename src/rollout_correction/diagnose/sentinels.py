"""Engine sentinels: values an engine writes into a log-prob column that are not log-probabilities.

vLLM returns −9999 as the log-prob of a token it has none for (AReaL #1554); a reader that takes
the wrong entry of an engine's log-prob dict gets such values too (NeMo-RL #3297). Taken as a
log-prob, one of them at a valid position gives its row a ratio of e^±9999 (clamped) and moves the
batch's KL by thousands. A finite log-prob at or below the floor, at a valid position, is counted
as a sentinel here, for each side of the comparison separately (the rollout engine's column and
the trainer's), with the first positions (row in the dump, response column) where it occurs.
−inf and NaN are not counted: they are non-finite, and reported as such.

The floor is the correction's ``log_prob_floor`` config key when a config is given (None: no
floor), else :data:`DEFAULT_LOG_PROB_FLOOR`.
"""

from __future__ import annotations

import math

import numpy as np

from rollout_correction import LOG_PROB_FLOOR

from .readers import Chunk

#: At or below this, a log-prob is a sentinel: the same default as the correction's
#: ``log_prob_floor`` config key. No real token log-prob comes near it (a uniform distribution
#: over 10⁶ tokens gives −13.8), and vLLM's sentinel −9999 lies well below it.
DEFAULT_LOG_PROB_FLOOR = LOG_PROB_FLOOR

#: Positions listed per side (the counts cover all of them).
MAX_POSITIONS = 20

#: (key, what wrote the column): the rollout engine's log-probs and the trainer's.
SIDES = (("rollout", "rollout engine"), ("trainer", "trainer"))


def log_prob_floor(config=None) -> float | None:
    """The sentinel floor: ``config.log_prob_floor`` when a config (a ``RolloutCorrectionConfig``,
    a preset name or a mapping, as ``as_config`` reads it) is given, else the default; None: off."""
    if config is None:
        floor = DEFAULT_LOG_PROB_FLOOR
    elif hasattr(config, "log_prob_floor"):
        floor = config.log_prob_floor
    else:
        from rollout_correction import as_config

        floor = getattr(as_config(config), "log_prob_floor", DEFAULT_LOG_PROB_FLOOR)
    if floor is None:
        return None
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor) or floor >= 0:
        raise ValueError(f"log_prob_floor must be a finite number < 0 or None; got {floor!r}")
    return float(floor)


class SentinelScan:
    """Counts the sentinels of each side over the chunks of a dump, in row order."""

    def __init__(self, floor: float | None = DEFAULT_LOG_PROB_FLOOR):
        self.floor = floor
        self.sides = {key: {"source": source, "tokens": 0, "rows": 0, "lowest": None, "positions": []}
                      for key, source in SIDES}

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.sides.values())

    def update(self, chunk: Chunk, first_row: int) -> None:
        """Scan one chunk whose first row is row ``first_row`` of the dump."""
        if self.floor is None:
            return
        for key, column in (("rollout", chunk.rollout_log_probs), ("trainer", chunk.old_log_probs)):
            hit = chunk.response_mask & np.isfinite(column) & (column <= self.floor)
            n = int(hit.sum())
            if n == 0:
                continue
            side = self.sides[key]
            side["tokens"] += n
            side["rows"] += int(hit.any(axis=1).sum())
            low = float(column[hit].min())
            side["lowest"] = low if side["lowest"] is None else min(side["lowest"], low)
            room = MAX_POSITIONS - len(side["positions"])
            if room > 0:
                rows, cols = np.nonzero(hit)  # row-major: the dump's order
                side["positions"] += [[first_row + int(r), int(c)] for r, c in zip(rows[:room], cols[:room])]

    def as_dict(self) -> dict:
        return {"floor": self.floor, "tokens": self.tokens, **{k: dict(v) for k, v in self.sides.items()}}


def describe(sentinels: dict) -> str:
    """One sentence: how many sentinels each side holds and where the first ones are."""
    parts = []
    for key, _ in SIDES:
        s = sentinels[key]
        if s["tokens"]:
            where = ", ".join(f"({r}, {c})" for r, c in s["positions"][:3])
            parts.append(f"{s['tokens']:,} from the {s['source']} in {s['rows']:,} row(s), lowest {s['lowest']:g}, "
                         f"first at (row, column) {where}")
    return "; ".join(parts)


__all__ = ["DEFAULT_LOG_PROB_FLOOR", "MAX_POSITIONS", "SentinelScan", "describe", "log_prob_floor"]
