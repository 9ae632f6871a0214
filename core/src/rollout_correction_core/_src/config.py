"""``RolloutCorrectionConfig``: verl's keys (both generations), slime's IS modes and the methods
beyond them, validated at construction and resolved once into the specs the computation reads
(:class:`ISSpec`, a tuple of :class:`RSOption`). Each key is documented once, in its field's
metadata, which docs/config.md renders.
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args

from .constants import LOG_PROB_FLOOR
from .config_io import Loading, settings_dict
from .presets import Presets
from .vocab import (LEGACY_RS, Band, ConfigError, MissingSettingError, as_float, invalid, read_threshold,
                    threshold_parts)

__all__ = ["RolloutCorrectionConfig", "ConfigError", "MissingSettingError", "ISSpec", "RSOption", "RS_OPTIONS",
           "METRIC_FAMILIES", "DEFAULT_FAMILIES", "select_families", "as_config", "IsLevel", "IsMode", "LossType",
           "NonFinitePolicy", "RsAggregation", "DivergenceEstimator",
           "LossDenominator", "WarnOrRaise"]

IsLevel = Literal["token", "sequence", "geometric", "segment", "segment_geometric", "prefix_min"]
IsMode = Literal["truncate", "clip", "mask"]
LossType = Literal["ppo_clip", "reinforce", "gspo", "cispo", "dppo_tv", "dppo_kl", "topr", "rollout_is", "ratio_pg"]
NonFinitePolicy = Literal["reject", "raise"]
RsAggregation = Literal["token", "seq_sum", "seq_mean", "seq_max", "segment_sum", "segment_mean", "segment_max"]
DivergenceEstimator = Literal["k1", "k2", "k3", "tv", "binary_kl"]
#: IS levels whose unit is a segment (turn) of a row: the product, or the geometric mean, of its ratios.
SEGMENT_IS_LEVELS = ("segment", "segment_geometric")
LossDenominator = Literal["kept", "valid"]
WarnOrRaise = Literal["warn", "raise"]

_IS_LEVELS, _IS_MODES = get_args(IsLevel), get_args(IsMode)
#: The mean per-token log-ratio :meth:`RolloutCorrectionConfig.length_limits` assumes: common between engines.
DRIFT = 0.005
#: Losses defined on the ratio π_θ/π_rollout only (no π_old): they need ``bypass_mode=True``.
_BYPASS_ONLY_LOSSES = ("reinforce", "topr", "rollout_is")

#: Divergence-based rejection options: name -> (aggregation, estimator), ``token_k1`` … ``seq_max_k3``
#: (no ``seq_max_k1``: the largest −log ρ of a sequence is not a ratio band), the
#: probability-space ``token_tv`` … ``seq_max_binary_kl`` (per token, sequence mean, sequence max),
#: and the same aggregations per segment (turn), ``segment_sum_k1`` … ``segment_max_binary_kl``.
RS_OPTIONS: dict[str, tuple[RsAggregation, str]] = {
    f"{agg}_{est}": (agg, est) for agg in get_args(RsAggregation) for est in get_args(DivergenceEstimator)
    if not (agg.endswith("_max") and est == "k1") and not (est in ("tv", "binary_kl") and agg.endswith("_sum"))}

#: Signed probability-difference bands (ROLL's ``diff_low`` / ``diff_high``): Δp_t = π_train(y_t) −
#: π_rollout(y_t) per token, and its sum / mean over a sequence or a segment, kept iff lo ≤ · ≤ hi.
#: Options ``token_dp``, ``seq_sum_dp``, ``seq_mean_dp``, ``segment_sum_dp``, ``segment_mean_dp``.
SIGNED_ESTIMATORS = ("dp",)
RS_OPTIONS.update({f"{agg}_dp": (agg, "dp") for agg in ("token", "seq_sum", "seq_mean", "segment_sum", "segment_mean")})
#: Estimators beyond the table above, one upper bound each: ``kpop``, the symmetric binary KL
#: max(KL(p‖q), KL(q‖p)) of the sampled token (KPop; AReaL's ``metric="binary_kl"``, prime-rl's
#: ``kpop`` loss), per token, sequence (sum, mean, max) and segment (mean, max); ``logprob_error``,
#: exp(|log ρ_t|) averaged per sequence / segment (NeMo-RL's ``seq_logprob_error_threshold``).
ExtraEstimator = Literal["kpop", "logprob_error"]
RS_OPTIONS.update({f"{agg}_kpop": (agg, "kpop")
                   for agg in ("token", "seq_sum", "seq_mean", "seq_max", "segment_mean", "segment_max")})
RS_OPTIONS.update(seq_logprob_error=("seq_mean", "logprob_error"),
                  segment_logprob_error=("segment_mean", "logprob_error"))


#: The metric families (the config's ``metrics`` key): name → what it adds. Statistics a decision
#: needs are recorded whatever is selected: the counts (and ``nonfinite_seq_fraction``), the
#: batch-normalisation mean, the rows every rejection criterion rejects, expect-zero's maximum.
METRIC_FAMILIES: dict[str, str] = {
    "default": "verl 0.9.1's metrics, and the veto and outcome fractions the monitor reads",
    "raw": "rollout_is_raw_mean, rollout_is_seq_raw_mean: ρ before truncation, masking and rejection",
    "chi2": "chi2_token_sn, chi2_seq_sn: the self-normalised χ²",
    "mismatch": "the mismatch metrics other engines log (also mismatch_metrics: true)",
    "ratio_bands": "ratio_band_tight/1pct/5pct_fraction: the shares of tokens with ρ in [0.999, 1.002], ±1 %, ±5 %",
    "sentinel": "sentinel_token_fraction: the valid tokens holding an engine sentinel",
    "expect_zero": "max_abs_log_ratio, the largest gap old − rollout (always with expect_zero_atol)",
    "detail": "rollout_is_seq_raw_ess, _seq_log_mean, _seq_collapsed_fraction (sequence and segment levels)",
}
DEFAULT_FAMILIES = frozenset({"default"})


def select_families(value: Any) -> tuple[str, ...]:
    """The family names of the ``metrics`` key: a list (or tuple) of names, or one string of names
    separated by commas; ``all`` stands for every family. A ConfigError names an unknown one."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
        raise invalid("metrics", value, f"expected a list of family names among {['all', *METRIC_FAMILIES]}")
    names = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    known = ["all", *METRIC_FAMILIES]
    for n in names:
        if n not in known:
            hint = difflib.get_close_matches(n, known, n=1)
            raise invalid("metrics", value, f"unknown family {n!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                          + f"; known families: {known}")
    return tuple(METRIC_FAMILIES) if "all" in names else names


@dataclass(frozen=True)
class ISSpec:
    """Resolved importance-sampling settings: ``mode`` as in :mod:`rollout_correction_core._src.weights`;
    ``metric_lower``, the bound of the ``*_fraction_low`` metrics: ``lower``, or 1/upper without one."""

    level: IsLevel
    mode: IsMode
    upper: float
    lower: Optional[float]
    metric_lower: float
    batch_normalize: bool


@dataclass(frozen=True)
class RSOption:
    """One rejection criterion: a token or sequence is kept iff its statistic lies in
    ``[stat_lower, stat_upper]``. For k1 the ratio bounds lo ≤ ρ ≤ hi become −log hi ≤ k1 ≤ −log lo;
    for k2/k3 ``stat_lower`` is None. ``legacy``: the first-generation mode configured, if any."""

    name: str
    agg: RsAggregation
    estimator: Union[DivergenceEstimator, ExtraEstimator, Literal["dp"]]
    stat_lower: Optional[float]
    stat_upper: float
    legacy: Optional[str] = None


def _key(default: Any, values: str, doc: str, note: str = "") -> Any:
    """A config key: its default, the values it takes and what it does (``note`` qualifies the default)."""
    return field(default=default, metadata={"values": values, "doc": doc, "note": note})


@dataclass(frozen=True)
class RolloutCorrectionConfig(Presets, Loading):
    """Settings of rollout correction; validated at construction. Each field's metadata says what
    it takes and does; docs/config.md lists them with the presets. A band arrives as ``"lo_hi"`` or
    ``(lo, hi)`` and is held as a ``Band``; a rejection threshold given per option, as a tuple."""

    rollout_is: Optional[IsLevel] = _key(
        None, "null, token, sequence, geometric, segment, segment_geometric, prefix_min", "IS weight level: ρ_t "
        "per token; ∏ρ_t per sequence; exp(mean log ρ_t) per sequence; ∏ρ_t per segment (turn) of a row, from "
        "the segment_ids argument (a row without segment ids is one segment); segment_geometric: exp(mean log "
        "ρ_t) per segment (ROLL's segment weight); prefix_min: min_{s≤t} ρ_s per token (MinPRO, whole sequences "
        "only). null computes no weights (metrics only).")
    rollout_is_threshold: Optional[Union[float, str, Band]] = _key(
        2.0, "number C, or string \"lo_hi\"", "C truncates weights above C (TIS); \"lo_hi\" is IcePop: weights "
        "outside [lo, hi] become 0, the response mask is unchanged.")
    rollout_is_threshold_lower: Optional[float] = _key(
        None, "number ≥ 0 or null", "lower bound for rollout_is_mode clip / mask with a numeric threshold.", "1/upper")
    rollout_is_mode: Optional[IsMode] = _key(
        None, "null, truncate, clip, mask", "how the bound applies: truncate min(w, U); clip clamp(w, L, U); mask "
        "w·1[L≤w≤U]. Inferred from the threshold when null.", "inferred")
    rollout_is_batch_normalize: bool = _key(
        False, "true, false", "divide weights by their batch mean after bounding (tokens for token level, "
        "sequences for sequence / geometric level, segments for segment level).")
    rollout_rs: Optional[str] = _key(
        None, "null or comma-chained options", "rejection criteria, all must accept: token_k1/k2/k3, "
        "seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3; in probability space token_tv, seq_mean_tv, "
        "seq_max_tv, token_binary_kl, seq_mean_binary_kl, seq_max_binary_kl; per segment (turn, from the "
        "segment_ids argument) segment_sum_k1/k2/k3, segment_mean_k1/k2/k3, segment_max_k2/k3, segment_mean_tv, "
        "segment_max_tv, segment_mean_binary_kl, segment_max_binary_kl; KPop's symmetric binary KL token_kpop, "
        "seq_sum_kpop, seq_mean_kpop, seq_max_kpop, segment_mean_kpop, segment_max_kpop; NeMo-RL's mean "
        "exp(|log ρ_t|) seq_logprob_error, segment_logprob_error; signed Δp = p_train − p_rollout bands "
        "token_dp, seq_sum_dp, seq_mean_dp, segment_sum_dp, segment_mean_dp; or one of the first-generation "
        "modes token, sequence, geometric.")
    rollout_rs_threshold: Optional[Union[float, str, Band, tuple[Union[float, Band], ...]]] = _key(
        None, "number or string, one per option or shared", "k1: ratio bounds \"lo_hi\" (a single x means "
        "[1/x, x]) on ρ_agg = exp(−k1_agg); k2/k3, tv, binary_kl, kpop, logprob_error (≥ 1): one upper bound. "
        "First-generation modes: the upper ratio bound (defaults to rollout_is_threshold). *_dp: the band "
        "\"lo_hi\" on Δp (bounds in [−1, 1], e.g. \"-0.2_0.2\"; a single x means [−x, x]).")
    rollout_rs_threshold_lower: Optional[float] = _key(
        None, "number ≥ 0 or null", "first-generation modes: lower ratio bound.", "1/upper")
    rollout_token_veto_threshold: Optional[float] = _key(
        None, "positive number or null", "reject a sequence if any valid token has unclamped ρ_t < C.")
    rollout_token_veto_threshold_high: Optional[float] = _key(
        None, "positive number or null", "reject a sequence if any valid token has unclamped ρ_t > C (the "
        "high side of the veto; SkyRL's outlier_token_is_threshold_high).")
    bypass_mode: bool = _key(
        False, "true, false", "π_old := π_rollout (two policies); the loss clips against the rollout policy.")
    loss_type: LossType = _key(
        "ppo_clip", ", ".join(get_args(LossType)), "policy loss: PPO clip; REINFORCE −sg(w)·A·log π_θ (bypass "
        "only: pure IS); GSPO (PPO clip on exp(mean log r)); CISPO −sg(clip r)·A·log π_θ; DPPO-TV / DPPO-KL "
        "(truncated-ratio REINFORCE masked outside a probability-difference / binary-KL trust region); TOPR "
        "(bypass only: weight 1 for A ≥ 0, min(∏r, 1) for A < 0); rollout_is (bypass only: −sg(r·1[1−ε_lo < r < "
        "1+ε_hi])·A·log π_θ, SkyRL's / GLM-5's); ratio_pg −A·r with r unclipped and carrying the gradient "
        "(prime-rl's policy term). In decoupled mode the IS weights multiply the loss; in bypass "
        "mode r = π_θ/π_rollout. See policy_losses.py.")
    rollout_opsm_delta: Optional[float] = _key(
        None, "number or null", "off-policy sequence masking (DeepSeek-V3.2): drop a sequence with advantage < 0 "
        "whose mean log(π_rollout/π_θ) over its finite valid tokens exceeds δ. Applied in compute_policy_loss "
        "(it needs advantages).")
    rollout_m2po_threshold: Optional[float] = _key(
        None, "number ≥ 0 or null", "M2PO (AReaL m2_threshold): mask the tokens with the largest (log ρ_t)² "
        "until the batch mean of (log ρ_t)² over the kept tokens is ≤ τ; batch-global over the process group.")
    loss_denominator: Optional[LossDenominator] = _key(
        None, "null, kept, valid", "what the loss denominators count (token-mean's token count, the "
        "seq-mean modes' sequence count and per-sequence token counts): kept, the tokens and sequences "
        "every criterion accepted (rejected units leave the denominators); valid, every valid token of the "
        "response mask as given (rejected units stay counted with a zero loss, as OpenRLHF, slime, NeMo-RL "
        "and AReaL reduce). Every loss and aggregation mode honours it; null is the entry point's default.",
        "kept; the slime adapter: valid")
    on_nonfinite: NonFinitePolicy = _key(
        "reject", "reject, raise", "NaN/±inf log-probs at valid positions: drop the sequence and count it, or raise.")
    log_prob_floor: Optional[float] = _key(
        LOG_PROB_FLOOR, "number < 0 or null", "a log-prob (old or rollout) at or below it at a valid position is an "
        "engine's sentinel (vLLM's −9999), not a log-prob: handled as non-finite under on_nonfinite and counted "
        "in sentinel_token_fraction. null: no floor.")
    log_prob_ceiling: Optional[float] = _key(
        0.0, "number ≥ 0 or null", "a log-prob (old, rollout, or π_θ in the loss) above it at a valid position is no "
        "probability: handled as non-finite under on_nonfinite (the row is dropped and counted in "
        "nonfinite_seq_fraction, or the call raises). null: no check (the drop-ins of rollout_correction.compat, "
        "as their engines do not check).")
    rollout_rs_all_rejected: WarnOrRaise = _key(
        "warn", "warn, raise", "when rejection drops every sequence of the batch: warn (when the metrics are read "
        "as floats; no extra host read) or raise ValueError (one host read per call).")
    expect_zero_atol: Optional[float] = _key(
        None, "number ≥ 0 or null", "expect-zero mode, for engines meant to agree exactly: no correction (weights "
        "1, mask unchanged), max |old − rollout| over valid tokens reported as max_abs_log_ratio and checked "
        "against this tolerance; above it MismatchError names the first row and column (one host read per call).")
    expect_zero_action: WarnOrRaise = _key(
        "raise", "raise, warn", "what expect-zero mode does above its tolerance: raise MismatchError, or warn "
        "(MismatchWarning).")
    check_alignment: bool = _key(
        False, "true, false", "also test whether the rollout log-probs look shifted by one token against the "
        "trainer's (alignment_* metrics, a MisalignmentWarning when they do; one extra sync).")
    mismatch_metrics: bool = _key(
        False, "true, false", "also compute the mismatch metrics other engines log: |p_train − p_rollout| "
        "mean/max/std, the Pearson correlation of probabilities and of log-probs, a JS estimate, slime's "
        "mean |Δ log p|, max |Δ log p| and the share of tokens with |Δ log p| > 1, > 2 (about 15 more "
        "per-token passes; no sync): the same as selecting the metric family mismatch.")
    metrics: Union[str, tuple[str, ...]] = _key(
        ("default",), "a list of metric families, or all", "the metric families a call computes: default (verl "
        "0.9.1's metrics and the health metrics the monitor reads), raw, chi2, mismatch, ratio_bands, sentinel, "
        "expect_zero, detail (docs/guide.md, 'Metric families'). A family not selected costs no kernel; "
        "statistics a decision needs (batch normalisation, the all-rejected check, expect-zero) are computed "
        "anyway.")
    expected_response_length: Optional[int] = _key(
        None, "positive integer or null", "typical response length in tokens: at construction, a UserWarning for "
        "each sequence-level (∏ρ_t) bound or rejection threshold that a mean per-token log-ratio of ±0.005 "
        "crosses at this length, naming the length from which it does (length_limits).")

    # Resolved settings, derived in __post_init__.
    is_spec: Optional[ISSpec] = field(init=False, repr=False, compare=False, default=None)
    rs_options: tuple[RSOption, ...] = field(init=False, repr=False, compare=False, default=())
    #: The selected families (``metrics``; mismatch with ``mismatch_metrics``, expect_zero with its mode).
    families: frozenset = field(init=False, repr=False, compare=False, default=DEFAULT_FAMILIES)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for key in ("rollout_is_batch_normalize", "bypass_mode", "check_alignment", "mismatch_metrics"):
            if not isinstance(getattr(self, key), bool):
                raise invalid(key, getattr(self, key), "expected true or false")
        for key, allowed in (("loss_type", get_args(LossType)), ("on_nonfinite", get_args(NonFinitePolicy)),
                             ("loss_denominator", (None,) + get_args(LossDenominator)),
                             ("rollout_rs_all_rejected", get_args(WarnOrRaise)),
                             ("expect_zero_action", get_args(WarnOrRaise))):
            if getattr(self, key) not in allowed:
                raise invalid(key, getattr(self, key), f"allowed values are {list(allowed)}")
        if self.loss_type in _BYPASS_ONLY_LOSSES and not self.bypass_mode:
            raise invalid("loss_type", self.loss_type, "it is a bypass-mode loss (ratio π_θ/π_rollout, no π_old); "
                          "set bypass_mode=True, or use ppo_clip / gspo / cispo / dppo_tv / dppo_kl in decoupled mode")
        for key, value in (("rollout_is_batch_normalize", self.rollout_is_batch_normalize or None),
                           ("rollout_is_threshold_lower", self.rollout_is_threshold_lower)):
            if value is not None and self.rollout_is is None:
                raise invalid(key, getattr(self, key), "it bounds or normalises IS weights and rollout_is is null; "
                              "set rollout_is (e.g. 'token'), or drop it")
        floor = self.log_prob_floor
        if floor is not None and not as_float("log_prob_floor", floor) < 0:
            raise invalid("log_prob_floor", floor, "expected a number < 0 (a log-prob at or below it is a "
                          "sentinel), e.g. -1000, or null to disable")
        ceiling = self.log_prob_ceiling
        if ceiling is not None and not 0 <= as_float("log_prob_ceiling", ceiling) < math.inf:
            raise invalid("log_prob_ceiling", ceiling, "expected a finite number ≥ 0 (a log-prob above it is no "
                          "probability), e.g. 0, or null to disable")
        delta, tau = self.rollout_opsm_delta, self.rollout_m2po_threshold
        if delta is not None and not math.isfinite(as_float("rollout_opsm_delta", delta)):
            raise invalid("rollout_opsm_delta", delta, "expected a finite number, e.g. 0.05")
        if tau is not None and not 0 <= as_float("rollout_m2po_threshold", tau) < math.inf:
            raise invalid("rollout_m2po_threshold", tau, "expected a finite number ≥ 0, e.g. 0.04")
        is_threshold, is_spec = self._resolve_is()
        rs_threshold, rs_options = self._resolve_rs()
        veto = self.rollout_token_veto_threshold
        if veto is not None and not as_float("rollout_token_veto_threshold", veto) > 0:
            raise invalid("rollout_token_veto_threshold", veto, "must be a positive ratio, e.g. 1e-4")
        high = self.rollout_token_veto_threshold_high
        if high is not None and not 0 < as_float("rollout_token_veto_threshold_high", high) < math.inf:
            raise invalid("rollout_token_veto_threshold_high", high, "must be a positive finite ratio, e.g. 100")
        if high is not None and veto is not None and not float(veto) < float(high):
            raise invalid("rollout_token_veto_threshold_high", high,
                          f"must exceed rollout_token_veto_threshold={veto}")
        atol = self.expect_zero_atol
        if atol is not None and not 0 <= as_float("expect_zero_atol", atol) < math.inf:
            raise invalid("expect_zero_atol", atol, "expected a finite tolerance ≥ 0, e.g. 1e-6, or null")
        on = [k for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold", "rollout_token_veto_threshold_high",
                          "rollout_m2po_threshold", "rollout_opsm_delta") if getattr(self, k) is not None]
        if atol is not None and on:
            raise invalid("expect_zero_atol", atol, f"expect-zero mode applies no correction; unset {', '.join(on)}")
        metrics = select_families(self.metrics)
        families = frozenset(metrics) | ({"mismatch"} if self.mismatch_metrics else set()) | (
            {"expect_zero"} if atol is not None else set())
        for name, value in (("rollout_is_threshold", is_threshold), ("rollout_rs_threshold", rs_threshold),
                            ("is_spec", is_spec), ("rs_options", rs_options), ("metrics", metrics),
                            ("families", families)):
            object.__setattr__(self, name, value)
        length = self.expected_response_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise invalid("expected_response_length", length, "expected a positive integer (tokens), or null")
        for what, limit, verb in self.length_limits() if length is not None else ():
            if limit <= length:
                warnings.warn(f"{what} is crossed by a mean per-token log-ratio of ±{DRIFT} from {limit} tokens on: "
                              f"at expected_response_length={length} it {verb} (TRL #7120: 0.005 × 300 tokens gives "
                              "∏ρ = 4.48); use a length-normalised level (rollout_is='geometric', seq_mean_*) or a "
                              "token level", UserWarning, stacklevel=3)

    def _resolve_is(self) -> tuple[Any, Optional[ISSpec]]:
        """(the threshold as held, the resolved spec)."""
        level, spec, mode = self.rollout_is, self.rollout_is_threshold, self.rollout_is_mode
        if level is None:
            if mode is not None and mode not in _IS_MODES:
                raise invalid("rollout_is_mode", mode, f"allowed values are {list(_IS_MODES)}")
            return _unchecked("rollout_is_threshold", spec), None
        if level not in _IS_LEVELS:
            raise invalid("rollout_is", level, f"allowed values are None or {list(_IS_LEVELS)}")
        if spec is None:
            raise MissingSettingError(invalid("rollout_is_threshold", spec, f"required when rollout_is={level!r}"))
        threshold = read_threshold("rollout_is_threshold", spec)
        lower, upper = threshold if isinstance(threshold, Band) else (None, threshold)
        if not upper > 0:
            raise invalid("rollout_is_threshold", spec, "the upper bound must be > 0")
        mode = mode or ("truncate" if lower is None else "mask")
        if mode not in _IS_MODES:
            raise invalid("rollout_is_mode", mode, f"allowed values are {list(_IS_MODES)}")
        if self.rollout_is_threshold_lower is not None:
            if lower is not None:
                raise invalid("rollout_is_threshold_lower", self.rollout_is_threshold_lower,
                              "give the lower bound either here or in rollout_is_threshold='lo_hi', not both")
            lower = as_float("rollout_is_threshold_lower", self.rollout_is_threshold_lower)
            if not 0 <= lower <= upper:
                raise invalid("rollout_is_threshold_lower", lower, f"must lie in [0, upper={upper}]")
        elif mode == "truncate" and lower is not None:
            raise invalid("rollout_is_mode", mode, "a 'lo_hi' threshold needs mode 'mask' (IcePop) or 'clip', "
                          "not 'truncate'")
        if mode in ("clip", "mask") and lower is None:
            lower = 1.0 / upper
        metric_lower = lower if lower is not None else 1.0 / upper
        return threshold, ISSpec(level, mode, upper, lower, metric_lower, self.rollout_is_batch_normalize)

    def _resolve_rs(self) -> tuple[Any, tuple[RSOption, ...]]:
        """(the threshold as held: one shared value or one per option, the resolved options)."""
        rs, spec, lower = self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if rs is not None and not isinstance(rs, str):
            raise invalid("rollout_rs", rs, "expected a comma-separated string of options")
        names = list(dict.fromkeys(p.strip() for p in (rs or "").split(",") if p.strip()))
        allowed = sorted(RS_OPTIONS) + sorted(LEGACY_RS)
        if rs is not None and not names:
            raise invalid("rollout_rs", rs, "expected at least one option")
        for n in names:
            if n not in allowed:
                hint = difflib.get_close_matches(n, allowed, n=1)
                raise invalid("rollout_rs", rs, f"unknown option {n!r}" + (f" (did you mean {hint[0]!r}?)" if hint
                                                                          else "") + f"; allowed: {allowed}")
        if any(n in LEGACY_RS for n in names):
            if len(names) > 1:
                raise invalid("rollout_rs", rs, "the modes 'token'/'sequence'/'geometric' cannot be chained; "
                              "chain the k1 options instead (e.g. 'token_k1,seq_mean_k3')")
            return self._legacy_option(names[0])
        if lower is not None:
            raise invalid("rollout_rs_threshold_lower", lower, "the k1/k2/k3 options take their bounds from "
                          "rollout_rs_threshold ('lo_hi' for k1)" if rs else
                          "only meaningful with rollout_rs='token'|'sequence'|'geometric'")
        if rs is None:
            return _unchecked("rollout_rs_threshold", spec), ()
        if spec is None:
            raise MissingSettingError(invalid("rollout_rs_threshold", spec, f"required when rollout_rs={rs!r}"))
        parts = threshold_parts(spec)
        if len(parts) not in (1, len(names)):
            raise invalid("rollout_rs_threshold", spec,
                          f"give one threshold shared by all options or exactly {len(names)} (one per option)")
        values, options = [], []
        for name, raw in zip(names, parts * len(names) if len(parts) == 1 else parts):
            (agg, est), key = RS_OPTIONS[name], f"rollout_rs_threshold[{name}]"
            if est in SIGNED_ESTIMATORS:  # a signed band lo ≤ Δp ≤ hi
                value = _signed_band(key, raw)
                options.append(RSOption(name, agg, est, value.lo, value.hi))
                values.append(value)
                continue
            value = read_threshold(key, raw)
            if est == "k1":  # ratio bounds lo ≤ ρ ≤ hi  ⇔  −log hi ≤ k1 ≤ −log lo; a single x: [1/x, x]
                lo, hi = value if isinstance(value, Band) else (1 / value if value > 0 else 0.0, value)
                if not 0 < lo <= hi:
                    raise invalid(key, raw, "a single bound x means [1/x, x] and must be ≥ 1 and finite")
                options.append(RSOption(name, agg, est, -math.log(hi), -math.log(lo)))
            elif isinstance(value, Band):
                raise invalid(key, raw, f"{name} takes a single upper bound, not 'lo_hi'")
            elif not value > 0:
                raise invalid(key, raw, "must be > 0")
            elif est == "logprob_error" and not value >= 1:
                raise invalid(key, raw, "the mean of exp(|log ρ_t|) is ≥ 1: a bound below 1 rejects every "
                              "sequence (NeMo-RL recipes use 2)")
            else:
                options.append(RSOption(name, agg, est, None, value))
            values.append(value)
        # one shared threshold is held as a ratio option reads it (a signed option turns x into [−x, x])
        shared = next((v for v, o in zip(values, options) if o.estimator not in SIGNED_ESTIMATORS), values[0])
        return (shared if len(parts) == 1 else tuple(values)), tuple(options)

    def _legacy_option(self, mode: str) -> tuple[Optional[float], tuple[RSOption, ...]]:
        """A first-generation mode: the ratio band [lower, upper] on ρ_t, ∏ρ_t or exp(mean log ρ_t)."""
        given = self.rollout_rs_threshold
        spec = self.rollout_is_threshold if given is None else given
        if spec is None or isinstance(spec, tuple) or (isinstance(spec, str) and "_" in spec):
            raise invalid("rollout_rs_threshold", given, f"rollout_rs={mode!r} needs a numeric upper ratio bound")
        upper, lower = as_float("rollout_rs_threshold", spec), self.rollout_rs_threshold_lower
        if not upper > 0:
            raise invalid("rollout_rs_threshold", spec, "must be > 0")
        lower = 1.0 / upper if lower is None else as_float("rollout_rs_threshold_lower", lower)
        if not 0 <= lower <= upper:
            raise invalid("rollout_rs_threshold_lower", lower, f"must lie in [0, upper={upper}]")
        name = LEGACY_RS[mode]
        option = RSOption(name, *RS_OPTIONS[name], -math.log(upper), -math.log(lower) if lower else math.inf,
                          legacy=mode)
        return (None if given is None else upper), (option,)

    def to_dict(self) -> dict[str, Any]:
        """Every key (``metrics`` as a list of family names), as :meth:`Loading.to_dict`."""
        return {**super().to_dict(), "metrics": list(self.metrics)}

    def length_limits(self, drift: Optional[float] = None) -> list[tuple[str, int, str]]:
        """(setting, L, what it does) for each sequence-level product setting that a mean per-token
        log-ratio of ±``drift`` (default :data:`DRIFT`) crosses from L tokens on: L·drift past a log
        bound of ``rollout_is="sequence"``, or L × the per-token k1 / k2 / k3 past a ``seq_sum_*`` bound."""
        d = DRIFT if drift is None else as_float("drift", drift)
        if not 0 < d < math.inf:
            raise ValueError(f"drift={drift!r}: expected a positive mean per-token log-ratio, e.g. 0.005")
        settings = []  # (setting, [(bound on the sum, growth per token)], what crossing does)
        spec = self.is_spec
        if spec is not None and spec.level == "sequence":
            bounds = [(math.log(spec.upper), d)] + ([(-math.log(spec.lower), d)] if spec.lower else [])
            settings.append((f"rollout_is='sequence' ({spec.mode}, bounds {spec.lower or 0:g}, {spec.upper:g})", bounds,
                             "rejects whole batches" if spec.mode == "mask" else
                             "bounds every sequence weight of a batch alike, telling none apart"))
        per_token = {"k1": d, "k2": d * d / 2, "k3": math.expm1(d) - d}  # k3: the larger of +d's and −d's
        for o in self.rs_options:
            if o.agg == "seq_sum" and o.estimator in per_token:
                lower = [] if o.stat_lower is None else [(-o.stat_lower, d)]  # k1: −log hi
                settings.append((f"rollout_rs option {o.name!r}", [(o.stat_upper, per_token[o.estimator])] + lower,
                                 "rejects whole batches"))
        out = []
        for what, bounds, verb in settings:
            lengths = [math.floor(b / v) + 1 for b, v in bounds if 0 < b < math.inf]
            if lengths:
                out.append((what, min(lengths), verb))
        return out

    # ------------------------------------------------------------------ derived flags
    @property
    def uses_pure_is(self) -> bool:
        """The REINFORCE loss, bypass mode's (first-generation ``use_pure_rollout_correction``)."""
        return self.loss_type == "reinforce"

    @property
    def is_enabled(self) -> bool:
        return self.is_spec is not None

    @property
    def uses_segments(self) -> bool:
        """A segment IS level or a ``segment_*`` rejection option: the call needs segment ids."""
        return self.rollout_is in SEGMENT_IS_LEVELS or any(o.agg.startswith("segment_") for o in self.rs_options)

    def refuse_segments(self, route: str) -> None:
        """Raise a ValueError naming the segment setting when ``route`` cannot pass segment ids."""
        if not self.uses_segments:
            return
        names = ([f"rollout_is={self.rollout_is!r}"] if self.rollout_is in SEGMENT_IS_LEVELS else []) + \
            [f"rollout_rs option {o.name!r}" for o in self.rs_options if o.agg.startswith("segment_")]
        raise ValueError(f"{', '.join(names)}: the segment level needs the segment (turn) ids of every token, "
                         f"and {route} has none to pass; call compute_rollout_correction / compute_policy_loss "
                         "with segment_ids=..., or use verl's correction step with batch.batch['segment_ids'] "
                         "(docs/methods.md, 'Segments')")

    @property
    def rs_enabled(self) -> bool:
        return bool(self.rs_options) or self.rollout_token_veto_threshold is not None or \
            self.rollout_token_veto_threshold_high is not None


def _signed_band(key: str, raw: Any) -> Band:
    """A band lo ≤ x ≤ hi on a signed statistic, from ``"lo_hi"`` (``"-0.2_0.2"``), ``(lo, hi)`` or a
    single x ≥ 0 meaning [−x, x]; bounds finite and ordered."""
    if isinstance(raw, str) and "_" in raw:
        parts: Any = raw.strip().split("_", 1)
    else:
        parts = raw if isinstance(raw, (tuple, list)) else None
    if parts is None:
        x = as_float(key, raw)
        if not 0 <= x < math.inf:
            raise invalid(key, raw, "a single bound x means [−x, x] and must be finite and ≥ 0")
        return Band(-x, x)
    if len(parts) != 2:
        raise invalid(key, raw, "a band is written 'lower_upper' (e.g. '-0.2_0.2') or (lower, upper)")
    lo, hi = (as_float(key, v) for v in parts)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise invalid(key, raw, "the bounds must be finite")
    if lo > hi:
        raise invalid(key, raw, f"lower bound {lo} exceeds upper bound {hi}")
    return Band(lo, hi)


def _unchecked(key: str, value: Any) -> Any:
    """A threshold no setting uses: held as read when it reads, else as given (it is not checked)."""
    try:
        values = tuple(read_threshold(key, p) for p in threshold_parts(value))
    except ConfigError:
        return value  # None too
    return values[0] if len(values) == 1 else values or value


def as_config(value: Any) -> RolloutCorrectionConfig:
    """The one way every entry point reads a config: ``None`` → the default (metrics only); a config
    → itself; a string → that preset; anything :func:`settings_dict` reads → ``from_dict`` of its
    keys. Unknown keys and invalid values raise :class:`ConfigError`, an unreadable type TypeError."""
    if value is None:
        return RolloutCorrectionConfig()
    if isinstance(value, RolloutCorrectionConfig):
        return value
    if isinstance(value, str):
        return RolloutCorrectionConfig.from_preset(value)
    return RolloutCorrectionConfig.from_dict(settings_dict(value))
