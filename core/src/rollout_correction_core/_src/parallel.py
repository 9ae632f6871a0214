"""Where a batch lives across ranks: one object instead of a parameter per group."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, Optional

__all__ = ["Parallel", "Verify"]

#: When the ranks of a group agree on what a collective will exchange: at the first call for a
#: (group, layout) pair (``"once"``, then cached), or before every call (``"always"``, for configs
#: that change between calls while debugging).
Verify = Literal["once", "always"]


@dataclass(frozen=True)
class Parallel:
    """The process groups a call reduces over.

    Attributes:
        dp_group: the data-parallel group: the batch's rows are split over its ranks, and every
            batch statistic (means, fractions, ESS, batch normalisation, M2PO) is reduced over it.
        cp_group: the context-parallel group: every row's tokens are split over its ranks (each
            valid token held by exactly one of them), and every per-sequence quantity is
            reduced over it.
        verify: when the ranks of each group agree on the layout of the exchange (see :data:`Verify`).

    ``Parallel()`` is one process holding whole rows.
    """

    dp_group: Optional[object] = None
    cp_group: Optional[object] = None
    verify: Verify = "once"

    def __post_init__(self) -> None:
        if self.verify not in ("once", "always"):
            raise ValueError(f"Parallel(verify={self.verify!r}): expected 'once' or 'always'")


def as_parallel(parallel: Optional[Parallel]) -> Parallel:
    """``parallel``, or ``Parallel()`` (one process, whole rows) for None; anything else (a bare
    process group) raises TypeError."""
    if parallel is None:
        return Parallel()
    if not isinstance(parallel, Parallel):
        raise TypeError(f"parallel={parallel!r} is not a Parallel: wrap a data-parallel group as "
                        "Parallel(dp_group=group), a context-parallel one as Parallel(cp_group=group)")
    return parallel


def verified(fn: Callable) -> Callable:
    """``fn(..., parallel=...)`` run under its ``parallel.verify`` setting (agreement before every
    collective with ``"always"``; once per group and exchange by default)."""
    from .stats import _VERIFY  # the setting ``agree`` reads, innermost call last

    @functools.wraps(fn)
    def call(*args, parallel: Optional[Parallel] = None, **kwargs):
        parallel = as_parallel(parallel)
        _VERIFY.append(parallel.verify)
        try:
            return fn(*args, parallel=parallel, **kwargs)
        finally:
            _VERIFY.pop()

    return call
