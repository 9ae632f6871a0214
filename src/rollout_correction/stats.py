"""Sufficient statistics that reduce exactly across ranks and chunks.

Every batch-level number the library reports is a function of a few named **sums** (counts,
sums, sums of squares) and **maxima** (a minimum is stored as the maximum of the negated value).
Sums add and maxima take the max, whether the parts are data-parallel ranks or streamed chunks,
so the derived numbers do not depend on how the batch was split. Reducing over a process group
takes two collectives — one SUM of the packed sums, one MAX of the packed maxima — and turning
all values into Python floats takes one device sync.

Recording is deferred: a part may be a per-row vector (B,) or a scalar; parts of the same shape
are stacked and reduced together in float64 when the values are first needed, so a call with
dozens of statistics costs a handful of kernel launches rather than one per statistic.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

__all__ = ["SufficientStats", "safe_div", "seq_summary"]


def _reduce(parts: dict[str, list[torch.Tensor]], op: str) -> dict[str, torch.Tensor]:
    """Reduce every part to a float64 scalar (sum or max over all its elements), batching parts
    of equal shape and dtype into one stacked reduction; then combine the parts of each name."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, ts in parts.items():
        for t in ts:
            groups[(tuple(t.shape), t.dtype, t.device)].append((name, t))
    out: dict[str, torch.Tensor] = {}
    for items in groups.values():
        stacked = torch.stack([t for _, t in items]).reshape(len(items), -1).to(torch.float64)
        if op == "sum":
            values = stacked.sum(1)
        elif stacked.shape[1] == 0:
            values = torch.full((len(items),), -torch.inf, dtype=torch.float64, device=stacked.device)
        else:
            values = stacked.amax(1)
        for (name, _), v in zip(items, values.unbind()):
            if name not in out:
                out[name] = v
            else:
                out[name] = out[name] + v if op == "sum" else torch.maximum(out[name], v)
    return out


class SufficientStats:
    """Named float64 sums and maxima, with exact merge and all-reduce.

    ``add_sum(name, x)`` / ``add_max(name, x)`` / ``add_min(name, x)`` record tensors of any shape
    (their elements are summed / maxed); adding to an existing name accumulates. An empty maximum
    is ``-inf`` or a large negative number; the code that derives a metric checks the matching
    count before using it.
    """

    def __init__(self) -> None:
        self._sum_parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._max_parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._sums: dict[str, torch.Tensor] = {}
        self._maxes: dict[str, torch.Tensor] = {}

    @classmethod
    def from_values(cls, sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor]) -> "SufficientStats":
        """Statistics whose values are already reduced (e.g. returned by a compiled pass)."""
        out = cls()
        out._sums, out._maxes = dict(sums), dict(maxes)
        return out

    # -- recording ---------------------------------------------------------------------
    def add_sum(self, name: str, value: torch.Tensor) -> None:
        self._sum_parts[name].append(value.detach())

    def add_max(self, name: str, value: torch.Tensor) -> None:
        self._max_parts[name].append(value.detach())

    def add_min(self, name: str, value: torch.Tensor) -> None:
        self._max_parts["-" + name].append(-value.detach())

    def _settle(self) -> None:
        if self._sum_parts:
            for k, v in _reduce(self._sum_parts, "sum").items():
                self._sums[k] = self._sums[k] + v if k in self._sums else v
            self._sum_parts.clear()
        if self._max_parts:
            for k, v in _reduce(self._max_parts, "max").items():
                self._maxes[k] = torch.maximum(self._maxes[k], v) if k in self._maxes else v
            self._max_parts.clear()

    # -- reading -----------------------------------------------------------------------
    @property
    def sums(self) -> dict[str, torch.Tensor]:
        self._settle()
        return self._sums

    @property
    def maxes(self) -> dict[str, torch.Tensor]:
        self._settle()
        return self._maxes

    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxes[name]

    def min(self, name: str) -> torch.Tensor:
        return -self.maxes["-" + name]

    # -- combining ---------------------------------------------------------------------
    def merge(self, other: "SufficientStats") -> "SufficientStats":
        """Accumulate ``other`` into ``self`` (sums add, maxima take the max)."""
        self._settle()
        for k, v in other.sums.items():
            self._sums[k] = self._sums[k] + v if k in self._sums else v
        for k, v in other.maxes.items():
            self._maxes[k] = torch.maximum(self._maxes[k], v) if k in self._maxes else v
        return self

    def all_reduce(self, process_group: Optional[object] = None) -> "SufficientStats":
        """Reduce in place over ``process_group`` with one SUM and one MAX collective.

        Every rank must have recorded the same names (true by construction: names depend on
        the config only, never on the data).
        """
        import torch.distributed as dist

        if process_group is None or not (dist.is_available() and dist.is_initialized()):
            return self
        self._settle()
        if self._sums:
            keys = sorted(self._sums)
            packed = torch.stack([self._sums[k].reshape(()) for k in keys])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
            self._sums = dict(zip(keys, packed.unbind()))
        if self._maxes:
            keys = sorted(self._maxes)
            packed = torch.stack([self._maxes[k].reshape(()) for k in keys])
            # -inf is not transported reliably by every backend; use the float64 lowest value.
            lowest = torch.finfo(torch.float64).min
            packed = packed.clamp_min(lowest)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
            packed = torch.where(packed <= lowest, torch.full_like(packed, -torch.inf), packed)
            self._maxes = dict(zip(keys, packed.unbind()))
        return self


# -- deriving values from reduced statistics ---------------------------------------------
def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, or 0 when den == 0 (a statistic over an empty set is reported as 0)."""
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def seq_summary(stats: SufficientStats, key: str, n_rows: torch.Tensor, center: float) -> dict[str, torch.Tensor]:
    """mean, unbiased std, max, min and max |x − center| of per-row values recorded under
    ``key`` (as ``<key>_sum``, ``<key>_sum2``, ``<key>_max`` and ``<key>_min``); all 0 when
    ``n_rows`` is 0, std 0 when it is 1."""
    s, s2 = stats.sum(f"{key}_sum"), stats.sum(f"{key}_sum2")
    mean = safe_div(s, n_rows)
    var = safe_div(s2 - s * mean, n_rows - 1)
    std = torch.where(n_rows > 1, var.clamp_min(0).sqrt(), torch.zeros_like(var))
    mx, mn = stats.max(f"{key}_max"), stats.min(f"{key}_min")
    has = n_rows > 0
    zero = torch.zeros_like(mean)
    mx_, mn_ = torch.where(has, mx, zero), torch.where(has, mn, zero)
    dev = torch.where(has, torch.maximum((mx - center).abs(), (mn - center).abs()), zero)
    return {"mean": mean, "std": std, "max": mx_, "min": mn_, "max_deviation": dev}
