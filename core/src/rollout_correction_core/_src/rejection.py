"""Rejection sampling: divergence-based trust-region masks and the catastrophic-token veto.

Per-token estimators of KL(π_rollout ‖ π_train) from log ρ_t (clamped to ±20):
k1 = −log ρ_t,  k2 = ½ (log ρ_t)²,  k3 = ρ_t − 1 − log ρ_t (≥ 0).

Per-token divergences in probability space, between the sampled token's probabilities
q = π_train(y_t) and p = π_rollout(y_t), both clamped to [1e-6, 1 − 1e-6] (OpenRLHF 0.11.2's clamp,
which keeps the logarithms finite); no function of ρ = q/p alone can express them:
tv = |p − q|,  binary_kl = KL(p‖q) = p log(p/q) + (1 − p) log((1 − p)/(1 − q))  — the KL between the
Bernoulli distributions "the sampled token / any other token" under π_rollout and π_train (≥ 0);
kpop = max(KL(p‖q), KL(q‖p)), its symmetric form (KPop). And NeMo-RL's multiplicative probability
error, logprob_error = exp(|log ρ_t|) ≥ 1 (log ρ_t clamped to ±20), meant to be averaged.

Signed probability difference (ROLL's ``diff`` filters, roll/utils/train_infer_corrections.py):
dp = Δp_t = π_train(y_t) − π_rollout(y_t) = exp(log π_train) − exp(log π_rollout), unclamped, in [−1, 1];
a ``*_dp`` option keeps a token / sequence / segment iff lo ≤ statistic ≤ hi (its sum or mean).

Aggregations over a sequence's valid tokens: ``token`` (each token on its own), ``seq_sum``,
``seq_mean``, ``seq_max``; and the same over each segment s (a turn of a multi-turn row: the tokens
with equal segment id), ``segment_sum`` Σ_{t∈s}, ``segment_mean`` (1/|s|) Σ_{t∈s}, ``segment_max``
max_{t∈s} — a rejected segment drops its own tokens only. A token / sequence / segment is kept iff
its statistic lies in the option's bounds; chained options must all accept (logical AND). k1 bounds
are ratio bounds lo ≤ ρ_agg ≤ hi, where ρ_agg = exp(−k1_agg) — e.g. ``seq_mean_k1`` with
"0.999_1.001" keeps sequences whose geometric-mean ratio lies within ±0.1% of 1. Veto
(``rollout_token_veto_threshold`` C): reject a sequence if any valid token has unclamped ρ_t < C; its
high side (``rollout_token_veto_threshold_high`` C'):
reject a sequence if any valid token has unclamped ρ_t > C'. Rejection changes the response mask only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .config import RS_OPTIONS, RolloutCorrectionConfig, RSOption
from .declared import COUNTS, RS, VETO, VETO_HIGH, Family
from .logratio import LogRatioBatch, segmented_batch
from .packing import packable
from .segments import Segments
from .stats import SufficientStats, Value, safe_div, seq_summary, sqrt0, where
from .validation import arguments_of

__all__ = ["token_divergence", "PROB_CLAMP", "RejectionResult", "option_keep", "rejection_keep", "rejection_mask", "rs_option_metrics",
           "rs_metrics", "veto_metrics"]


#: Probabilities enter the probability-space divergences clamped to [PROB_CLAMP, 1 − PROB_CLAMP].
PROB_CLAMP = 1e-6

#: The statistics of each rejection option (``rollout_rs_<name>_*``), declared at import, their slots
#: after :data:`RS`'s, by option name.
_OPTION_STATS = {name: Family(f"rs.{name}.", "units sum c_sum c_sum2 high low masked seq_masked seq_sum seq_sum2 "
                              "seq_high seq_low", "max seq_max", "min seq_min", rank=RS.rank + (name,))
                 for name in sorted(RS_OPTIONS)}


def rs_option(name: str) -> Family:
    """The statistics of the rejection option ``name``."""
    return _OPTION_STATS[name]


#: The largest log-prob whose probability the dp estimator takes as it is (exp(88) < float32's max).
_EXP_ARG_MAX = 88.0


def token_divergence(batch: LogRatioBatch, estimator: str) -> torch.Tensor:
    """Per-token k1 / k2 / k3 / tv / binary_kl / kpop / logprob_error / dp (see module docstring); 0 at
    invalid positions. Shape (B, T)."""
    x = batch.log_ratio_clamped
    if estimator == "k1":
        return -x
    if estimator == "dp":
        train, rollout = batch.log_probs()  # 0 at invalid positions: exp(0) − exp(0) = 0 there
        # without a log_prob_ceiling a log-prob may exceed 88, whose exp overflows float32 (inf − inf is NaN)
        return train.clamp_(max=_EXP_ARG_MAX).exp_().sub_(rollout.clamp_(max=_EXP_ARG_MAX).exp_())
    if estimator in ("tv", "binary_kl", "kpop"):
        train, rollout = batch.log_probs()
        q = train.exp().clamp_(PROB_CLAMP, 1 - PROB_CLAMP)
        p = rollout.exp().clamp_(PROB_CLAMP, 1 - PROB_CLAMP)
        if estimator == "tv":
            d = (p - q).abs_()
        elif estimator == "binary_kl":
            d = _bernoulli_kl(p, q)
        else:
            d = torch.maximum(_bernoulli_kl(p, q), _bernoulli_kl(q, p))
        return torch.where(batch.valid, d, 0.0)
    if estimator == "logprob_error":
        return x.abs().exp_().mul_(batch.mask)
    return 0.5 * x * x if estimator == "k2" else batch.k3  # the estimator of a validated RSOption


def _bernoulli_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) ‖ Bernoulli(q)), written as OpenRLHF 0.11.2 writes it, so that the float32
    values agree bit for bit."""
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


@dataclass
class RejectionResult:
    """``token_keep`` (B, T) float 0/1, ``row_keep`` (B,) bool and ``segment_keep`` (B, S) bool, the
    AND of the criteria of each level (veto included); each None when no criterion of its level ran
    (:meth:`rows` gives a tensor anyway). Segment decisions stay per segment: with split rows a
    segment's decision is a reduced value, which no per-rank partial may depend on."""

    token_keep: Optional[torch.Tensor]
    row_keep: Optional[torch.Tensor]
    segment_keep: Optional[torch.Tensor] = None

    def rows(self, batch: LogRatioBatch) -> torch.Tensor:
        """(B,) bool ``row_keep`` (all True when no sequence-level criterion ran)."""
        if self.row_keep is not None:
            return self.row_keep
        return torch.ones(batch.n_row.shape, dtype=torch.bool, device=batch.n_row.device)

    def kept_total(self, batch: LogRatioBatch, x: torch.Tensor) -> torch.Tensor:
        """(B,) Σ of a (B, T) tensor over the tokens the token- and segment-level criteria accept
        (``x`` must be 0 where the token-level criteria or the mask reject): per segment, then
        times the segment's decision, so that the partials depend on this rank's tokens only."""
        if self.segment_keep is None:
            return batch.row_total(x)
        return (batch.segment_total(x) * self.segment_keep.to(x.dtype)).sum(-1)

    def kept_per_row(self, batch: LogRatioBatch) -> torch.Tensor:
        """(B,) float32 count of valid tokens accepted by every criterion."""
        if self.token_keep is None and self.segment_keep is None:
            kept = batch.n_row
        else:
            kept = self.kept_total(batch, batch.mask if self.token_keep is None else self.token_keep * batch.mask)
        return kept * self.row_keep if self.row_keep is not None else kept

    def keep_mask(self, batch: LogRatioBatch) -> torch.Tensor:
        """(B, T) float32 0/1: valid and accepted by every criterion."""
        if self.row_keep is None:
            keep = batch.mask if self.token_keep is None else batch.mask * self.token_keep
        else:
            keep = batch.mask * self.row_keep.to(torch.float32).unsqueeze(-1)
            keep = keep.mul_(self.token_keep) if self.token_keep is not None else keep
        return keep if self.segment_keep is None else keep * batch.expand_segments(self.segment_keep)


def _segment_stat(batch: LogRatioBatch, per_token: torch.Tensor, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) statistic of each segment and (B, S) its valid-token count."""
    n = batch.segment_total(batch.mask)
    if agg == "segment_max":  # k2/k3/tv/binary_kl/kpop ≥ 0, 0 at padding
        return batch.segment_max(per_token), n
    total = batch.segment_total(per_token)
    return (total if agg == "segment_sum" else total / n.clamp_min(1.0)), n


def _row_stat(batch: LogRatioBatch, per_token: torch.Tensor, agg: str) -> torch.Tensor:
    if agg == "seq_sum":
        return batch.row_total(per_token)
    if agg == "seq_mean":
        return batch.row_total(per_token) / batch.n_row.clamp_min(1.0)
    # seq_max (k2/k3/tv/binary_kl/kpop ≥ 0, 0 at padding): max over valid tokens; 0 for empty rows
    return batch.reduce_max(per_token.amax(-1) if per_token.shape[-1] else per_token.sum(-1))


def _within(x: torch.Tensor, opt: RSOption) -> torch.Tensor:
    keep = x <= opt.stat_upper
    return keep & (x >= opt.stat_lower) if opt.stat_lower is not None else keep


def option_keep(batch: LogRatioBatch, opt: RSOption, statistic: torch.Tensor,
                stats: Optional[SufficientStats] = None) -> torch.Tensor:
    """Keep indicator of one option for its statistic: (B, T) float 0/1 for token options (statistic
    (B, T), 0 at invalid positions), (B,) bool for sequence options; recorded into ``stats`` if given."""
    if opt.agg != "token":
        keep = _within(statistic, opt)
        if stats is not None:
            _add_row_option_stats(stats, batch, opt, statistic, keep)
        return keep
    high = batch.above(statistic, opt.stat_upper)
    low = batch.below(statistic, opt.stat_lower) if opt.stat_lower is not None else None
    keep = 1.0 - high if low is None else (1.0 - high).sub_(low)
    if stats is not None:
        _add_token_option_stats(stats, batch, opt, statistic, high, low)
    return keep


def rejection_keep(batch: LogRatioBatch, options: tuple[RSOption, ...], veto_threshold: Optional[float],
                   stats: Optional[SufficientStats] = None, veto_high: Optional[float] = None) -> RejectionResult:
    """Keep masks for the chained ``options`` and the veto (low side ``veto_threshold``, high side
    ``veto_high``); records statistics when given ``stats``."""
    row_keep: Optional[torch.Tensor] = None  # None: no sequence-level criterion so far
    token_keep: Optional[torch.Tensor] = None
    segment_keep: Optional[torch.Tensor] = None
    cache: dict[str, torch.Tensor] = {}

    def divergence(estimator: str) -> torch.Tensor:
        per_token = cache.get(estimator)
        if per_token is None:
            per_token = cache[estimator] = token_divergence(batch, estimator)
        return per_token

    for opt in options:
        if opt.agg == "token":
            keep = option_keep(batch, opt, divergence(opt.estimator), stats)
            token_keep = keep if token_keep is None else token_keep.mul_(keep)
        elif opt.agg.startswith("segment_"):
            seg, n = _segment_stat(batch, divergence(opt.estimator), opt.agg)
            seg_keep = _within(seg, opt)
            if stats is not None:
                units = (n > 0).reshape(-1)
                stats.add(rs_option(opt.name).units, units)
                _add_row_option_stats(stats, batch, opt, seg.reshape(-1), seg_keep.reshape(-1), units, n.reshape(-1))
            segment_keep = seg_keep if segment_keep is None else segment_keep & seg_keep
        else:
            keep = option_keep(batch, opt, _row_stat(batch, divergence(opt.estimator), opt.agg), stats)
            row_keep = keep if row_keep is None else row_keep & keep
    if stats is not None and options:  # valid tokens rejected by the chained options, per row
        rejected = batch.n_row - RejectionResult(token_keep, row_keep, segment_keep).kept_per_row(batch)
        stats.add(RS.masked, rejected)
        stats.add(RS.seq_masked, rejected > 0, rows=batch.row_valid)
    for fam, bound, side in ((VETO, veto_threshold, batch.below), (VETO_HIGH, veto_high, batch.above)):
        if bound is None:
            continue
        catastrophic = batch.row_total(side(batch.log_ratio, math.log(bound)))
        vetoed = catastrophic > 0
        row_keep = ~vetoed if row_keep is None else row_keep & ~vetoed
        if stats is not None:
            stats.add(fam.tok, catastrophic)
            stats.add(fam.rows, vetoed, rows=batch.row_valid)
    return RejectionResult(token_keep, row_keep, segment_keep)


@packable("old_log_prob", "rollout_log_prob", "response_mask")
def rejection_mask(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                   criterion: str, threshold: Union[float, str], segments: Optional[Segments] = None) -> torch.Tensor:
    """(B, T) float32 0/1: the valid tokens that ``criterion`` (a ``rollout_rs`` option such as
    ``"seq_mean_k3"``, or several joined by commas) keeps at ``threshold`` (its upper bound, or a
    ``"lo_hi"`` band; module docstring) for π_train (``old_log_prob``) vs π_rollout. ``segments``: the
    turns, for the ``segment_*`` options; with ``cu_seqlens``, packed (1, N) / (N,) inputs and mask."""
    if not isinstance(criterion, str):
        raise TypeError(f"rejection_mask: criterion={criterion!r} is invalid; allowed: a criterion such as "
                        f"'seq_mean_k3', or several joined by commas, of {sorted(RS_OPTIONS)}")
    with arguments_of("rejection_mask", {"rollout_rs": "criterion", "rollout_rs_threshold": "threshold"}):
        options = RolloutCorrectionConfig(rollout_rs=criterion, rollout_rs_threshold=threshold).rs_options
    batch = segmented_batch(old_log_prob, rollout_log_prob, response_mask, segments)
    return rejection_keep(batch, options, None).keep_mask(batch)


def _std_clamp(opt: RSOption, x: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to the bounds the option's std metric uses (lower 0 without a lower bound)."""
    return x.clamp(min=opt.stat_lower if opt.stat_lower is not None else 0.0, max=opt.stat_upper)


def _add_token_option_stats(stats: SufficientStats, batch: LogRatioBatch, opt: RSOption, x: torch.Tensor,
                            high: torch.Tensor, low: Optional[torch.Tensor]) -> None:
    """Record a token option's per-row statistics: Σx, Σc and Σc² of x clamped to the bounds
    (float64), max / min of x over valid tokens, and the counts above (``high``) / below (``low``)."""
    p = rs_option(opt.name)
    c_sum, c_sum2 = batch.token_moments(_std_clamp(opt, x).mul_(batch.mask))
    x_sum = batch.row_total(x)
    x_max, x_min = batch.token_extremes(x)
    n_high, n_low = batch.row_total(high), batch.row_total(low) if low is not None else None
    stats.add(p.sum, x_sum)
    stats.add(p.c_sum, c_sum)
    stats.add(p.c_sum2, c_sum2)
    stats.add(p.max, x_max)
    stats.add(p.min, x_min)
    stats.add(p.high, n_high)
    rejected = n_high
    if n_low is not None:
        stats.add(p.low, n_low)
        rejected = n_high + n_low  # disjoint: a token cannot be both above and below
    seq = x_sum / batch.n_row.clamp_min(1.0)
    _add_seq_values(stats, batch, opt, seq)
    stats.add(p.masked, rejected)
    stats.add(p.seq_masked, rejected > 0, rows=batch.row_valid)


def _add_row_option_stats(stats: SufficientStats, batch: LogRatioBatch, opt: RSOption,
                          s: torch.Tensor, keep: torch.Tensor, rows: Optional[torch.Tensor] = None,
                          n: Optional[torch.Tensor] = None) -> None:
    """Per-unit statistics of a sequence option (units: the rows), or of a segment option (units:
    the (row, segment) pairs, ``rows`` (B·S,) bool valid and ``n`` (B·S,) token counts)."""
    p = rs_option(opt.name)
    c = _std_clamp(opt, s).double()
    if rows is None:
        rows, n = batch.row_valid, batch.n_row
    rejected = ~keep
    stats.add(p.sum, s, rows=rows, weight=n)
    stats.add(p.c_sum, c, rows=rows, weight=n)
    stats.add(p.c_sum2, c * c, rows=rows, weight=n)
    stats.add(p.masked, rejected, rows=rows, weight=n)
    stats.add(p.high, s > opt.stat_upper, rows=rows)
    if opt.stat_lower is not None:
        stats.add(p.low, s < opt.stat_lower, rows=rows)
    _add_seq_values(stats, batch, opt, s, rows)
    stats.add(p.seq_masked, rejected, rows=rows)


def _add_seq_values(stats: SufficientStats, batch: LogRatioBatch, opt: RSOption, seq: torch.Tensor,
                    rows: Optional[torch.Tensor] = None) -> None:
    p = rs_option(opt.name)
    rows = batch.row_valid if rows is None else rows
    seq64 = seq.double()
    stats.add(p.seq_sum, seq, rows=rows)
    stats.add(p.seq_sum2, seq64 * seq64, rows=rows)
    stats.add(p.seq_max, seq, rows=rows)
    stats.add(p.seq_min, seq, rows=rows)
    stats.add(p.seq_high, seq > opt.stat_upper, rows=rows)
    if opt.stat_lower is not None:
        stats.add(p.seq_low, seq < opt.stat_lower, rows=rows)


def rs_option_metrics(stats, opt: RSOption) -> dict[str, Value]:
    """``rollout_rs_<option>_*`` metrics of one option from reduced statistics (recorded by
    :func:`option_keep` with ``stats``, plus the counts of ``LogRatioBatch.add_counts``).

    With s the option's statistic (per token, or per sequence broadcast over its tokens): mean =
    token mean of s; max/min and fraction_high/low (above / below the statistic bounds) over tokens
    or sequences, as the option decides; std = token-weighted std of s clamped to the bounds; seq_* =
    statistics of the per-sequence value (the sequence mean of s for token options), seq_max_deviation
    = max |value|; masked_fraction = share of valid tokens this option rejects; seq_masked_fraction =
    share of sequences with at least one token it rejects. For a segment option every per-sequence
    quantity is per segment (turn) with ≥ 1 valid token instead: seq_* and max/min describe the
    segment statistic, seq_masked_fraction is the share of segments it rejects.
    """
    p, out = rs_option(opt.name), f"rollout_rs_{opt.name}_"
    n_tok = stats.sum(COUNTS.n_tok)
    n_rows = stats.sum(p.units) if opt.agg.startswith("segment_") else stats.sum(COUNTS.n_rows)
    m: dict[str, Value] = {}
    seq = seq_summary(stats, p, n_rows, center=0.0)
    m[out + "mean"] = safe_div(stats.sum(p.sum), n_tok)
    if opt.agg == "token":
        m[out + "max"] = where(n_tok > 0, stats.max(p.max), 0.0)
        m[out + "min"] = where(n_tok > 0, stats.min(p.min), 0.0)
        den = n_tok
    else:
        m[out + "max"], m[out + "min"] = seq["max"], seq["min"]
        den = n_rows
    m[out + "fraction_high"] = safe_div(stats.sum(p.high), den)
    m[out + "fraction_low"] = safe_div(stats.sum(p.low), den) if opt.stat_lower is not None else 0.0 * den
    cm = safe_div(stats.sum(p.c_sum), n_tok)
    m[out + "std"] = where(n_tok > 1, sqrt0(safe_div(stats.sum(p.c_sum2), n_tok) - cm * cm), 0.0)
    for k, v in seq.items():
        m[out + "seq_" + k] = v
    m[out + "seq_fraction_high"] = safe_div(stats.sum(p.seq_high), n_rows)
    if opt.stat_lower is not None:
        m[out + "seq_fraction_low"] = safe_div(stats.sum(p.seq_low), n_rows)
    m[out + "masked_fraction"] = safe_div(stats.sum(p.masked), n_tok)
    m[out + "seq_masked_fraction"] = safe_div(stats.sum(p.seq_masked), n_rows)
    return m


def rs_metrics(stats, options: tuple[RSOption, ...]) -> dict[str, Value]:
    """Every option's metrics (:func:`rs_option_metrics`) and the chain's ``rollout_rs_masked_fraction``
    (share of valid tokens rejected by any option) and ``rollout_rs_seq_masked_fraction`` (share of
    sequences with at least one rejected token), from statistics recorded by :func:`rejection_keep`."""
    if not options:
        return {}
    n_tok, n_rows = stats.sum(COUNTS.n_tok), stats.sum(COUNTS.n_rows)
    m: dict[str, Value] = {}
    for opt in options:
        m.update(rs_option_metrics(stats, opt))
    m["rollout_rs_masked_fraction"] = safe_div(stats.sum(RS.masked), n_tok)
    m["rollout_rs_seq_masked_fraction"] = safe_div(stats.sum(RS.seq_masked), n_rows)
    if options[0].legacy is not None:  # first-generation names for the same quantities
        m["rollout_is_masked_fraction"] = m["rollout_rs_masked_fraction"]
        m["rollout_is_seq_masked_fraction"] = m["rollout_rs_seq_masked_fraction"]
    return m


def veto_metrics(stats, low: bool = True, high: bool = False) -> dict[str, Value]:
    """``rollout_is_veto_fraction`` (share of sequences vetoed) and
    ``rollout_is_catastrophic_token_fraction`` (share of valid tokens with ρ_t < C) for the low side;
    ``rollout_is_veto_high_fraction`` and ``rollout_is_catastrophic_high_token_fraction`` (ρ_t > C')
    for the high side."""
    m: dict[str, Value] = {}
    for side, fam, infix in ((low, VETO, ""), (high, VETO_HIGH, "_high")):
        if side:
            m[f"rollout_is_veto{infix}_fraction"] = safe_div(stats.sum(fam.rows), stats.sum(COUNTS.n_rows))
            m[f"rollout_is_catastrophic{infix}_token_fraction"] = safe_div(stats.sum(fam.tok),
                                                                           stats.sum(COUNTS.n_tok))
    return m
