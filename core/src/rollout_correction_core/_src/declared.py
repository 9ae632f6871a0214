"""Every statistic the library reduces, declared once with its reduction, as torchmetrics'
``add_state(..., dist_reduce_fx=)``: recorders and readers pass these objects, never a name.

A :class:`Stat` is a slot of the packed vector of :mod:`.stats`; a :class:`Family` declares the
statistics of one family. The declaration fixes the slot order (:func:`position`): families in
declaration order (each rejection option's after :data:`RS`, by option name: :mod:`.rejection`
declares them), then a family's own. Everything is declared at import: nothing here changes
afterwards (a compiled pass reads it).
Which statistics a call records is the config's selection of metric families
(:data:`~.config.METRIC_FAMILIES`).
"""

from __future__ import annotations

import itertools
from typing import Iterator, NamedTuple, Optional

__all__ = ["Stat", "Family"]  # the library's own families below are internal

_RANKS = itertools.count()
_POSITIONS: dict[str, tuple] = {}


class Stat(NamedTuple):
    """One declared statistic: its slot ``name`` and its ``reduce`` (sum, max or min)."""

    name: str
    reduce: str


class Family:
    """The statistics of one family as attributes (``IS.sum_w``), in declaration order when iterated."""

    def __init__(self, prefix: str, sums: str = "", maxes: str = "", mins: str = "",
                 rank: Optional[tuple] = None) -> None:
        self._stats = tuple(Stat(prefix + n, r) for r, names in (("sum", sums), ("max", maxes), ("min", mins))
                            for n in names.split())
        self.rank = rank = (next(_RANKS),) if rank is None else rank
        for i, s in enumerate(self._stats):
            if _POSITIONS.setdefault(s.name, (rank, i)) != (rank, i):
                raise ValueError(f"statistic {s.name!r} is declared twice")
            setattr(self, s.name[len(prefix):], s)

    def __iter__(self) -> Iterator[Stat]:
        return iter(self._stats)


#: The counts every family divides by (:meth:`LogRatioBatch.add_counts`).
COUNTS = Family("", "n_tok n_rows n_rows_input n_sentinel n_tok_input")
#: ``rollout_is_*`` (token levels: w and its band counts; sequence and segment levels: per-unit values).
IS = Family("is.", "sum_w sum_w2 out_signed out units high low raw_sum raw_sum2 log_sum collapsed oob "
            "seq_sum seq_sum2 seq_high seq_low", "max max_log seq_max", "min min_log seq_min")
#: The chained rejection: valid tokens rejected, rows with one, rows rejected in full and their outcome.
RS = Family("rs.", "masked seq_masked rejected_rows rejected_positive")
VETO = Family("veto.", "tok rows")
VETO_HIGH = Family("veto_high.", "tok rows")
OFFPOLICY = Family("op.", "sum_lr sum_k3 sum_rho2 train_log_ppl train_ppl roll_log_ppl roll_ppl d abs_d ppl_ratio "
                   "rho2_seq sum_rho rho_seq", "d_max neg_d_max")
MISMATCH = Family("mm.", "q p qq pp qp lq lp lqlq lplp lqlp d dd js gt1 gt2 a_seq", "d_max a_max")
#: Valid tokens whose ratio lies in each band of :data:`metrics.RATIO_BANDS` (with ``mismatch_metrics``).
RATIO_BANDS = Family("band.", "tight pct1 pct5")
EXPECT_ZERO = Family("ez.", maxes="max_abs")
ALIGN = Family("align.", "n d0 late early")
OPSM = Family("opsm.", "n_tok n_rows masked seq_masked div_rows div_sum")
#: ``actor/*`` of :func:`compute_policy_loss`: per-token sums, the tokens in the loss, input and bad rows.
ACTOR = Family("", "ppo_kl pg_clipfrac pg_clipfrac_lower n input_rows bad_rows")


def position(name: str) -> tuple:
    """The declared slot of the statistic ``name`` (a minimum's ``-name`` too): its sort key."""
    try:
        return _POSITIONS[name.lstrip("-")]
    except KeyError:
        raise ValueError(f"statistic {name!r} is not declared (in _src/declared.py)") from None
