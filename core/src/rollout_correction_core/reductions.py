"""Statistics that reduce exactly across ranks, chunks and context-parallel slices, and the input
checks every entry point makes — public for adapters that reduce their own quantities the way the
library does (a routing-agreement rate, a per-step metric).

* :class:`SufficientStats` — sums and maxima of declared statistics (:class:`Stat`, :class:`Family`);
  ``add`` / ``merge`` locally, one ``all_reduce`` per kind over a process group, then ratios with
  :func:`safe_div` (0 where the denominator is 0). :class:`HostStats` is the same on the host; :func:`seq_summary` reduces a
  per-sequence quantity. The elementwise helpers (:func:`where`, :func:`sqrt0`, :func:`exp`,
  :func:`clamp`, :func:`maximum`) accept tensors and floats alike.
* :class:`RowExchange` — sequences split over the ranks of a context- or sequence-parallel group:
  per-row partials exchanged once, reduced by the rank that owns the row
  (:func:`group_ranks`, :func:`stats_owner`, :func:`check_sequence_group`, :func:`reduce_owned`,
  :func:`raise_nonfinite`).
* :class:`Parallel` — the data- and context-parallel groups a call reduces over, as one object.
* Checks at the door — :func:`check_pair`, :func:`check_same`, :func:`check_segment_ids`,
  :func:`first_nonfinite`; a bad shape raises :class:`ShapeMismatchError`.

Provisional (docs/api.md): a minor release may change these names without a deprecation release.
"""

from ._src.declared import Family, Stat
from ._src.parallel import Parallel, Verify
from ._src.sequence_group import (RowExchange, check_sequence_group, group_ranks, raise_nonfinite,
                                  raise_nonfinite_on_any_rank, reduce_owned,
                                  stats_owner)
from ._src.stats import (HostStats, LayoutMismatchError, SufficientStats, Value, clamp, exp, maximum, safe_div,
                         seq_summary, sqrt0, where)
from ._src.validation import ShapeMismatchError, check_pair, check_same, check_segment_ids, first_nonfinite

__all__ = [
    "SufficientStats", "HostStats", "Value", "safe_div", "seq_summary", "where", "sqrt0", "exp", "clamp", "maximum",
    "Stat", "Family", "LayoutMismatchError", "Parallel", "Verify",
    "RowExchange", "group_ranks", "stats_owner", "check_sequence_group", "reduce_owned", "raise_nonfinite",
    "raise_nonfinite_on_any_rank",
    "ShapeMismatchError", "check_pair", "check_same", "check_segment_ids", "first_nonfinite",
]
