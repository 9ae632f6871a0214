"""Health checks with verdicts.

The statistical checks use the thresholds published with verl's rollout-correction guide (seed
001, "Troubleshooting" and the alerting example): |kl| > 0.1, χ²_token > 1, ESS < 0.3, mean weight
outside [0.5, 2], weight std > 1, veto fraction > 0.1. verl applies the weight checks to the
weights of the configured correction; before any correction is chosen we apply them to the raw
(untruncated, safety-bounded) weights at token and at sequence level, which is what an
importance-sampling estimator would face.

The input checks catch dumps that cannot be right: positive log-probabilities, log-probs shifted
by one position (ms-swift #8196), identical columns, non-finite values, engine sentinels (log-probs
at or below the floor, :mod:`.sentinels`), and rollout log-probs
renormalised over a top-k / top-p support (TRL #6789: the rollout side is then higher on almost
every token).

Verdicts: ``ok``; ``warn`` — a seed threshold is crossed; ``fail`` — the input itself is wrong.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rollout_correction import METRIC_PREFIX

from .profile import HEALTHY_BAND, VETO_THRESHOLD, ProfileResult
from .recommend import ELEVATED_K3
from .sentinels import describe

P = METRIC_PREFIX


@dataclass
class Check:
    name: str
    value: float
    threshold: str
    verdict: str  # "ok" | "warn" | "fail"
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def _check(name: str, value: float, bad: bool, threshold: str, detail_bad: str, detail_ok: str,
           fail: bool = False) -> Check:
    verdict = ("fail" if fail else "warn") if bad else "ok"
    return Check(name, float(value), threshold, verdict, detail_bad if bad else detail_ok)


def health_checks(res: ProfileResult) -> list[Check]:
    m, lv, c = res.metrics, res.levels, res.counters
    checks: list[Check] = []
    kl = m[f"{P}kl"]
    checks.append(_check(
        "|kl| (rollout − trainer, per token)", abs(kl), abs(kl) > 0.1, "≤ 0.1",
        "large per-token KL: the engines disagree strongly; check precision, quantisation, "
        "sampling parameters and weight sync before relying on correction",
        "per-token KL within the range seen in healthy runs"))
    k3 = m[f"{P}k3_kl"]
    checks.append(_check(
        "k3 per token vs published healthy runs", k3, k3 > ELEVATED_K3, f"≤ {ELEVATED_K3:g}",
        f"the gap is above every published healthy run (NeMo-RL KL ≈ 1e-3, Nemotron gen_kl 0.0027, DeepSeek-V4 "
        f"k3 0.0052, verl #7519's bf16 DAPO run kl 0.0089; docs/metrics.md): look for its cause (precision, quantisation, kernels, sampling "
        "parameters, weight sync) before relying on correction",
        "within the range published healthy runs report"))
    chi2 = m[f"{P}chi2_token"]
    checks.append(_check(
        "χ² token", chi2, chi2 > 1.0, "≤ 1",
        "severe token-level shift: second moment of the ratio is large", "token ratios concentrated near 1"))
    for level in ("token", "sequence"):
        d = lv[level]
        checks.append(_check(
            f"ESS ({level} weights)", d["ess"], d["ess"] < 0.3, "≥ 0.3",
            f"{level}-level weights concentrate on few samples; "
            + ("use token or geometric level, or tighter thresholds" if level == "sequence"
               else "tighten the threshold or add rejection"),
            "weights spread evenly"))
        lo, hi = HEALTHY_BAND
        mean = d["mean"]
        checks.append(_check(
            f"mean weight ({level})", mean, not (lo <= mean <= hi), f"in [{lo}, {hi}]",
            "mean weight far from 1: systematic shift, or the rollout log-probs are not the "
            "sampler's (check that the engine returns log-probs of the sampled tokens)",
            "mean weight close to 1"))
        checks.append(_check(
            f"weight std ({level})", d["std"], d["std"] > 1.0, "≤ 1",
            "high spread in weights; truncate (TIS) or switch aggregation level",
            "weight spread moderate"))
    veto = c.rows_vetoed / c.rows_used if c.rows_used else 0.0
    checks.append(_check(
        f"veto fraction (rows with a token ρ < {VETO_THRESHOLD:g})", veto, veto > 0.1, "≤ 0.1",
        "many rows hold a catastrophic token; check for numerical problems in the log-prob computation",
        "few catastrophic tokens"))
    # input sanity
    pos = c.tokens_positive_log_prob / c.tokens if c.tokens else 0.0
    checks.append(_check(
        "tokens with log-prob > 0", pos, pos > 0, "= 0",
        "some values are positive: these columns do not hold log-probabilities (probabilities? logits?)",
        "all values are valid log-probabilities", fail=True))
    al = res.alignment
    shifted = min(al.late_mae, al.early_mae)
    checks.append(_check(
        "alignment: shifted / aligned mean |old − rollout|", shifted / al.aligned_mae if al.aligned_mae > 0 else float("inf"),
        al.misaligned, "≥ 0.5",
        al.message or "the two columns match better when shifted by one position",
        "columns are aligned token by token" if al.n_pairs else "not enough adjacent tokens to check",
        fail=True))
    ident = c.tokens_identical / c.tokens if c.tokens else 0.0
    checks.append(_check(
        "identical log-probs", ident, ident == 1.0, "< 1",
        "every rollout log-prob equals the trainer's exactly: the rollout column may be a copy of the "
        "trainer's recompute", "the two columns come from different computations"))
    higher = c.tokens_rollout_higher / c.tokens if c.tokens else 0.0
    checks.append(_check(
        "tokens where the rollout log-prob is higher", higher, higher >= 0.95 and kl > 1e-3, "< 0.95 (or kl ≤ 1e-3)",
        "almost every token is more likely under the rollout engine: its log-probs look renormalised over a "
        "truncated sampling support (top-k / top-p / min-p 'processed' log-probs, TRL #6789), so every ratio "
        "carries the kept mass; recompute the trainer log-probs over the same support "
        "(rollout_correction.supports.renormalized_log_probs) or return unprocessed log-probs",
        "no sign of log-probs renormalised over a truncated support"))
    nonfinite = c.rows_nonfinite / c.rows if c.rows else 0.0
    checks.append(_check(
        "rows with NaN/inf log-probs (excluded)", nonfinite, c.rows_nonfinite > 0, "= 0",
        f"{c.rows_nonfinite} row(s) hold a NaN or ±inf log-prob at a response position and were left out "
        "of every statistic (top-k/top-p sampling returns −inf outside the kept set)",
        "all log-probs finite"))
    sentinels = res.sentinels
    if sentinels.get("floor") is not None:
        checks.append(_check(
            f"engine sentinels (log-prob ≤ {sentinels['floor']:g})", sentinels["tokens"], sentinels["tokens"] > 0,
            "= 0",
            f"{describe(sentinels)}: engines write such values where they have no log-prob (vLLM returns −9999, "
            "AReaL #1554), so these are not log-probabilities; the correction drops their rows like non-finite "
            "ones (config log_prob_floor); find why the engine returned them",
            "no log-prob at or below the floor", fail=True))
    return checks



#: Routing agreement below this share of matching (token, layer) top-k sets is flagged (the
#: monitor's ``routing_match_low`` line).
ROUTING_MATCH_LOW = 0.9


def routing_checks(metrics: dict[str, float]) -> list[Check]:
    """Checks of a mixture-of-experts model's routing agreement (``rollout_corr/routing_*``
    metrics of :func:`rollout_correction.moe.routing_agreement`); none when they are absent."""
    if f"{P}routing_match" not in metrics:
        return []
    match, differs = metrics[f"{P}routing_match"], metrics[f"{P}routing_token_differs"]
    return [_check(
        "routing agreement (top-k sets matching)", match, match < ROUTING_MATCH_LOW, f"≥ {ROUTING_MATCH_LOW:g}",
        f"the engine and the trainer route {differs:.1%} of the tokens to different experts in some layer: "
        "replay the engine's routing in the trainer (R3) before weighting what is left of the gap",
        f"{differs:.1%} of the tokens routed differently in some layer")]
