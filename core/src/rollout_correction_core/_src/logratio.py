"""The per-token log-ratio and the per-row sums every estimator shares.

:func:`log_ratio_batch` makes one pass over ``(old_log_prob, rollout_log_prob, response_mask)``
and returns a :class:`LogRatioBatch`: per token (B, T) float32, exactly 0 at every position not
used, and per row (B,) sums taken with one reduction.

Non-finite input. Every value outside the positions used is replaced by 0 (selected, never
multiplied, so a NaN in padding reaches no sum); a valid position holding a non-finite value (or
|log ρ| ≥ 1e30) makes its row *bad*: the row is dropped (mask 0, every sum 0) or, with
``on_nonfinite="raise"``, a ValueError names it. A log-prob ≤ ``log_prob_floor`` (old or rollout)
is an engine's sentinel and counts as non-finite; so does a log-prob > ``log_prob_ceiling`` (0: no
probability has one). Rows are dropped arithmetically, never by a data-dependent branch, so the
pass does not wait for the device.

Split rows. With ``rows`` (a :class:`~rollout_correction_core._src.sequence_group.RowExchange`) each rank
holds part of every row; every per-row reduction then spans the group (the batch's ``reduce_*``
helpers), which is what makes context-parallel results exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

from .config import DEFAULT_FAMILIES
from .constants import LOG_PROB_FLOOR, SAFETY_BOUND, warn_deprecated
from .packing import packable
from .segments import Segments, segment_sums
from .stats import SufficientStats, device_constant
from .declared import COUNTS
from .validation import check_pair, check_same, check_segment_ids

if TYPE_CHECKING:
    from .sequence_group import RowExchange

__all__ = ["LogRatioBatch", "RowSums", "log_ratio", "log_ratio_batch", "NONFINITE_SENTINEL",
           "float_mask", "nonfinite_positions"]

#: Replacement for NaN / ±inf before masking; a valid |log-ratio| this large means "non-finite".
NONFINITE_SENTINEL = 1e30

#: Input dtypes whose subtraction promotes to float32 (``torch.sub`` then upcasts as it subtracts).
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT32_SUB = {(a, b): torch.promote_types(a, b) == torch.float32 for a in _FLOATS for b in _FLOATS}


def float_mask(mask: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(…) float32 0/1: 1 where ``mask`` is non-zero, whatever its dtype (written into ``out`` if given)."""
    if out is not None:
        return torch.ne(mask, 0, out=out)
    return (mask if mask.dtype == torch.bool else mask != 0).to(torch.float32)


def _slots(response_mask: torch.Tensor, count: int) -> Optional[torch.Tensor]:
    """Eagerly, the (count, B, T) float32 buffer of the pass: each per-token value whose row sums
    are needed is computed into its slot, and one reduction sums them all, without a stacked copy
    (peak memory: the values once, not twice). None under torch.compile, where each value's sum is
    fused into the loop that computes it and a buffer would be written to memory in full."""
    if torch.compiler.is_compiling():
        return None
    return torch.empty((count, *response_mask.shape), dtype=torch.float32, device=response_mask.device)


def _slot(slots: Optional[torch.Tensor], i: int) -> Optional[torch.Tensor]:
    """Slot ``i`` of :func:`_slots` (the ``out=`` of the operation that computes it), or None."""
    return None if slots is None else slots[i]


class RowSums(NamedTuple):
    """Per-row (B,) float32 sums over the tokens used (over the valid input tokens for
    ``n_input``). ``train`` (Σ log π_train) is None for a batch built from a log-ratio alone."""

    n_input: torch.Tensor
    n: torch.Tensor
    log_ratio: torch.Tensor
    train: Optional[torch.Tensor]
    k3: torch.Tensor
    ratio: torch.Tensor
    ratio2: torch.Tensor


@dataclass(frozen=True)
class LogRatioBatch:
    """The result of :func:`log_ratio_batch` (module docstring); every tensor belongs to it alone.

    Attributes:
        response_mask: the caller's (B, T) mask, as given.
        input_mask: (B, T) float32 0/1, the valid input tokens.
        mask: (B, T) float32 0/1, the tokens used: ``input_mask`` minus dropped rows.
        log_ratio, log_ratio_clamped, ratio, k3: (B, T) float32, 0 where ``mask`` is 0: log ρ =
            log π_train − log π_rollout, log ρ clamped to ±20, ρ = exp(clamped log ρ), ρ − 1 − log ρ.
        bad_rows: (B,) bool, rows dropped for a non-finite value at a valid position.
        sums: the per-row sums (:class:`RowSums`; ``n_row`` and ``row_sum`` name two of them).
        row_valid: (B,) bool, the row has a token used; ``input_rows``: it has a valid input token.
        old_log_prob, rollout_log_prob: the inputs (None for :meth:`from_log_ratio`).
        rows: the row exchange when the rows are split across a group, else None.
        segment_ids, num_segments: (B, T) int64 segment (turn) of each token, 0 at unused positions,
            ids in [0, num_segments); None: every row is one segment (``num_segments`` 1).
        bounded: the log-probs used are bounded (:func:`bounds_log_probs`): every row mean is finite.
        log_prob_floor: the floor the batch was built with (None: none, or no log-probs).
        split_sentinel_row: with split rows, :attr:`sentinel_row` as the group counted it.
        split_gap_row: with split rows, :attr:`gap_row` as the group took it (None unless asked for).
    """

    response_mask: torch.Tensor
    input_mask: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor
    log_ratio_clamped: torch.Tensor
    ratio: torch.Tensor
    k3: torch.Tensor
    bad_rows: torch.Tensor
    sums: RowSums
    row_valid: torch.Tensor
    input_rows: torch.Tensor
    old_log_prob: Optional[torch.Tensor] = None
    rollout_log_prob: Optional[torch.Tensor] = None
    rows: Optional["RowExchange"] = None
    segment_ids: Optional[torch.Tensor] = None
    num_segments: int = 1
    bounded: bool = False
    log_prob_floor: Optional[float] = None
    split_sentinel_row: Optional[torch.Tensor] = None
    split_gap_row: Optional[torch.Tensor] = None

    @classmethod
    def from_log_ratio(cls, log_ratio: torch.Tensor, response_mask: torch.Tensor, on_nonfinite: str = "reject",
                       row_offset: int = 0) -> "LogRatioBatch":
        """A batch from a precomputed (B, T) log-ratio log π_train − log π_rollout: what depends on
        the ratio only works as usual; the perplexity metrics need the log-probs (:meth:`train_means64`
        raises)."""
        check_same([("log_ratio", log_ratio), ("response_mask", response_mask)], float_names=("log_ratio",))
        slots = _slots(response_mask, 5)
        lr = log_ratio.detach().to(torch.float32, copy=True) if slots is None else slots[2].copy_(log_ratio)
        return _build(lr, response_mask, on_nonfinite, row_offset, source=log_ratio, slots=slots)

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor) -> "LogRatioBatch":
        """A batch that carries a (B, T) response mask only — valid positions, rows and counts —
        for statistics of weights or of a rejection statistic the caller computed itself."""
        return cls.from_log_ratio(torch.zeros_like(response_mask, dtype=torch.float32), response_mask)

    # -- named per-row values ------------------------------------------------------------
    @property
    def sentinel_row(self) -> Optional[torch.Tensor]:
        """(B,) float32 count of the valid positions holding a finite log-prob ≤ the floor (an engine's
        sentinel; NaN and −inf are non-finite, not sentinels); None without log-probs or floor. Whole
        rows: counted when read (only the ``sentinel`` family reads it); split rows: counted across the
        group as the batch is built, before its rows are dropped (None unless ``rows.families`` has it)."""
        if self.log_prob_floor is None or self.old_log_prob is None or self.rows is not None:
            return self.split_sentinel_row
        return _sentinels(self.old_log_prob, self.rollout_log_prob, self.input_mask, self.log_prob_floor)

    @property
    def gap_row(self) -> torch.Tensor:
        """(B,) float32 largest |log π_train − log π_rollout| over each row's valid input tokens, dropped
        rows too (NaN and ±inf as 1e30): expect-zero's measure. Split rows: taken by the group as the
        batch is built, before its rows are dropped (None unless ``rows.families`` has expect_zero)."""
        if self.rows is not None or self.old_log_prob is None:
            return self.split_gap_row
        return _gaps(self.old_log_prob, self.rollout_log_prob, self.input_mask)

    @property
    def n_row(self) -> torch.Tensor:
        """(B,) float32 count of the tokens used per row."""
        return self.sums.n

    @property
    def row_sum(self) -> torch.Tensor:
        """(B,) Σ_t log ρ_t per row."""
        return self.sums.log_ratio

    @property
    def valid(self) -> torch.Tensor:
        """(B, T) bool mask of the tokens used."""
        return self.mask > 0

    def row_mean(self) -> torch.Tensor:
        """(B,) mean_t log ρ_t per row (0 for empty rows)."""
        return self.sums.log_ratio / self.sums.n.clamp_min(1.0)

    def train_means64(self) -> torch.Tensor:
        """(2, B) float64 mean_t log ρ_t and mean_t log π_train per row (0 for empty rows, bounded at
        ±1e30 per token), or a ValueError that says how to build a batch that has them."""
        return row_means64(self.sums, self.bounded)

    # 0.2's fields, deprecated since 0.3 and removed in 0.4
    @property
    def row_sum64(self) -> torch.Tensor:
        """Deprecated (removed in 0.4): (B,) float64 Σ_t log ρ_t, ``row_sum`` in float64."""
        warn_deprecated("LogRatioBatch.row_sum64", "LogRatioBatch.row_sum (float32; .double() for float64)")
        return self.sums.log_ratio.double()

    @property
    def row_means64(self) -> Optional[torch.Tensor]:
        """Deprecated (removed in 0.4): :meth:`train_means64`, None for a batch built from a log-ratio alone."""
        warn_deprecated("LogRatioBatch.row_means64", "LogRatioBatch.train_means64()")
        return None if self.sums.train is None else row_means64(self.sums, self.bounded)

    def log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) float32 log π_train and log π_rollout at the tokens used, 0 elsewhere (whatever the
        inputs hold there); a ValueError for a batch built from a log-ratio alone."""
        if self.old_log_prob is None or self.rollout_log_prob is None:
            raise ValueError("probability-space statistics (TV, binary KL, |p_train − p_rollout|) need the "
                             "log-probs, not only their ratio: build the batch with "
                             "log_ratio_batch(old_log_prob, rollout_log_prob, response_mask)")
        valid = self.valid
        return (torch.where(valid, self.old_log_prob.to(torch.float32), 0.0),
                torch.where(valid, self.rollout_log_prob.to(torch.float32), 0.0))

    # -- reductions over a row: a per-row (B,) partial sum / max / min in, the row's value out
    # (the partial itself for whole rows, the group's value when the rows are split)
    def reduce_sum(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.rows is None else self.rows.sum(partial)

    def reduce_max(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.rows is None else self.rows.max(partial)

    def reduce_min(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.rows is None else self.rows.min(partial)

    def row_total(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row Σ_t of a (B, T) tensor that is 0 at the positions not used."""
        return self.reduce_sum(x.sum(-1))

    def token_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row Σx and Σx² of a (B, T) tensor that is 0 at unused positions, in float64.

        Squares are taken in float64: a variance E[x²] − E[x]² from float32 squares carries an
        absolute error of ~1e-7·E[x²], i.e. a spurious std of ~3e-4 for weights near 1.
        """
        xd = x.to(torch.float64, copy=True)
        s = xd.sum(-1)
        return self.reduce_sum(s), self.reduce_sum(xd.mul_(xd).sum(-1))

    def above(self, x: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) float 0/1 indicator of x > threshold on the tokens used (x must be 0 elsewhere),
        as sign(max(x − c, 0)): exact, since a > c implies a − c > 0 in IEEE arithmetic, and several
        times faster on CPU than a bool comparison and reduction."""
        ind = (x - threshold).clamp_min_(0.0).sign_()
        return ind.mul_(self.mask) if threshold < 0 else ind

    def below(self, x: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) float 0/1 indicator of x < threshold on the tokens used (x must be 0 elsewhere)."""
        ind = (threshold - x).clamp_min_(0.0).sign_()
        return ind.mul_(self.mask) if threshold > 0 else ind

    def token_extremes(self, x: torch.Tensor, *, need_max: bool = True) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Per-row (max, min) of ``x`` over the tokens used (max None unless ``need_max``); −inf / +inf
        for a row with no token used (callers check the count)."""
        unused = self.mask == 0
        high = self.reduce_max(x.masked_fill(unused, -torch.inf).amax(-1)) if need_max and x.shape[-1] else None
        if need_max and high is None:  # no column: amax of nothing
            high = self.reduce_max(torch.full(x.shape[:-1], -torch.inf, device=x.device))
        if not x.shape[-1]:
            return high, self.reduce_min(torch.full(x.shape[:-1], torch.inf, device=x.device))
        return high, self.reduce_min(x.masked_fill(unused, torch.inf).amin(-1))

    def expand_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-row (B,) value over the row's tokens used, 0 elsewhere; (B, T)."""
        return x.to(torch.float32).unsqueeze(-1) * self.mask

    # -- segments (turns of a multi-turn row): per-(row, segment) values, (B, S) ---------
    def _segment_index(self) -> torch.Tensor:
        if self.segment_ids is not None:
            return self.segment_ids
        return torch.zeros(self.mask.shape, dtype=torch.int64, device=self.mask.device)

    def segment_total(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S) Σ over each segment's tokens of a (B, T) tensor that is 0 at unused positions:
        one scatter-add into (B, S) per rank, the group's sum when the rows are split (segment ids
        are global within a row, so the partial sums of a segment over the shards add up)."""
        part = segment_sums(x, self._segment_index(), self.num_segments)
        return self.reduce_sum(part.T).T  # (S, B): S per-row partials stacked

    def segment_max(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S) maximum over each segment's tokens of a (B, T) tensor that is ≥ 0 and 0 at
        unused positions (0 for a segment without a token)."""
        B = x.shape[0]
        part = torch.zeros((B, self.num_segments), dtype=x.dtype, device=x.device)
        part.scatter_reduce_(1, self._segment_index(), x, reduce="amax", include_self=True)
        return self.reduce_max(part.T).T

    def expand_segments(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-segment (B, S) value over each segment's tokens used, 0 elsewhere; (B, T)."""
        return x.to(torch.float32).gather(1, self._segment_index()) * self.mask

    def add_counts(self, stats: SufficientStats, families: frozenset = DEFAULT_FAMILIES) -> None:
        """The counts every statistic family divides by (recorded once per call): valid tokens used,
        rows with a token used, rows with a valid input token; with a ``log_prob_floor`` and the family
        ``sentinel``, the valid input tokens holding an engine sentinel and all valid input tokens."""
        stats.add(COUNTS.n_tok, self.sums.n)
        stats.add(COUNTS.n_rows, self.row_valid)
        stats.add(COUNTS.n_rows_input, self.input_rows)
        sentinel = self.sentinel_row if "sentinel" in families else None
        if sentinel is not None:
            stats.add(COUNTS.n_sentinel, sentinel)
            stats.add(COUNTS.n_tok_input, self.sums.n_input)


def log_ratio_batch(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                    on_nonfinite: str = "reject", rows: Optional["RowExchange"] = None,
                    row_offset: int = 0, segment_ids: Optional[torch.Tensor] = None,
                    max_segments: Optional[int] = None,
                    log_prob_floor: Optional[float] = LOG_PROB_FLOOR,
                    log_prob_ceiling: Optional[float] = 0.0) -> LogRatioBatch:
    """log ρ_t = log π_train(y_t) − log π_rollout(y_t) on the valid tokens, and the per-row sums.

    Args:
        old_log_prob: (B, T) π_train log-probs (π_old in decoupled mode, π_θ in bypass mode), any
            float dtype (computed in float32).
        rollout_log_prob: (B, T) π_rollout log-probs.
        response_mask: (B, T) bool or 0/1 mask of valid tokens (non-zero is valid).
        on_nonfinite: ``"reject"`` drops a row with a NaN/±inf at a valid position (counted in
            ``nonfinite_seq_fraction``); ``"raise"`` raises ValueError naming the first one.
        rows: a :class:`~rollout_correction_core._src.sequence_group.RowExchange` when every row is split
            across a group (context parallelism); None when the rows are whole.
        row_offset: index of this batch's first row in the caller's batch (for messages).
        segment_ids: optional (B, T) integer segment (turn) of each token: the tokens of a row with
            equal id form one segment; ids at valid positions in [0, S), S = ``max_segments`` (default
            T); ignored at masked positions. None: every row is one segment.
        log_prob_floor: a log-prob ≤ this at a valid position is an engine sentinel, handled as
            non-finite and counted (``sentinel_token_fraction``); None: no floor.
        log_prob_ceiling: a log-prob > this at a valid position is no probability, handled as
            non-finite; None: no check.
    """
    check_pair(old_log_prob, rollout_log_prob, response_mask)
    segments = check_segment_ids(segment_ids, response_mask, max_segments, row_offset)
    old_log_prob, rollout_log_prob = old_log_prob.detach(), rollout_log_prob.detach()  # statistics only
    slots, old32 = _slots(response_mask, 6), None
    if _FLOAT32_SUB.get((old_log_prob.dtype, rollout_log_prob.dtype)):  # (torch.result_type breaks a graph)
        lr = torch.sub(old_log_prob, rollout_log_prob, out=_slot(slots, 2))  # upcasts inside the subtraction
    elif slots is None:  # e.g. both bf16: a subtraction in bf16 would round
        lr = old_log_prob.to(torch.float32, copy=True).sub_(rollout_log_prob)
    else:  # log π_train in float32 once, in slot 3 (where its masked values go), and log ρ from it
        old32 = slots[3].copy_(old_log_prob)
        lr = torch.sub(old32, rollout_log_prob, out=slots[2])
    # the segments go in at construction: dataclasses.replace breaks torch.compile's graph on torch 2.4
    return _build(lr, response_mask, on_nonfinite, row_offset, old_log_prob, rollout_log_prob, rows, slots=slots,
                  floor=log_prob_floor, ceiling=log_prob_ceiling, segments=segments, old32=old32)


@packable("old_log_prob", "rollout_log_prob", "response_mask")
def log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
              segments: Optional[Segments] = None) -> torch.Tensor:
    """log ρ_t = old_log_prob − rollout_log_prob, (B, T) float32 clamped to ±20; 0 outside
    ``response_mask`` and in rows with a non-finite value at a valid position (module docstring).
    ``segments`` with ``cu_seqlens``: packed (1, N) / (N,) inputs and output, a sequence dropped whole."""
    return log_ratio_batch(old_log_prob, rollout_log_prob, response_mask).log_ratio_clamped


def segmented_batch(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    segments: Optional[Segments]) -> LogRatioBatch:
    """:func:`log_ratio_batch` with the turns of :class:`Segments` (None: each row one segment)."""
    if segments is None:
        return log_ratio_batch(old_log_prob, rollout_log_prob, response_mask)
    return log_ratio_batch(old_log_prob, rollout_log_prob, response_mask, segment_ids=segments.ids,
                           max_segments=segments.count)


def _host_value(x: torch.Tensor, read: Callable[[], Any]) -> Optional[Any]:
    """``read()`` where a read costs nothing (eager, ``x`` on the CPU), else None. The pass skips work
    whose result the value fixes; on a device and under torch.compile it does that work arithmetically."""
    return None if torch.compiler.is_compiling() or x.device.type != "cpu" else read()


def _usable(lr: torch.Tensor, old: Optional[torch.Tensor], rollout: Optional[torch.Tensor], floor: Optional[float],
            ceiling: Optional[float], finite: bool) -> Optional[torch.Tensor]:
    """(B, T) bool: the positions whose values a row may use: log-probs in (``floor``, ``ceiling``] (a
    None bound is not tested) and, unless ``finite`` says it holds already, |log ρ| < 1e30; None when
    nothing is to be tested. NaN fails every test (torch.maximum and torch.minimum propagate it)."""
    ok = None
    if ceiling is not None:
        ok = torch.maximum(old, rollout) <= ceiling
    if floor is not None:
        above = torch.minimum(old, rollout) > floor
        ok = above if ok is None else ok.logical_and_(above)
    if not finite:
        below = lr.abs() < NONFINITE_SENTINEL
        ok = below if ok is None else ok.logical_and_(below)
    return ok


def _build(lr: torch.Tensor, response_mask: torch.Tensor, on_nonfinite: str, row_offset: int,
           old: Optional[torch.Tensor] = None, rollout: Optional[torch.Tensor] = None,
           rows: Optional["RowExchange"] = None, source: Optional[torch.Tensor] = None,
           slots: Optional[torch.Tensor] = None, floor: Optional[float] = None,
           ceiling: Optional[float] = None, segments: Optional[tuple[torch.Tensor, int]] = None,
           old32: Optional[torch.Tensor] = None) -> LogRatioBatch:
    """The batch from a float32 log-ratio ``lr`` that this function may overwrite (``source``: the
    caller's log-ratio, for messages), held in slot 2 of ``slots`` (:func:`_slots`) when given:
    input mask, mask, log ρ, [masked log π_train,] k3, ρ, the order of :class:`RowSums`. ``segments``:
    (ids, count) from :func:`check_segment_ids`, None for one segment per row. ``old32``: slot 3
    holding ``old`` in float32 already."""
    B, T = response_mask.shape
    last = 0 if slots is None else slots.shape[0]  # k3 and ρ in the last two slots
    input_mask = float_mask(response_mask, out=_slot(slots, 0))
    floor, ceiling = (floor, ceiling) if old is not None else (None, None)
    # Where reading is free, one read: (min, max) of log ρ[, old, rollout], one pass each (a NaN makes
    # both NaN). All finite and in range: nothing is to be tested, no row is bad, log π_train is finite.
    e = _host_value(lr, lambda: torch.stack([m for x in (lr, old, rollout) if x is not None
                                             for m in torch.aminmax(x)]).tolist()) if lr.numel() else [0.0] * 6
    peak = None if e is None else max(-e[0], e[1])  # the largest |log ρ|
    # The tests whose result the host does not know already (a NaN fails every comparison). Two bounds
    # closer than 1e30 bound |log ρ| and exclude NaN and ±inf, so the log-ratio needs no test then.
    ok = None if T == 0 else _usable(
        lr, old, rollout, None if floor is None or (e is not None and all(v > floor for v in e[2::2])) else floor,
        None if ceiling is None or (e is not None and all(v <= ceiling for v in e[3::2])) else ceiling,
        bounds_log_probs(floor, ceiling) or (peak is not None and peak < NONFINITE_SENTINEL))
    clean = ok is None  # every value finite and in range
    # Split rows: what a dropped row keeps for the families read (later, its reductions are its own)
    keep = () if rows is None or old is None else rows.families
    split_sentinels = rows.sum(_sentinels(old, rollout, input_mask, floor)) if "sentinel" in keep and floor is not None else None
    split_gaps = rows.max(_gaps(old, rollout, input_mask)) if "expect_zero" in keep else None
    # a row with a valid position not usable is bad (amax: Inductor's CPU code for any() is slow)
    failed = None if clean else torch.lt(ok, input_mask)
    bad = torch.zeros(B, dtype=torch.bool, device=lr.device) if failed is None else failed.amax(-1)
    if rows is not None:  # split rows: the group decides; the caller raises for on_nonfinite="raise"
        bad = rows.max(bad)
    elif on_nonfinite == "raise" and bool(bad.any()):
        raise _nonfinite_error(failed, bad, row_offset, old, rollout, source)
    # Rows are dropped arithmetically whether or not any is bad (no data-dependent branch on a device).
    if clean and rows is None:  # nothing to drop: the mask used is the input mask (its row sums too, below)
        mask = input_mask
        lr = lr.mul_(input_mask)
        train = [] if old is None else [
            old32.mul_(mask) if old32 is not None else torch.mul(old, mask, out=_slot(slots, 3))]
    else:  # the values at the positions used, 0 elsewhere (whatever a dropped row or padding holds)
        used = input_mask > bad.unsqueeze(-1)
        if slots is None:
            mask = used.to(torch.float32)
            lr = torch.where(used, lr, 0.0)
            train = [] if old is None else [torch.where(used, old.to(torch.float32), 0.0)]
        else:  # where ``used`` is False the mask is 0: it is the other operand
            mask = torch.gt(input_mask, bad.unsqueeze(-1), out=slots[1])
            lr = torch.where(used, lr, mask, out=lr)
            # (a float64 log π_train, which out= does not take, is in float32 in slot 3 already)
            train = [] if old is None else [torch.where(used, old if old32 is None else old32, mask, out=slots[3])]
    # Clamped to ±20 (an alias of log ρ where the host knows that no |log ρ| exceeds 20)
    lrc = lr if peak is not None and peak <= SAFETY_BOUND else lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(lrc, out=_slot(slots, last - 1)).mul_(mask)
    k3 = torch.sub(ratio, mask, out=_slot(slots, last - 2)).sub_(lrc).clamp_min_(0.0)
    # One reduction for all rows' sums (each value summed on its own under torch.compile),
    # spanning the group when the rows are split. Σρ² is reduced on its own: ρ² is needed for
    # nothing else, and a slot of the buffer would hold it until the batch is freed.
    sum2 = (ratio * ratio).sum(-1, dtype=torch.float32)
    if slots is None:
        stacked = torch.stack([x.sum(-1, dtype=torch.float32) for x in (input_mask, mask, lr, *train, k3, ratio)])
    elif mask is input_mask:  # slot 1 was not written (never read): its sums are those of slot 0
        n = slots[0].sum(-1, dtype=torch.float32).unsqueeze(0)
        stacked = torch.cat((n, n, slots[2:].sum(-1, dtype=torch.float32)))
    else:
        stacked = slots.sum(-1, dtype=torch.float32)
    if rows is not None:  # the group's sums of a row some rank found bad are those of an empty row
        stacked, sum2 = rows.sum(stacked), rows.sum(sum2)
        stacked[1:].masked_fill_(bad, 0.0)
        sum2.masked_fill_(bad, 0.0)
        rows.drop(bad)
    parts, counted = stacked.unbind(), (stacked[:2] > 0).unbind()
    sums = RowSums(*parts[:3], parts[3] if old is not None else None, *parts[-2:], sum2)
    ids, S = segments if segments is not None else (None, 1)
    return LogRatioBatch(response_mask, input_mask, mask, lr, lrc, ratio, k3, bad, sums, counted[1], counted[0],
                         old, rollout, rows, segment_ids=ids, num_segments=S,
                         bounded=bounds_log_probs(floor, ceiling), log_prob_floor=floor,
                         split_sentinel_row=split_sentinels, split_gap_row=split_gaps)


def _sentinels(old: torch.Tensor, rollout: torch.Tensor, input_mask: torch.Tensor, floor: float) -> torch.Tensor:
    """(B,) float32 count per row of the valid positions holding a finite log-prob ≤ ``floor``."""
    low = torch.minimum(old.nan_to_num(math.inf, neginf=math.inf), rollout.nan_to_num(math.inf, neginf=math.inf))
    return torch.logical_and(low <= floor, input_mask).sum(-1, dtype=torch.float32)


def _gaps(old: torch.Tensor, rollout: torch.Tensor, input_mask: torch.Tensor) -> torch.Tensor:
    """(B,) float32 largest |old − rollout| per row over the valid positions, NaN and ±inf as 1e30."""
    gap = torch.sub(old.float(), rollout.float()).abs_()
    gap = gap.nan_to_num_(nan=NONFINITE_SENTINEL, posinf=NONFINITE_SENTINEL).mul_(input_mask)
    return gap.amax(-1) if gap.shape[-1] else gap.sum(-1)


def row_means64(sums: RowSums, bounded: bool = False) -> torch.Tensor:
    """(2, B) float64 mean log ρ and mean log π_train per row of ``sums`` (0 for empty rows), finite
    and within ±1e30. ``bounded``: the sums come from a batch whose log-probs are bounded
    (:func:`bounds_log_probs`), where every mean is within the bounds already."""
    if sums.train is None:
        raise ValueError("this LogRatioBatch was built from a log-ratio alone (LogRatioBatch.from_log_ratio); the perplexity "
                         "metrics need the log-probs: log_ratio_batch(old_log_prob, rollout_log_prob, response_mask)")
    # max(n, 1) in float64 (a (1,) float64 operand promotes), so the division is taken in float64
    n = torch.maximum(sums.n, device_constant((1.0,), sums.n.device))
    means64 = _stacked(sums.log_ratio, sums.train) / n
    if bounded:
        return means64
    return means64.nan_to_num_(nan=0.0).clamp_(-NONFINITE_SENTINEL, NONFINITE_SENTINEL)  # bounds the sum per token


def bounds_log_probs(floor: Optional[float], ceiling: Optional[float]) -> bool:
    """Whether a log-prob floor and ceiling leave every log-prob used finite and every |log ρ| < 1e30."""
    return floor is not None and ceiling is not None and ceiling - floor < NONFINITE_SENTINEL


def _stacked(*xs: torch.Tensor) -> torch.Tensor:
    """``torch.stack(xs)``, a view without a copy where the xs are consecutive rows of one (k, B)
    tensor (the row sums of one reduction, unbound)."""
    base, x0 = xs[0]._base, xs[0]
    step = None if torch.compiler.is_compiling() or base is None or base.dim() != 2 else base.stride(0)
    if step is None or any(x._base is not base or x.storage_offset() != x0.storage_offset() + i * step
                           for i, x in enumerate(xs)):
        return torch.stack(xs)
    return base.as_strided((len(xs), *x0.shape), (step, *x0.stride()), x0.storage_offset())


def nonfinite_positions(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                        response_mask: torch.Tensor, log_prob_floor: Optional[float] = LOG_PROB_FLOOR,
                        log_prob_ceiling: Optional[float] = 0.0) -> torch.Tensor:
    """(B, T) bool: valid positions whose log-ratio is NaN or has |log-ratio| ≥ 1e30, or holding a
    log-prob > ``log_prob_ceiling`` or ≤ ``log_prob_floor`` (the positions that drop a row, or raise with
    ``on_nonfinite="raise"``)."""
    lr = old_log_prob.float() - rollout_log_prob.float()  # the usability test of the pass, negated
    return (response_mask != 0) & ~_usable(lr, old_log_prob, rollout_log_prob, log_prob_floor, log_prob_ceiling, False)


def _nonfinite_error(failed: torch.Tensor, bad_rows: torch.Tensor, row_offset: int, old: Optional[torch.Tensor],
                     rollout: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> ValueError:
    """The error naming the first valid position that failed (``failed``, (B, T)) the tests of :func:`_usable`."""
    b = int(bad_rows.nonzero()[0, 0])
    t = int(failed[b].nonzero()[0, 0])
    if old is not None:
        values = f"old_log_prob={old[b, t].item()}, rollout_log_prob={rollout[b, t].item()}"
    else:
        values = f"log_ratio={source[b, t].item()}"
    return ValueError(f"non-finite log-prob at valid position (row {b + row_offset}, column {t}; "
                      f"|log-ratio| ≥ 1e30, a log-prob > log_prob_ceiling (0: no probability) and a log-prob ≤ "
                      f"log_prob_floor, an engine's sentinel, count as non-finite): {values}; "
                      "fix the producer, or set on_nonfinite='reject' to drop such sequences")
