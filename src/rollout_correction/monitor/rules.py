"""Health rules: seed 001's static thresholds, trend rules against each run's own baseline, and
the non-finite check.

A rule sees one step's metrics at a time (names without the ``rollout_corr/`` prefix) and answers
``evaluate(metrics) -> (firing, value)``: ``firing`` is ``None`` when the step does not report the
metric (the rule keeps its previous state), otherwise whether the rule fires at this step, with
the value it judged. The monitor turns state changes into :class:`Alert` objects.

Static rules (seed 001, "Conditional Alerting"): fire while the median of the metric over the last
S reported steps (``static_window``, default 5) is across the seed's line; S = 1 is the seed's
per-step check, which also fires on single-batch spikes.

Trend rules: x_t is the rule's *badness* (|k1|, k3, χ², 1 − ESS, …; non-finite steps skipped).

* baseline  b = median(x_1 … x_B) over the first B reported steps (``baseline_steps``);
* level     s_t = median(x_{t−W+1} … x_t) over the last W reported steps (``window``);
* fires when s_t > f · max(b, ε) for D consecutive reported steps after the baseline
  (``min_duration``), where f is the rule's factor and ε its noise floor.

Defaults: B = W = 20 (the last 20 steps against the first 20), D = 5. Divergence-scale quantities
(KL k1/k3, χ², 1 − ESS, rejected fraction) use f = F (``trend_factor``, default 3: the gap
tripled); first-order quantities (log-PPL gap, weight std) use f = √F, the same rise of the
underlying divergence. The floors ε are fixed noise levels of fp32 arithmetic, not per-run
settings.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

Severity = Literal["warn", "critical"]

__all__ = ["Alert", "ThresholdRule", "TrendRule", "NonFiniteRule", "STATIC_THRESHOLDS", "static_rules",
           "trend_rules"]


@dataclass(frozen=True)
class Alert:
    """One rule starting to fire at ``step``."""

    step: int
    name: str
    severity: Severity
    value: float
    message: str
    kind: str = "static"  # "static", "trend" or "nonfinite"

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(v) -> Optional[float]:
    return v if v is not None and math.isfinite(v) else None


# ---------------------------------------------------------------------------------------------
# Static rules (seed 001)

# name -> default threshold; None in ``thresholds=`` turns a rule off.
STATIC_THRESHOLDS: dict[str, float] = {
    "is_mean_low": 0.5,        # rollout_is_mean < 0.5
    "is_mean_high": 2.0,       # rollout_is_mean > 2.0
    "ess_low": 0.3,            # rollout_is_eff_sample_size < 0.3
    "veto_high": 0.1,          # rollout_is_veto_fraction > 0.1
    "is_std_high": 1.0,        # rollout_is_std > 1.0
    "kl_high": 0.1,            # |kl| > 0.1
    "chi2_token_high": 1.0,    # chi2_token > 1.0
    "rejected_high": 0.5,      # rollout_rs_masked_fraction > 0.5 (ours, not seed 001's)
    "rejected_positive_high": 0.75,  # rollout_rs_rejected_positive_fraction > 0.75 (with advantages)
    "routing_match_low": 0.9,  # routing_match < 0.9 (MoE: share of (token, layer) top-k sets that agree)
}

_SPREAD = ("High spread in IS weights: switch from sequence to geometric level, tighten the thresholds "
           "(rollout_is_threshold), and check that rollout and training policies are not too different.")
_MEAN = ("Mean IS weight far from 1: check that the rollout log-probs are passed and computed "
         "(calculate_log_probs=True) and look for a systematic distribution shift.")
_VETO = ("Too many sequences vetoed: relax rollout_token_veto_threshold (e.g. 1e-3), check the "
         "log-prob computation for numerical issues, and check that the policies are not completely different.")
_REJECTED = ("Rejection sampling removes most tokens from the loss: widen the RS band (rollout_rs_threshold / "
             "_lower), use a token- instead of a sequence-level criterion, or reduce the gap itself.")
_REJECTED_POSITIVE = ("Rejection drops mostly sequences with a positive advantage (correct answers): the filter "
                      "biases the outcome; widen the RS band or reduce the gap rather than filter it.")
_GAP = ("Large training-inference gap: enable a rollout correction (token TIS, geometric RS or a bypass "
        "preset) and check the rollout engine's numerics (precision, quantisation, stale weights).")

_ROUTING = ("The rollout engine and the trainer route many tokens to different experts: replay the engine's "
            "routing in the trainer (R3, rollout_correction.moe.replay_routing), and check the engine's "
            "numerics around the routers (precision of the gate, quantised experts).")


@dataclass
class ThresholdRule:
    """Fires while the median of ``metric`` (or ``|metric|``) over the last ``window`` reported
    steps is above (``above``) or below ``threshold``."""

    name: str
    metric: str
    threshold: float
    above: bool
    message: str
    absolute: bool = False
    window: int = 5
    severity: Severity = "warn"
    kind: str = "static"
    _recent: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"static_window must be >= 1, got {self.window}")
        self._recent = deque(maxlen=self.window)

    def evaluate(self, metrics: dict[str, float]) -> tuple[Optional[bool], float]:
        v = _finite(metrics.get(self.metric))
        if v is None:
            return None, float("nan")
        self._recent.append(abs(v) if self.absolute else v)
        x = statistics.median(self._recent)
        return (x > self.threshold if self.above else x < self.threshold), x

    def describe(self, value: float) -> str:
        what = f"|{self.metric}|" if self.absolute else self.metric
        op = ">" if self.above else "<"
        over = f" (median of the last {self.window} steps)" if self.window > 1 else ""
        return f"{what} = {value:.4g}{over} {op} {self.threshold:g}. {self.message}"

    def reset(self) -> None:
        self._recent.clear()


def static_rules(thresholds: Optional[dict[str, Optional[float]]] = None, window: int = 5) -> list[ThresholdRule]:
    """Seed 001's checks with ``thresholds`` overriding the defaults (a value of None drops a rule),
    on the median of the last ``window`` steps (1: the seed's per-step check)."""
    t = dict(STATIC_THRESHOLDS)
    unknown = set(thresholds or {}) - set(t)
    if unknown:
        raise ValueError(f"unknown threshold(s) {sorted(unknown)}; known: {sorted(t)}")
    t.update(thresholds or {})
    spec = [
        ("is_mean_low", "rollout_is_mean", False, _MEAN, False),
        ("is_mean_high", "rollout_is_mean", True, _MEAN, False),
        ("ess_low", "rollout_is_eff_sample_size", False, _SPREAD, False),
        ("veto_high", "rollout_is_veto_fraction", True, _VETO, False),
        ("is_std_high", "rollout_is_std", True, _SPREAD, False),
        ("kl_high", "kl", True, _GAP, True),
        ("chi2_token_high", "chi2_token", True, "Severe distribution shift (token χ²). " + _GAP, False),
        ("rejected_high", "rollout_rs_masked_fraction", True, _REJECTED, False),
        ("rejected_positive_high", "rollout_rs_rejected_positive_fraction", True, _REJECTED_POSITIVE, False),
        ("routing_match_low", "routing_match", False, _ROUTING, False),
    ]
    return [ThresholdRule(name, metric, float(t[name]), above, msg, absolute=ab, window=window)
            for name, metric, above, msg, ab in spec if t[name] is not None]


# ---------------------------------------------------------------------------------------------
# Trend rules


@dataclass
class TrendRule:
    """Fires when the smoothed badness of ``metric`` exceeds ``factor`` × its early baseline.

    ``transform``: ``"abs"`` (|x|), ``"pos"`` (max(x, 0)), ``"deficit"`` (1 − x, for metrics whose
    healthy value is 1 such as ESS), or ``"value"``.
    """

    name: str
    metric: str
    factor: float
    floor: float
    message: str
    transform: str = "pos"
    baseline_steps: int = 20
    window: int = 20
    min_duration: int = 5
    severity: Severity = "warn"
    kind: str = "trend"
    _baseline: list = field(default_factory=list, repr=False)
    _recent: deque = field(default_factory=deque, repr=False)
    _run: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError(f"trend factor of {self.name} must be > 1, got {self.factor}")
        for k in ("baseline_steps", "window", "min_duration"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        self._recent = deque(maxlen=self.window)

    def badness(self, v: float) -> float:
        if self.transform == "abs":
            return abs(v)
        if self.transform == "pos":
            return max(v, 0.0)
        if self.transform == "deficit":
            return max(1.0 - v, 0.0)
        return v

    @property
    def baseline(self) -> Optional[float]:
        return statistics.median(self._baseline) if len(self._baseline) >= self.baseline_steps else None

    def evaluate(self, metrics: dict[str, float]) -> tuple[Optional[bool], float]:
        v = _finite(metrics.get(self.metric))
        if v is None:
            return None, float("nan")
        x = self.badness(v)
        self._recent.append(x)
        if len(self._baseline) < self.baseline_steps:
            self._baseline.append(x)
            return False, x
        level = statistics.median(self._recent)
        self._run = self._run + 1 if level > self.limit else 0
        return self._run >= self.min_duration, level

    @property
    def limit(self) -> float:
        b = self.baseline
        return float("inf") if b is None else self.factor * max(b, self.floor)

    def describe(self, value: float) -> str:
        b = self.baseline or 0.0
        return (f"{self.metric} trend: median of the last {self.window} steps {value:.4g} > {self.factor:.3g} × "
                f"early baseline max({b:.4g}, {self.floor:g}) for {self.min_duration} steps. {self.message}")

    def reset(self) -> None:
        self._baseline.clear()
        self._recent.clear()
        self._run = 0


_RISING = ("The training-inference mismatch is growing relative to the start of the run (it rises ahead "
           "of collapse): enable or tighten the rollout correction (token TIS, geometric RS, or a bypass "
           "preset), and check for a systematic shift (engine precision, quantisation, stale weights).")
_FALLING = ("The share of usable samples is falling: the IS weights concentrate on few samples. Switch "
            "from sequence to geometric level, tighten the thresholds, and check that rollout and training "
            "policies are not drifting apart.")

# (name, metric, transform, scale, floor): scale 2 for divergence-like quantities (factor F),
# 1 for first-order ones (factor √F).
TREND_SPEC: tuple[tuple[str, str, str, int, float, str], ...] = (
    ("kl_rising", "kl", "abs", 2, 1e-4, _RISING),
    ("k3_kl_rising", "k3_kl", "pos", 2, 1e-4, _RISING),
    ("log_ppl_gap_rising", "log_ppl_abs_diff", "pos", 1, 1e-3, _RISING),
    ("chi2_token_rising", "chi2_token", "pos", 2, 2e-4, _RISING),
    ("chi2_seq_rising", "chi2_seq", "pos", 2, 1e-3, _RISING),
    ("is_std_rising", "rollout_is_std", "pos", 1, 1e-2, _FALLING),
    ("ess_falling", "rollout_is_eff_sample_size", "deficit", 2, 1e-3, _FALLING),
    ("accepted_falling", "rollout_rs_masked_fraction", "pos", 2, 1e-2, _FALLING),
    ("routing_differs_rising", "routing_token_differs", "pos", 1, 1e-2, _ROUTING),
    # probability space (verl's rollout_probs_diff_mean, NeMo-RL's js_divergence_error)
    ("prob_diff_rising", "prob_abs_diff_mean", "pos", 1, 1e-3, _RISING),
    ("js_divergence_rising", "js_divergence", "pos", 2, 1e-5, _RISING),
)


def trend_rules(factor: float = 3.0, baseline_steps: int = 20, window: int = 20, min_duration: int = 5,
                names: Optional[list[str]] = None) -> list[TrendRule]:
    """The trend rules (all, or those in ``names``)."""
    known = [s[0] for s in TREND_SPEC]
    if names is not None and set(names) - set(known):
        raise ValueError(f"unknown trend rule(s) {sorted(set(names) - set(known))}; known: {known}")
    return [TrendRule(name, metric, factor if scale == 2 else math.sqrt(factor), floor, msg, transform,
                      baseline_steps, window, min_duration)
            for name, metric, transform, scale, floor, msg in TREND_SPEC if names is None or name in names]


# ---------------------------------------------------------------------------------------------


@dataclass
class NonFiniteRule:
    """Critical, immediately: a sequence dropped for a NaN/±inf log-prob
    (``nonfinite_seq_fraction`` > 0), or any reported metric that is itself NaN/±inf."""

    name: str = "nonfinite"
    metric: str = "nonfinite_seq_fraction"
    severity: Severity = "critical"
    kind: str = "nonfinite"
    message: str = ("Non-finite log-probs reached the correction: check the log-prob computation "
                    "(overflow in fp16/bf16, -inf for sampled tokens outside the trainer's support, "
                    "misaligned masks).")

    def evaluate(self, metrics: dict[str, float]) -> tuple[Optional[bool], float]:
        if not metrics:
            return None, float("nan")
        self._bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if self._bad:
            return True, float("nan")
        frac = metrics.get(self.metric)
        return (frac is not None and frac > 0), (frac if frac is not None else 0.0)

    def describe(self, value: float) -> str:
        if math.isnan(value):
            return f"non-finite metric(s) {', '.join(getattr(self, '_bad', []))}. {self.message}"
        return f"{self.metric} = {value:.4g} > 0. {self.message}"

    def reset(self) -> None:
        pass
