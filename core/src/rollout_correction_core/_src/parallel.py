"""Where a batch lives across ranks: one object instead of a parameter per group."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from .agreement import verifying

__all__ = ["Parallel", "Verify"]

#: When the ranks of a group agree on what a collective will exchange: at every call (``"always"``,
#: the default; no host sync in correct use on a device, see :mod:`.agreement`), or the first time a
#: (group, layout) is seen and trusted after (``"once"``: faster, unsafe under configurations that
#: change between calls).
Verify = Literal["once", "always"]


@dataclass(frozen=True)
class Parallel:
    """The process groups a call reduces over.

    Attributes:
        dp_group: the data-parallel group: the batch's rows are split over its ranks, and every
            batch statistic (means, fractions, ESS, batch normalisation, M2PO) is reduced over it.
        cp_group: the context-parallel group (Megatron's ``mpu.get_context_parallel_group()``, or
            Ulysses): every rank holds its own tokens of the same rows in the same order, in any
            layout (a slice, the two zig-zag chunks, padding, an empty slice), each valid token held
            by exactly one rank; one all-gather of (B, k) per-row partials (never token tensors) per
            pass makes every per-sequence quantity that of the unsplit rows (up to rounding).
            ``dp_group`` is then the data-parallel group without or with context parallelism, or
            None when the context-parallel group holds the whole batch (a partial overlap raises).
        verify: when the ranks of each group agree on what they exchange (see :data:`Verify`).

    ``Parallel()`` is one process holding whole rows.
    """

    dp_group: Optional[object] = None
    cp_group: Optional[object] = None
    verify: Verify = "always"

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
    """``fn(..., parallel=...)`` run under its ``parallel.verify`` setting (a context variable: each
    thread and task keeps its own)."""
    @functools.wraps(fn)
    def call(*args, parallel: Optional[Parallel] = None, **kwargs):
        parallel = as_parallel(parallel)
        with verifying(parallel.verify):
            return fn(*args, parallel=parallel, **kwargs)

    return call
