"""Importance-sampling weights and their statistics.

Levels (ρ_t = π_train(y_t) / π_rollout(y_t), all exponentials taken after clamping the log to ±20):

* token:      w_t = ρ_t
* sequence:   w   = ∏_t ρ_t          = exp(Σ_t log ρ_t)       (broadcast over the sequence)
* geometric:  w   = (∏_t ρ_t)^(1/T)  = exp(mean_t log ρ_t)    (broadcast over the sequence)
* segment:    w_s = ∏_{t∈s} ρ_t      = exp(Σ_{t∈s} log ρ_t)   (per segment s — a turn of a multi-turn
  row, the tokens with equal segment id — broadcast over the segment's tokens)
* segment_geometric:
              w_s = (∏_{t∈s} ρ_t)^(1/|s|) = exp(mean_{t∈s} log ρ_t)  (per segment, broadcast; ROLL's
  segment weight, roll/utils/train_infer_corrections.py)
* prefix_min: w_t = min_{s≤t} ρ_s    over the row's valid tokens up to t (MinPRO, Lei, Cheng & Tao
  2026, arXiv 2601.22718: the prefix ratio ∏_{s≤t} ρ_s replaced by its smallest factor); a
  per-token weight, bounded and reported as token weights; it needs whole sequences

Bounding modes (U = upper, L = lower):

* truncate (TIS, Ionides 2008; Yao et al. 2025):  w ← min(w, U)
* clip (slime):                                   w ← clamp(w, L, U)
* mask (IcePop):                                  w ← w · 1[L ≤ w ≤ U]   (response mask unchanged)

Optional batch normalisation, after bounding: w ← w / mean(w), the mean taken over valid tokens
(token level), over sequences with ≥ 1 valid token (sequence / geometric level) or over segments
with ≥ 1 valid token (segment levels), applied only
when the mean exceeds 1e-8. Weights are 0 at invalid positions and never carry gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, get_args

import torch

from .config import DEFAULT_FAMILIES, SEGMENT_IS_LEVELS, ConfigError, IsLevel, IsMode, ISSpec, RolloutCorrectionConfig
from .constants import SAFETY_BOUND
from .declared import COUNTS, IS
from .logratio import LogRatioBatch, segmented_batch
from .packing import packable
from .segments import Segments
from .stats import SufficientStats, Value, clamp, exp, safe_div, seq_summary, sqrt0, where
from .validation import arguments_of

__all__ = ["ISWeights", "is_weights", "importance_weights", "bound_weights", "add_is_statistics", "is_metrics",
           "batch_norm_factor"]


@dataclass
class ISWeights:
    """Weights before batch normalisation: ``weights`` (B, T) bounded, 0 at invalid positions; token
    level: ``raw`` (B, T) safety-bounded, before bounding; sequence / geometric level, per row (B,):
    ``row_log`` the unclamped log weight, ``row_raw`` / ``row_weight`` the safety-bounded / bounded;
    segment level: the same per (row, segment), flattened to (B·S,), in ``row_log`` / ``row_raw`` /
    ``unit_weight`` (``row_weight`` None: no weight is constant over a row), with ``unit_valid`` (B·S,)
    bool, the segment has a valid token, and ``unit_n`` (B·S,) its token count."""

    weights: torch.Tensor
    raw: Optional[torch.Tensor] = None
    row_log: Optional[torch.Tensor] = None
    row_raw: Optional[torch.Tensor] = None
    row_weight: Optional[torch.Tensor] = None
    unit_weight: Optional[torch.Tensor] = None
    unit_valid: Optional[torch.Tensor] = None
    unit_n: Optional[torch.Tensor] = None


def bound_weights(w: torch.Tensor, spec: ISSpec, mask: torch.Tensor) -> torch.Tensor:
    """The truncate / clip / mask bound of ``spec`` on weights ``w`` that are 0 where ``mask`` is 0."""
    if spec.mode == "truncate":
        return w.clamp(max=spec.upper)
    if spec.mode == "clip":
        return w.clamp(min=spec.lower, max=spec.upper).mul_(mask)
    return w * ((w >= spec.lower) & (w <= spec.upper))


def importance_weights(batch: LogRatioBatch, spec: ISSpec) -> ISWeights:
    """Bounded IS weights at ``spec.level`` (see module docstring), before batch normalisation."""
    if spec.level == "token":
        raw = batch.ratio
        return ISWeights(weights=bound_weights(raw, spec, batch.mask), raw=raw)
    if spec.level == "prefix_min":
        if batch.rows is not None:
            raise ValueError("rollout_is='prefix_min' needs whole sequences (the minimum over each token's prefix "
                             "spans the ranks before it); call it without sequence_group")
        x = batch.log_ratio_clamped.masked_fill(batch.mask == 0, math.inf)  # unused positions: no effect
        raw = torch.where(batch.mask > 0, x.cummin(-1).values.exp(), 0.0) if x.shape[-1] else batch.ratio
        return ISWeights(weights=bound_weights(raw, spec, batch.mask), raw=raw)
    if spec.level in SEGMENT_IS_LEVELS:
        seg_log = batch.segment_total(batch.log_ratio)  # (B, S) Σ_{t∈s} log ρ_t
        seg_n = batch.segment_total(batch.mask)
        if spec.level == "segment_geometric":  # mean_{t∈s} log ρ_t
            seg_log = seg_log / seg_n.clamp_min(1.0)
        seg_ok = (seg_n > 0).to(seg_log.dtype)
        seg_raw = seg_log.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * seg_ok
        seg_w = bound_weights(seg_raw, spec, seg_ok)
        return ISWeights(weights=batch.expand_segments(seg_w), row_log=seg_log.reshape(-1),
                         row_raw=seg_raw.reshape(-1), unit_weight=seg_w.reshape(-1),
                         unit_valid=seg_ok.reshape(-1) > 0, unit_n=seg_n.reshape(-1))
    row_log = batch.row_sum if spec.level == "sequence" else batch.row_mean()
    row_ok = batch.row_valid.to(row_log.dtype)
    row_raw = row_log.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp() * row_ok
    row_w = bound_weights(row_raw, spec, row_ok)
    return ISWeights(weights=batch.expand_rows(row_w), row_log=row_log, row_raw=row_raw, row_weight=row_w)


@packable("old_log_prob", "rollout_log_prob", "response_mask")
def is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
               level: IsLevel = "token", mode: IsMode = "truncate", upper: float = 2.0, lower: Optional[float] = None,
               segments: Optional[Segments] = None) -> torch.Tensor:
    """Bounded IS weights w (B, T) float32 of π_train (``old_log_prob``) to π_rollout at ``level``,
    bounded by ``mode`` within [``lower``, ``upper``] (module docstring), before batch normalisation;
    0 at invalid positions. ``segments``: the turns, for the segment levels; with ``cu_seqlens``, packed
    (1, N) / (N,) inputs and weights."""
    if level not in get_args(IsLevel):
        raise ConfigError(f"is_weights: level={level!r} is invalid: allowed values are {list(get_args(IsLevel))}")
    with arguments_of("is_weights", {"rollout_is": "level", "rollout_is_mode": "mode", "rollout_is_threshold": "upper",
                                     "rollout_is_threshold_lower": "lower"}):
        spec = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=upper, rollout_is_threshold_lower=lower,
                                       rollout_is_mode=mode).is_spec
    batch = segmented_batch(old_log_prob, rollout_log_prob, response_mask, segments)
    return importance_weights(batch, spec).weights


#: Levels whose weights vary token by token: their statistics are taken over tokens.
TOKEN_WEIGHT_LEVELS = ("token", "prefix_min")

#: A row weight below 0.1 (before truncation) counts as collapsed: the sequence barely enters the loss.
COLLAPSED_LOG_WEIGHT = math.log(0.1)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def add_is_statistics(stats: SufficientStats, batch: LogRatioBatch, spec: ISSpec, isw: ISWeights,
                      families: frozenset = DEFAULT_FAMILIES) -> None:
    """Record the sufficient statistics of the ``rollout_is_*`` metrics of ``families`` (``default``:
    verl's; ``detail``: the row weights before truncation), or without ``default`` the batch mean
    that batch normalisation divides by (:func:`batch_norm_factor`) alone."""
    U, L = spec.upper, spec.metric_lower
    if "default" not in families:
        if spec.level in TOKEN_WEIGHT_LEVELS:
            if spec.batch_normalize:
                stats.add(IS.sum_w, batch.token_moments(isw.weights)[0])
            return
        rw, rows = _units_weights(batch, spec, isw)
        if spec.level in SEGMENT_IS_LEVELS and (spec.batch_normalize or "detail" in families):
            stats.add(IS.units, rows)
        if spec.batch_normalize:
            stats.add(IS.seq_sum, rw, rows=rows)
        if "detail" in families:
            _add_detail(stats, isw, rows)
        return
    if spec.level in TOKEN_WEIGHT_LEVELS:
        w, raw = isw.weights, isw.raw
        sum_w, sum_w2 = batch.token_moments(w)
        stats.add(IS.sum_w, sum_w)
        stats.add(IS.sum_w2, sum_w2)
        # Outside the band [L, U]: s = sign(raw − clamp(raw, L, U)) on valid tokens is +1 above U
        # and −1 below L, so Σs = high − low and Σ|s| = high + low (exact integer counts).
        out = (raw - raw.clamp(L, U)).mul_(batch.mask).sign_()
        stats.add(IS.out_signed, batch.row_total(out))
        stats.add(IS.out, batch.row_total(out.abs_()))
        if w.shape[-1]:  # w ≥ 0 and 0 at padding, so the plain row maximum is the maximum over valid tokens
            high, low = batch.reduce_max(w.amax(-1)), batch.token_extremes(w, need_max=False)[1]
        else:
            high, low = batch.token_extremes(w)
        stats.add(IS.max, high)
        stats.add(IS.min, low)
        n = batch.n_row.clamp_min(1.0)
        seq_w = sum_w / n
        seq_raw = batch.sums.ratio / n  # raw is the batch's ratio: its row sums are the pass's
        rows = batch.row_valid
    else:
        rlog, rraw = isw.row_log, isw.row_raw
        rw, rows = _units_weights(batch, spec, isw)
        n = isw.unit_n if spec.level in SEGMENT_IS_LEVELS else batch.n_row
        if spec.level in SEGMENT_IS_LEVELS:  # one unit per segment: the "seq" statistics are per segment
            stats.add(IS.units, rows)
        rw64 = rw.double()
        stats.add(IS.sum_w, rw64, rows=rows, weight=n)
        stats.add(IS.sum_w2, rw64 * rw64, rows=rows, weight=n)
        stats.add(IS.high, rlog > _log(U), rows=rows)
        stats.add(IS.low, rlog < _log(L), rows=rows)
        stats.add(IS.max_log, rlog, rows=rows)
        stats.add(IS.min_log, rlog, rows=rows)
        seq_w, seq_raw = rw, rraw
        if "detail" in families:
            _add_detail(stats, isw, rows)
        if spec.mode == "mask":
            stats.add(IS.oob, (rraw < spec.lower) | (rraw > U), rows=rows, weight=n)
    seq_w64 = seq_w.double()
    stats.add(IS.seq_sum, seq_w, rows=rows)
    stats.add(IS.seq_sum2, seq_w64 * seq_w64, rows=rows)
    stats.add(IS.seq_max, seq_w, rows=rows)
    stats.add(IS.seq_min, seq_w, rows=rows)
    stats.add(IS.seq_high, seq_raw > U, rows=rows)
    stats.add(IS.seq_low, seq_raw < L, rows=rows)


def _units_weights(batch: LogRatioBatch, spec: ISSpec, isw: ISWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and segment levels: (the bounded weight, whether it is valid) of each unit."""
    if spec.level in SEGMENT_IS_LEVELS:
        return isw.unit_weight, isw.unit_valid
    return isw.row_weight, batch.row_valid


def _add_detail(stats: SufficientStats, isw: ISWeights, rows: torch.Tensor) -> None:
    """The family ``detail``: pre-truncation (length-aware) statistics of the row weights, one value per unit."""
    raw = isw.row_raw.double()
    stats.add(IS.raw_sum, raw, rows=rows)
    stats.add(IS.raw_sum2, raw * raw, rows=rows)
    stats.add(IS.log_sum, isw.row_log, rows=rows)
    stats.add(IS.collapsed, isw.row_log < COLLAPSED_LOG_WEIGHT, rows=rows)


def batch_norm_factor(stats, spec: ISSpec) -> Value:
    """Mean bounded weight (over tokens, valid sequences or valid segments); 1 when it is ≤ 1e-8."""
    if spec.level in TOKEN_WEIGHT_LEVELS:
        mean = safe_div(stats.sum(IS.sum_w), stats.sum(COUNTS.n_tok))
    else:
        mean = safe_div(stats.sum(IS.seq_sum), _units(stats, spec))
    return where(mean > 1e-8, mean, 1.0)


def _units(stats, spec: ISSpec) -> Value:
    """The count the per-unit statistics divide by: valid segments at segment level, else valid rows."""
    return stats.sum(IS.units) if spec.level in SEGMENT_IS_LEVELS else stats.sum(COUNTS.n_rows)


def is_metrics(stats, spec: ISSpec, families: frozenset = DEFAULT_FAMILIES) -> dict[str, Value]:
    """``rollout_is_*`` metrics of ``families`` from reduced statistics (values before batch normalisation).

    mean / std / ESS are token-weighted over valid tokens (every level): std = sqrt(E[w²] − E[w]²),
    ESS = min(1, 1 / E[(w / (E[w] + 1e-8))²]) = min(1, (E[w] + 1e-8)² / E[w²]) (0 when every weight
    is 0). max / min: over valid tokens, or (sequence / geometric) exp of the extreme log weight
    clamped to ±20.
    fraction_high / fraction_low: share of raw (safety-bounded, unbounded) weights above U / below L
    (tokens or sequences). seq_*: statistics of the per-row mean weight over sequences with ≥ 1 valid
    token; seq_fraction_* use the raw per-row mean. Sequence / geometric levels also report the row
    weights before truncation, where a long response drives log ∏ρ_t far from 0 even at a small
    per-token gap: seq_raw_ess = (Σw)² / (n·Σw²) (Kish), seq_log_mean (mean log weight,
    unclamped) and seq_collapsed_fraction (share of rows with raw weight < 0.1): the family ``detail``.
    At the segment levels every seq_* metric, max / min and fraction_high / low are taken over
    segments (turns) with ≥ 1 valid token instead of sequences.
    """
    m = _verl_is_metrics(stats, spec, _units(stats, spec)) if "default" in families else {}
    if "detail" in families and spec.level not in TOKEN_WEIGHT_LEVELS:
        n_rows, raw_sum, raw_sum2 = _units(stats, spec), stats.sum(IS.raw_sum), stats.sum(IS.raw_sum2)
        m["rollout_is_seq_raw_ess"] = clamp(safe_div(raw_sum * raw_sum, n_rows * raw_sum2), hi=1.0)
        m["rollout_is_seq_log_mean"] = safe_div(stats.sum(IS.log_sum), n_rows)
        m["rollout_is_seq_collapsed_fraction"] = safe_div(stats.sum(IS.collapsed), n_rows)
    return m


def _verl_is_metrics(stats, spec: ISSpec, n_rows: Value) -> dict[str, Value]:
    n_tok = stats.sum(COUNTS.n_tok)
    mean = safe_div(stats.sum(IS.sum_w), n_tok)
    ew2 = safe_div(stats.sum(IS.sum_w2), n_tok)
    std = where(n_tok > 1, sqrt0(ew2 - mean * mean), 0.0)
    ess = clamp(safe_div((mean + 1e-8) ** 2, ew2), hi=1.0)  # ≤ 1 (the 1e-8 and rounding would pass it)
    m: dict[str, Value] = {"rollout_is_mean": mean, "rollout_is_std": std, "rollout_is_eff_sample_size": ess}
    if spec.level in TOKEN_WEIGHT_LEVELS:
        m["rollout_is_max"] = where(n_tok > 0, stats.max(IS.max), 0.0)
        m["rollout_is_min"] = where(n_tok > 0, stats.min(IS.min), 0.0)
        den = n_tok
        out, signed = stats.sum(IS.out), stats.sum(IS.out_signed)
        high, low = (out + signed) * 0.5, (out - signed) * 0.5
    else:
        m["rollout_is_max"] = where(n_rows > 0, exp(clamp(stats.max(IS.max_log), -SAFETY_BOUND, SAFETY_BOUND)), 0.0)
        m["rollout_is_min"] = where(n_rows > 0, exp(clamp(stats.min(IS.min_log), -SAFETY_BOUND, SAFETY_BOUND)), 0.0)
        den = n_rows
        high, low = stats.sum(IS.high), stats.sum(IS.low)
    m["rollout_is_ratio_fraction_high"] = safe_div(high, den)
    m["rollout_is_ratio_fraction_low"] = safe_div(low, den)
    seq = seq_summary(stats, IS, n_rows, center=1.0)
    for k, v in seq.items():
        m[f"rollout_is_seq_{k}"] = v
    m["rollout_is_seq_fraction_high"] = safe_div(stats.sum(IS.seq_high), n_rows)
    m["rollout_is_seq_fraction_low"] = safe_div(stats.sum(IS.seq_low), n_rows)
    if spec.mode == "mask":
        # the band is [metric_lower, upper] in mask mode: at token level the tokens outside it
        out_of_bounds = stats.sum(IS.out if spec.level in TOKEN_WEIGHT_LEVELS else IS.oob)
        m["rollout_is_oob_ratio"] = safe_div(out_of_bounds, n_tok)
    if spec.batch_normalize:
        m["rollout_is_batch_norm_factor"] = batch_norm_factor(stats, spec)
    return m
