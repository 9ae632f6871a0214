"""Off-policy diagnostics and the streaming accumulators.

Off-policy metrics (π_train = π_old in decoupled mode, π_θ in bypass mode; ρ_t = π_train/π_rollout;
sequence statistics over sequences with ≥ 1 valid token; exponents clamped to ±20 unless noted):

* ``training_log_ppl`` = mean_seq(−mean_t log π_train),  ``training_ppl`` = mean_seq exp(−mean_t log π_train)
* ``rollout_log_ppl``, ``rollout_ppl``: the same for π_rollout (PPL exponents clamped at 700 only)
* ``kl``      = mean_tok(log π_rollout − log π_train)           — k1 estimate of KL(π_rollout ‖ π_train)
* ``k3_kl``   = mean_tok(ρ_t − 1 − log ρ_t)                      — k3 estimate, ≥ 0
* ``log_ppl_diff`` = mean_seq(d), d = mean_t log π_rollout − mean_t log π_train;
  ``log_ppl_abs_diff`` = mean_seq |d|; ``log_ppl_diff_max`` / ``_min`` over sequences
* ``ppl_ratio`` = mean_seq exp(d)                               — training PPL / rollout PPL per sequence
* ``chi2_token`` = mean_tok(ρ_t²) − 1,  ``chi2_seq`` = mean_seq((∏_t ρ_t)²) − 1
* ``rollout_is_raw_mean`` = mean_tok ρ_t,  ``rollout_is_seq_raw_mean`` = mean_seq ∏_t ρ_t: before any
  truncation, masking or rejection
* ``chi2_token_sn`` = mean_tok(ρ²) / (mean_tok ρ)² − 1 and ``chi2_seq_sn``, the same of ∏_t ρ_t over
  sequences: the self-normalised χ², ≥ 0 (E[ρ²] − 1 is not, on a sample)

Mismatch metrics (with ``mismatch_metrics=True``: the numbers other engines log; Δ_t = log ρ_t unclamped, q_t = π_train(y_t),
p_t = π_rollout(y_t), the log-probs bounded to [−1e4, 0] first: a value above 0 is no probability
(taken as 1), one below −1e4 a probability of 0):

* ``prob_abs_diff_mean`` / ``_max`` / ``_std`` = mean / max / sample std (n − 1 denominator, as verl's
  ``rollout_probs_diff_std``; 0 below two tokens) over tokens of |q_t − p_t|
* ``prob_pearson``     = Pearson correlation of (q_t, p_t) over the valid tokens,
  cov / √(var_q · var_p) from global float64 sums of q, p, q², p², qp (0 when a variance is
  ≤ 1e-6·E[x²]: no spread to correlate)
* ``log_prob_pearson`` = the same for (log q_t, log p_t)
* ``js_divergence``    = mean_tok ½[(q/m − 1 − log(q/m)) + (p/m − 1 − log(p/m))], m = (q + p)/2: NeMo-RL's
  ``js_divergence_error`` (the k3 estimates of KL(π_train ‖ M) and KL(π_rollout ‖ M) at the sampled
  token, M the mixture), which equals log cosh(Δ_t / 2) and is computed that way
* ``log_prob_abs_diff_seq_mean`` = mean_seq(mean_t |Δ_t|) (slime's ``train_rollout_logprob_abs_diff``)
* ``log_prob_abs_diff_max`` = max_tok |Δ_t|;  ``log_prob_abs_diff_gt1`` / ``_gt2`` = share of tokens with
  |Δ_t| > 1 / > 2
* ``ratio_band_tight_fraction`` / ``_1pct_`` / ``_5pct_`` = share of tokens with ρ_t in [0.999, 1.002] /
  [0.99, 1.01] / [0.95, 1.05] (MaxText's bands), tested on the float32 log ρ_t against the bounds' logs
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Callable, Optional, Union, get_args

import torch

from .config import DEFAULT_FAMILIES, NonFinitePolicy, select_families
from .constants import LOG_PROB_FLOOR, METRIC_PREFIX, SAFETY_BOUND
from .declared import COUNTS, MISMATCH, OFFPOLICY, RATIO_BANDS, Stat
from .logratio import LogRatioBatch, RowSums, log_ratio_batch, nonfinite_positions, row_means64
from .packing import packable
from .parallel import Parallel, as_parallel, verified
from .segments import Segments
from .validation import check_pair
from .sequence_group import (RowExchange, check_sequence_group, describe, raise_nonfinite, raise_nonfinite_on_any_rank,
                             reduce_owned, stats_owner)
from .agreement import LayoutMismatchError
from .stats import HostStats, SufficientStats, Value, clamp, device_constant, safe_div, sqrt0, where

__all__ = ["compute_offpolicy_metrics", "add_offpolicy_statistics", "offpolicy_metrics", "mismatch_metrics",
           "ENGINE_METRIC_NAMES", "engine_metrics",
           "nonfinite_metrics", "Metrics", "metrics_to_floats", "prefixed", "Accumulator", "OffPolicyAccumulator"]

_PPL_EXP_MAX = 700.0  # exp(700) is finite in float64


def add_offpolicy_statistics(stats: SufficientStats, batch: LogRatioBatch, mismatch: bool = False, per_row=True,
                             families: frozenset = DEFAULT_FAMILIES) -> None:
    """Record the sufficient statistics of the off-policy metrics of ``families`` (the mismatch metrics
    also with ``mismatch``; without ``per_row``, all but those of :func:`add_row_statistics`, which a
    blocked pass records once, from its blocks' row sums)."""
    if per_row:
        add_row_statistics(stats, batch.sums, batch.row_valid, families, batch.bounded)
    if mismatch or "mismatch" in families:
        _add_mismatch_statistics(stats, batch)
    if "ratio_bands" in families:
        _add_ratio_band_statistics(stats, batch)


#: Per row, the bounds of each exponent's argument: −mean log π_train, −mean log π_rollout, d, Σ log ρ
#: (doubled after the clamp), Σ log ρ.
_EXP_BOUNDS = ((-math.inf, _PPL_EXP_MAX), (-math.inf, _PPL_EXP_MAX), (-SAFETY_BOUND, SAFETY_BOUND),
               (-SAFETY_BOUND, SAFETY_BOUND), (-SAFETY_BOUND, SAFETY_BOUND))


def add_row_statistics(stats: SufficientStats, sums: RowSums, rows: torch.Tensor,
                       families: frozenset = DEFAULT_FAMILIES, bounded: bool = False) -> None:
    """The off-policy statistics of ``families`` that are functions of the per-row ``sums``; ``rows``:
    rows with a token used. ``default``: the 13 off-policy metrics; ``raw``: the raw means Σρ and ∏ρ;
    ``chi2``: both (the self-normalised χ² divides the squares by the raw means). ``bounded``: the
    sums' batch had bounded log-probs (:func:`~.logratio.row_means64`)."""
    default, raw = "default" in families, bool({"raw", "chi2"} & families)
    squares = default or "chi2" in families
    if default:
        stats.add(OFFPOLICY.sum_lr, sums.log_ratio)
        stats.add(OFFPOLICY.sum_k3, sums.k3)  # Σ_t k3 and Σ_t ρ² per row, from the batch's one reduction
    if squares:
        stats.add(OFFPOLICY.sum_rho2, sums.ratio2)
    if raw:
        stats.add(OFFPOLICY.sum_rho, sums.ratio)
    if not (squares or raw):
        return
    # The per-row values are computed stacked, so each elementwise step is one operation.
    means = row_means64(sums, bounded)  # float64 (2, B): mean log ρ, mean log π_train
    neg = means.neg()  # d = mean log π_rollout − mean log π_train, −mean log π_train
    d, train_nll = neg[0], neg[1]
    rollout_nll = means[0] - means[1]
    sum_lr = sums.log_ratio  # float32, promoted exactly to float64 by the stack
    e = torch.stack([train_nll, rollout_nll, d, sum_lr, sum_lr][:4 + raw])
    bounds = device_constant(_EXP_BOUNDS[:4 + raw], e.device)
    e.clamp_(bounds[:, :1], bounds[:, 1:])
    e[3].mul_(2.0)
    e.exp_()  # training PPL, rollout PPL, ppl ratio, (∏ρ)², ∏ρ per row
    if default:
        stats.add(OFFPOLICY.train_log_ppl, train_nll, rows=rows)
        stats.add(OFFPOLICY.train_ppl, e[0], rows=rows)
        stats.add(OFFPOLICY.roll_log_ppl, rollout_nll, rows=rows)
        stats.add(OFFPOLICY.roll_ppl, e[1], rows=rows)
        stats.add(OFFPOLICY.d, d, rows=rows)
        stats.add(OFFPOLICY.abs_d, d.abs(), rows=rows)
        stats.add(OFFPOLICY.d_max, d, rows=rows)
        stats.add(OFFPOLICY.neg_d_max, means[0], rows=rows)  # −d: min d = −max(−d), no negation
        stats.add(OFFPOLICY.ppl_ratio, e[2], rows=rows)
    if squares:
        stats.add(OFFPOLICY.rho2_seq, e[3], rows=rows)
    if raw:
        stats.add(OFFPOLICY.rho_seq, e[4], rows=rows)


_LOGP_FLOOR = 1e4
def _add_mismatch_statistics(stats: SufficientStats, batch: LogRatioBatch) -> None:
    """Per-row float64 sums of the per-token moments behind the mismatch metrics, and the per-row
    maxima of |q − p| and |Δ|."""
    # a log-prob above 0 is no probability (taken as 1); below −1e4 its probability is 0 anyway
    lq, lp = (x.clamp_(-_LOGP_FLOOR, 0.0) for x in batch.log_probs())
    mask = batch.mask
    q, p = lq.exp().mul_(mask), lp.exp().mul_(mask)
    d = (q - p).abs_()
    a = batch.log_ratio.abs()  # |Δ|, 0 where unused
    # log cosh(Δ/2) = |Δ|/2 + log1p(exp(−|Δ|)) − log 2: finite for every finite Δ, 0 at Δ = 0
    js = torch.exp(-a).log1p_().add_(a, alpha=0.5).sub_(math.log(2.0)).clamp_min_(0.0)
    # Products in float64: a variance E[x²] − E[x]² from float32 squares carries ~1e-7·E[x²] of
    # absolute error (a std of 1e-4 for |q − p| ≡ 0.63; Pearson 0.99998 for log-probs 30 apart).
    q, p, lq, lp, d64 = (x.double() for x in (q, p, lq, lp, d))
    per_token = (q, p, q * q, p * p, q * p, lq, lp, lq * lq, lp * lp, lq * lp, d64, d64 * d64, js,
                 batch.above(a, 1.0), batch.above(a, 2.0))
    for stat, x in zip(MISMATCH, per_token):  # the family's first sums, in order
        stats.add(stat, batch.reduce_sum(x.sum(-1).double()))
    a_row = batch.row_total(a) / batch.n_row.clamp_min(1.0)
    stats.add(MISMATCH.a_seq, a_row, rows=batch.row_valid)
    for stat, x in ((MISMATCH.d_max, d), (MISMATCH.a_max, a)):  # ≥ 0 and 0 where unused (no column: 0)
        stats.add(stat, batch.reduce_max(x.amax(-1) if x.shape[-1] else x.sum(-1)), rows=batch.row_valid)


#: The ratio bands (lower, upper) of the ``ratio_band_*_fraction`` metrics, in RATIO_BANDS's order.
RATIO_BANDS_BOUNDS = ((0.999, 1.002), (0.99, 1.01), (0.95, 1.05))


def _add_ratio_band_statistics(stats: SufficientStats, batch: LogRatioBatch) -> None:
    """Per-row counts of the valid tokens with log(lo) ≤ log ρ_t ≤ log(hi), for each band."""
    for stat, (lo, hi) in zip(RATIO_BANDS, RATIO_BANDS_BOUNDS):
        outside = batch.above(batch.log_ratio, math.log(hi)).add_(batch.below(batch.log_ratio, math.log(lo)))
        stats.add(stat, batch.reduce_sum((batch.mask - outside).sum(-1).double()))


def ratio_band_metrics(stats) -> dict[str, Value]:
    """``ratio_band_{tight,1pct,5pct}_fraction``: the share of valid tokens in each band; 0 when empty."""
    n_tok = stats.sum(COUNTS.n_tok)
    return {f"ratio_band_{name}_fraction": safe_div(stats.sum(stat), n_tok)
            for name, stat in zip(("tight", "1pct", "5pct"), RATIO_BANDS)}


#: Other engines' names for the same quantities: engine -> {their name: our unprefixed name}. verl:
#: ``verl.utils.debug.metrics.calculate_debug_metrics``; slime: its policy loss; NeMo-RL: its
#: clipped policy-gradient loss (``gen_kl_error`` with its default ``reference_policy_kl_type`` k3).
ENGINE_METRIC_NAMES: dict[str, dict[str, str]] = {
    "verl": {"training/rollout_probs_diff_max": "prob_abs_diff_max",
             "training/rollout_probs_diff_mean": "prob_abs_diff_mean",
             "training/rollout_probs_diff_std": "prob_abs_diff_std",
             "training/rollout_actor_probs_pearson_corr": "prob_pearson"},
    "slime": {"train_rollout_logprob_abs_diff": "log_prob_abs_diff_seq_mean"},
    "nemo_rl": {"gen_kl_error": "k3_kl", "js_divergence_error": "js_divergence"},
}


def engine_metrics(metrics: Mapping[str, Value], engine: str) -> dict[str, Value]:
    """The mismatch metrics of ``metrics`` (``rollout_corr/<name>``, as every entry point returns
    them) under ``engine``'s own names (:data:`ENGINE_METRIC_NAMES`), for dashboards built on them."""
    if engine not in ENGINE_METRIC_NAMES:
        raise ValueError(f"engine={engine!r}: known engines are {sorted(ENGINE_METRIC_NAMES)}")
    return {theirs: metrics[METRIC_PREFIX + ours] for theirs, ours in ENGINE_METRIC_NAMES[engine].items()
            if METRIC_PREFIX + ours in metrics}


def _pearson(stats, moments: tuple, n: Value) -> Value:
    """Pearson correlation from global sums Σx, Σy, Σx², Σy², Σxy over n tokens; 0 when a variance
    is ≤ 1e-6·E[x²] (no spread to correlate)."""
    (x, y), (xx, yy), xy = moments
    mx, my = safe_div(stats.sum(x), n), safe_div(stats.sum(y), n)
    ex2, ey2 = safe_div(stats.sum(xx), n), safe_div(stats.sum(yy), n)
    vx, vy = ex2 - mx * mx, ey2 - my * my
    cov = safe_div(stats.sum(xy), n) - mx * my
    spread = (vx > 1e-6 * ex2) & (vy > 1e-6 * ey2) if isinstance(vx, torch.Tensor) else \
        vx > 1e-6 * ex2 and vy > 1e-6 * ey2
    return where(spread, clamp(safe_div(cov, sqrt0(vx * vy)), -1.0, 1.0), 0.0)


def mismatch_metrics(stats) -> dict[str, Value]:
    """The mismatch metrics (module docstring) from reduced statistics; 0 when empty."""
    n_tok, has = stats.sum(COUNTS.n_tok), stats.sum(COUNTS.n_rows) > 0
    sum_d = stats.sum(MISMATCH.d)
    mean_d = safe_div(sum_d, n_tok)
    return {
        "prob_abs_diff_mean": mean_d,
        "prob_abs_diff_max": where(has, stats.max(MISMATCH.d_max), 0.0),
        "prob_abs_diff_std": where(n_tok > 1, sqrt0(safe_div(stats.sum(MISMATCH.dd) - sum_d * mean_d, n_tok - 1.0)), 0.0),
        "prob_pearson": _pearson(stats, ((MISMATCH.q, MISMATCH.p), (MISMATCH.qq, MISMATCH.pp), MISMATCH.qp), n_tok),
        "log_prob_pearson": _pearson(stats, ((MISMATCH.lq, MISMATCH.lp), (MISMATCH.lqlq, MISMATCH.lplp), MISMATCH.lqlp), n_tok),
        "js_divergence": safe_div(stats.sum(MISMATCH.js), n_tok),
        "log_prob_abs_diff_seq_mean": safe_div(stats.sum(MISMATCH.a_seq), stats.sum(COUNTS.n_rows)),
        "log_prob_abs_diff_max": where(has, stats.max(MISMATCH.a_max), 0.0),
        "log_prob_abs_diff_gt1": safe_div(stats.sum(MISMATCH.gt1), n_tok),
        "log_prob_abs_diff_gt2": safe_div(stats.sum(MISMATCH.gt2), n_tok),
    }


def _chi2_sn(s1: Value, s2: Value, n: Value) -> Value:
    """n·Σx² / (Σx)² − 1, at least 0 (0 when Σx is 0)."""
    return clamp(safe_div(n * s2, s1 * s1) - 1.0, 0.0)


def offpolicy_metrics(stats, families: frozenset = DEFAULT_FAMILIES) -> dict[str, Value]:
    """The off-policy metrics of ``families`` (the 13 of ``default``, the raw means, the self-normalised
    χ²), and the 10 mismatch metrics when their statistics were recorded (module docstring), from
    reduced statistics of either kind; 0 when empty."""
    n_tok, n_rows = stats.sum(COUNTS.n_tok), stats.sum(COUNTS.n_rows)

    def seq_mean(k: Stat) -> Value:
        return safe_div(stats.sum(k), n_rows)

    has_rows = n_rows > 0
    m = {**(_default_offpolicy(stats, n_tok, n_rows, seq_mean, has_rows) if "default" in families else {})}
    if "raw" in families:
        m["rollout_is_raw_mean"] = safe_div(stats.sum(OFFPOLICY.sum_rho), n_tok)
        m["rollout_is_seq_raw_mean"] = seq_mean(OFFPOLICY.rho_seq)
    if "chi2" in families:
        m["chi2_token_sn"] = _chi2_sn(stats.sum(OFFPOLICY.sum_rho), stats.sum(OFFPOLICY.sum_rho2), n_tok)
        m["chi2_seq_sn"] = _chi2_sn(stats.sum(OFFPOLICY.rho_seq), stats.sum(OFFPOLICY.rho2_seq), n_rows)
    return {**m, **(mismatch_metrics(stats) if stats.has(MISMATCH.q) else {}),
            **(ratio_band_metrics(stats) if stats.has(RATIO_BANDS.tight) else {})}


def _default_offpolicy(stats, n_tok: Value, n_rows: Value, seq_mean: Callable, has_rows) -> dict[str, Value]:
    return {
        "training_ppl": seq_mean(OFFPOLICY.train_ppl),
        "training_log_ppl": seq_mean(OFFPOLICY.train_log_ppl),
        "kl": -safe_div(stats.sum(OFFPOLICY.sum_lr), n_tok),
        "k3_kl": safe_div(stats.sum(OFFPOLICY.sum_k3), n_tok),
        "rollout_ppl": seq_mean(OFFPOLICY.roll_ppl),
        "rollout_log_ppl": seq_mean(OFFPOLICY.roll_log_ppl),
        "log_ppl_diff": seq_mean(OFFPOLICY.d),
        "log_ppl_abs_diff": seq_mean(OFFPOLICY.abs_d),
        "log_ppl_diff_max": where(has_rows, stats.max(OFFPOLICY.d_max), 0.0),
        "log_ppl_diff_min": where(has_rows, -stats.max(OFFPOLICY.neg_d_max), 0.0),
        "ppl_ratio": seq_mean(OFFPOLICY.ppl_ratio),
        "chi2_token": where(n_tok > 0, safe_div(stats.sum(OFFPOLICY.sum_rho2), n_tok) - 1.0, 0.0),
        "chi2_seq": where(has_rows, seq_mean(OFFPOLICY.rho2_seq) - 1.0, 0.0),
    }


def nonfinite_metrics(stats) -> dict[str, Value]:
    """``nonfinite_seq_fraction``: share of the sequences with a valid input token (all used unless
    dropped, so the dropped are ``n_rows_input − n_rows``) dropped for a NaN/±inf log-prob or a
    sentinel; ``sentinel_token_fraction``: share of the valid input tokens holding a sentinel."""
    n_input = stats.sum(COUNTS.n_rows_input)
    m = {"nonfinite_seq_fraction": safe_div(n_input - stats.sum(COUNTS.n_rows), n_input)}
    if stats.has(COUNTS.n_sentinel):  # valid positions holding an engine sentinel (log-prob ≤ log_prob_floor)
        m["sentinel_token_fraction"] = safe_div(stats.sum(COUNTS.n_sentinel), stats.sum(COUNTS.n_tok_input))
    return m


def prefixed(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same metrics named ``rollout_corr/<name>``."""
    return {METRIC_PREFIX + k: v for k, v in metrics.items()}


class Metrics(MutableMapping):
    """Metrics derived on demand from reduced statistics: ``name`` → 0-d tensor.

    Holds the packed statistics and the functions that derive the metrics, so the call that returns
    it launches no kernel per metric and never syncs. Read as a mapping, it derives every value once
    as 0-d tensors on the statistics' device; :meth:`as_floats` copies the packed statistics to the
    host once (one sync) and derives there in float64. Values set with ``m[name] = value`` are kept.
    """

    def __init__(self) -> None:
        self._sources: list[tuple[SufficientStats, Callable, str]] = []
        self._extra: dict[str, Union[torch.Tensor, float]] = {}
        self._deleted: set[str] = set()
        self._tensors: Optional[dict[str, torch.Tensor]] = None
        self._keys: Optional[list[str]] = None

    @classmethod
    def derived(cls, stats: SufficientStats, derive: Callable, prefix: str = METRIC_PREFIX) -> "Metrics":
        """Metrics ``prefix + name`` → ``derive(stats)[name]``; ``derive`` must work on
        :class:`SufficientStats` and on :class:`HostStats` alike (see :mod:`rollout_correction_core._src.stats`)."""
        out = cls()
        out.add_derived(stats, derive, prefix)
        return out

    def add_derived(self, stats: SufficientStats, derive: Callable, prefix: str = METRIC_PREFIX) -> None:
        self._sources.append((stats, derive, prefix))
        self._tensors = self._keys = None

    def update(self, other=(), /, **kwargs) -> None:
        """Like dict.update; another :class:`Metrics` is added lazily (nothing is derived)."""
        if not isinstance(other, Metrics):
            return super().update(other, **kwargs)
        for stats, derive, prefix in other._sources:
            self.add_derived(stats, derive, prefix)
        super().update(other._extra)
        self._deleted |= other._deleted
        super().update(**kwargs)

    # -- mapping --------------------------------------------------------------------------
    def _derived_keys(self) -> list[str]:
        if self._keys is None:
            keys: list[str] = []
            for stats, derive, prefix in self._sources:  # names depend on the config only: derive on zeros
                names_s, names_m, _ = stats.packed_vector()
                zeros = HostStats(dict.fromkeys(names_s, 0.0), dict.fromkeys(names_m, 0.0))
                keys += [prefix + k for k in derive(zeros)]
            self._keys = keys
        return self._keys

    def __iter__(self):
        seen = set()
        for k in [*self._derived_keys(), *self._extra]:
            if k not in seen and k not in self._deleted:
                seen.add(k)
                yield k

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key) -> bool:
        return key not in self._deleted and (key in self._extra or key in self._derived_keys())

    def __getitem__(self, key: str):
        if key in self._deleted:
            raise KeyError(key)
        if key in self._extra:
            return self._extra[key]
        return self.tensors()[key]

    def __setitem__(self, key: str, value) -> None:
        self._extra[key] = value
        self._deleted.discard(key)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._extra.pop(key, None)
        self._deleted.add(key)

    def __repr__(self) -> str:
        return f"Metrics({dict(self)!r})"

    # -- values ---------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every derived metric as a 0-d tensor (derived once, on the statistics' device)."""
        if self._tensors is None:
            out: dict[str, torch.Tensor] = {}
            for stats, derive, prefix in self._sources:
                out.update((prefix + k, v) for k, v in derive(stats).items())
            self._tensors = out
        return self._tensors

    def as_floats(self) -> dict[str, float]:
        """Every metric as a Python float, with one device sync: the packed statistics (and
        any tensor values set directly) are copied to the host together and every metric is
        derived there in float64."""
        packed: list[torch.Tensor] = []
        layout = []
        for stats, derive, prefix in self._sources:
            names_s, names_m, vec = stats.packed_vector()
            layout.append((names_s, names_m, derive, prefix))
            if vec is not None:
                packed.append(vec)
        extra_t = [k for k, v in self._extra.items() if isinstance(v, torch.Tensor)]
        if extra_t:
            packed.append(torch.stack([self._extra[k].detach().reshape(()).to(torch.float64, copy=False)
                                       .to(packed[0].device if packed else self._extra[k].device) for k in extra_t]))
        verdicts = [s.verdict for s, _, _ in self._sources if s.verdict is not None]
        packed += [v.vec for v in verdicts]  # the ranks' agreement (:mod:`.agreement`), read with the statistics
        if len(packed) > 1:
            packed = [torch.cat([p.to(packed[0].device) for p in packed])]
        values = packed[0].tolist() if packed else []
        for v in reversed(verdicts):
            v.values = v.values or values[len(values) - v.vec.numel():]
            del values[len(values) - v.vec.numel():]
            if not v.read():
                raise LayoutMismatchError(v.message())
        values = iter(values)  # zip takes a name first: no value is skipped
        out: dict[str, float] = {}
        for names_s, names_m, derive, prefix in layout:
            host = HostStats(dict(zip(names_s, values)), dict(zip(names_m, values)))
            out.update((prefix + k, float(v)) for k, v in derive(host).items())
        out.update(zip(extra_t, values))
        out.update((k, float(v)) for k, v in self._extra.items() if not isinstance(v, torch.Tensor))
        return {k: out[k] for k in self}


def metrics_to_floats(metrics: Mapping[str, Union[torch.Tensor, float]]) -> dict[str, float]:
    """Metrics (0-d tensors, floats, or a :class:`Metrics`) as Python floats, with one device sync."""
    if not isinstance(metrics, Metrics):
        plain, metrics = metrics, Metrics()
        metrics.update(plain)  # values set directly: read as they are, in their order
    return metrics.as_floats()


@verified
@packable("old_log_prob", "rollout_log_prob", "response_mask")
def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                              response_mask: torch.Tensor, *, parallel: Optional[Parallel] = None,
                              on_nonfinite: str = "reject", mismatch_metrics: bool = False,
                              metrics: Sequence[str] = ("default",),
                              segments: Optional[Segments] = None) -> dict[str, torch.Tensor]:
    """Off-policy diagnostics of π_train vs π_rollout, keys ``rollout_corr/<name>``.

    Args:
        old_log_prob: (B, T) log-probs of the training-side policy.
        rollout_log_prob: (B, T) log-probs of the sampling policy.
        response_mask: (B, T) bool or 0/1, non-zero on valid tokens.
        parallel: :class:`~rollout_correction_core.Parallel`: reduce the statistics over ``dp_group``
            (metrics of the whole batch); every sequence is split across ``cp_group`` (context
            parallelism), as in :func:`rollout_correction_core.compute_rollout_correction`.
        mismatch_metrics: also the 10 mismatch metrics (|p_train − p_rollout|, Pearson, JS, |Δ log p|
            tails; module docstring), about 15 more per-token passes (the family ``mismatch``).
        metrics: the metric families, as the config's ``metrics`` key (``default``: the 13 off-policy
            metrics; ``raw``, ``chi2``, ``mismatch``, ``ratio_bands``, ``sentinel``; ``"all"``);
            ``nonfinite_seq_fraction`` is always there.
        segments: :class:`~rollout_correction_core.Segments` with ``cu_seqlens`` for packed (1, N) / (N,)
            inputs (the turns are not used here).
    Returns:
        dict of 0-d float64 tensors (formulas in the module docstring).
    """
    if on_nonfinite not in get_args(NonFinitePolicy):
        raise ValueError(f"compute_offpolicy_metrics: on_nonfinite={on_nonfinite!r} is invalid; allowed: "
                         f"{list(get_args(NonFinitePolicy))}")
    parallel = as_parallel(parallel)
    process_group, sequence_group = parallel.dp_group, parallel.cp_group
    if on_nonfinite == "raise" and (process_group is not None or sequence_group is not None):
        check_pair(old_log_prob, rollout_log_prob, response_mask)
        raise_nonfinite_on_any_rank(nonfinite_positions(old_log_prob, rollout_log_prob, response_mask), "log-prob",
                                    process_group, sequence_group)
    if sequence_group is not None:
        check_sequence_group(sequence_group)
        owner = stats_owner(sequence_group, process_group)
        rows = RowExchange(sequence_group, describe("compute_offpolicy_metrics", on_nonfinite=on_nonfinite,
                                                    mismatch_metrics=mismatch_metrics, metrics=metrics),
                           select_families(metrics))
        for _ in rows.passes():
            batch = log_ratio_batch(old_log_prob, rollout_log_prob, response_mask, on_nonfinite=on_nonfinite, rows=rows)
            acc = OffPolicyAccumulator(on_nonfinite=on_nonfinite, mismatch_metrics=mismatch_metrics, metrics=metrics)
            acc.update_batch(batch)
        if on_nonfinite == "raise":
            raise_nonfinite(batch.bad_rows)
        return prefixed(acc.finalize(reduce_owned(acc.stats, process_group, owner)))
    acc = OffPolicyAccumulator(on_nonfinite=on_nonfinite, mismatch_metrics=mismatch_metrics, metrics=metrics)
    acc.update(old_log_prob, rollout_log_prob, response_mask)
    return acc.compute(Parallel(dp_group=process_group))


class Accumulator:
    """Streaming version of a statistic family: ``update`` per chunk of whole rows, then ``compute``
    gives exactly what one call on the concatenated batch would give. A subclass defines
    ``record(stats, batch)`` (a chunk's statistics) and ``finalize(stats)`` (unprefixed metrics) of the
    metric ``families`` selected."""

    def __init__(self, on_nonfinite: str = "reject", log_prob_floor: Optional[float] = LOG_PROB_FLOOR,
                 families: frozenset = DEFAULT_FAMILIES, log_prob_ceiling: Optional[float] = 0.0) -> None:
        if on_nonfinite not in get_args(NonFinitePolicy):
            raise ValueError(f"{type(self).__name__}: on_nonfinite={on_nonfinite!r} is invalid; allowed: "
                             f"{list(get_args(NonFinitePolicy))}")
        self.stats = SufficientStats()
        self.on_nonfinite, self.log_prob_floor, self.families = on_nonfinite, log_prob_floor, families
        self.log_prob_ceiling = log_prob_ceiling

    def update(self, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
               response_mask: torch.Tensor) -> None:
        """Add a chunk of whole rows."""
        self.update_batch(log_ratio_batch(old_log_prob, rollout_log_prob, response_mask, on_nonfinite=self.on_nonfinite,
                                          log_prob_floor=self.log_prob_floor, log_prob_ceiling=self.log_prob_ceiling))

    def update_batch(self, batch: LogRatioBatch) -> None:
        """Add a chunk already wrapped in a :class:`LogRatioBatch` (several accumulators may share one)."""
        local = SufficientStats()
        batch.add_counts(local, self.families)
        self.record(local, batch)
        self.stats.merge(local)

    def record(self, stats: SufficientStats, batch: LogRatioBatch) -> None:
        """Record the family's statistics of one chunk into ``stats``."""
        raise NotImplementedError

    def compute(self, parallel: Optional[Parallel] = None) -> dict[str, torch.Tensor]:
        """Metrics of everything added so far, ``rollout_corr/<name>`` → 0-d tensor; reduced
        over ``parallel.dp_group`` when given (every rank then gets the whole batch's metrics)."""
        if not self.stats.sums:
            raise ValueError("no data: call update() with at least one batch before compute()")
        parallel = as_parallel(parallel)
        if parallel.cp_group is not None:
            raise ValueError("an accumulator adds chunks of whole rows: it takes no cp_group")
        stats = SufficientStats().merge(self.stats).all_reduce(parallel.dp_group, self.settings())
        return prefixed(self.finalize(stats))

    def finalize(self, stats: SufficientStats) -> dict[str, torch.Tensor]:
        """The family's metrics (unprefixed names) from reduced statistics."""
        raise NotImplementedError

    def settings(self) -> list[str]:
        """What the ranks of a reduction agree on besides the layout (:mod:`.agreement`): the accumulator."""
        return [type(self).__name__]


class OffPolicyAccumulator(Accumulator):
    """Streaming :func:`compute_offpolicy_metrics` (with the mismatch metrics if ``mismatch_metrics``; the
    families ``metrics``, as the config's key)."""

    def __init__(self, on_nonfinite: str = "reject", mismatch_metrics: bool = False,
                 log_prob_floor: Optional[float] = LOG_PROB_FLOOR, metrics: Sequence[str] = ("default",),
                 log_prob_ceiling: Optional[float] = 0.0) -> None:
        families = frozenset(select_families(metrics)) | ({"mismatch"} if mismatch_metrics else set())
        super().__init__(on_nonfinite, log_prob_floor, families, log_prob_ceiling)
        self.mismatch_metrics = mismatch_metrics

    def record(self, stats: SufficientStats, batch: LogRatioBatch) -> None:
        add_offpolicy_statistics(stats, batch, families=self.families)

    def finalize(self, stats: SufficientStats) -> dict[str, torch.Tensor]:
        return {**offpolicy_metrics(stats, self.families), **nonfinite_metrics(stats)}
