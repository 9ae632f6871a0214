"""Sufficient statistics that reduce exactly across ranks and chunks.

Every batch-level number the library reports is a function of a few named **sums** (counts,
sums, sums of squares) and **maxima** (a minimum is stored as the maximum of the negated value).
Sums add and maxima take the max, whether the parts are data-parallel ranks or streamed chunks,
so the derived numbers do not depend on how the batch was split. Reducing over a process group
takes two collectives — one SUM of the packed sums, one MAX of the packed maxima — and turning
all values into Python floats takes one device sync.

Sums are kept in float64: per-row quantities are few (one per sequence) and the extra precision
keeps E[x²] − E[x]² style formulas accurate.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SufficientStats"]


class SufficientStats:
    """Named float64 sums and maxima, with exact merge and all-reduce.

    ``add_sum(name, x)`` / ``add_max(name, x)`` / ``add_min(name, x)`` record 0-d tensors;
    adding to an existing name accumulates. An empty maximum is ``-inf`` (the identity of max);
    the code that derives a metric checks the matching count before using it.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    # -- recording ---------------------------------------------------------------------
    def add_sum(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().to(torch.float64)
        self.sums[name] = self.sums[name] + v if name in self.sums else v

    def add_max(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().to(torch.float64)
        self.maxes[name] = torch.maximum(self.maxes[name], v) if name in self.maxes else v

    def add_min(self, name: str, value: torch.Tensor) -> None:
        self.add_max("-" + name, -value.detach().to(torch.float64))

    # -- reading -----------------------------------------------------------------------
    def sum(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self.maxes[name]

    def min(self, name: str) -> torch.Tensor:
        return -self.maxes["-" + name]

    # -- combining ---------------------------------------------------------------------
    def merge(self, other: "SufficientStats") -> "SufficientStats":
        """Accumulate ``other`` into ``self`` (sums add, maxima take the max)."""
        for k, v in other.sums.items():
            self.add_sum(k, v)
        for k, v in other.maxes.items():
            self.maxes[k] = torch.maximum(self.maxes[k], v) if k in self.maxes else v
        return self

    def all_reduce(self, process_group: Optional[object] = None) -> "SufficientStats":
        """Reduce in place over ``process_group`` with one SUM and one MAX collective.

        Every rank must have recorded the same names (true by construction: names depend on
        the config only, never on the data).
        """
        import torch.distributed as dist

        if process_group is None or not (dist.is_available() and dist.is_initialized()):
            return self
        if self.sums:
            keys = sorted(self.sums)
            packed = torch.stack([self.sums[k].reshape(()) for k in keys])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
            self.sums = dict(zip(keys, packed.unbind()))
        if self.maxes:
            keys = sorted(self.maxes)
            packed = torch.stack([self.maxes[k].reshape(()) for k in keys])
            # -inf is not transported reliably by every backend; use the float64 lowest value.
            lowest = torch.finfo(torch.float64).min
            packed = packed.clamp_min(lowest)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=process_group)
            packed = torch.where(packed <= lowest, torch.full_like(packed, -torch.inf), packed)
            self.maxes = dict(zip(keys, packed.unbind()))
        return self
