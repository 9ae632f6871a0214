"""Which preset to use, decided from the measured mismatch.

The rule reads five numbers of the profile and stops at the first case that applies:

======  =====================================================  ==============================
case    condition                                              preset
======  =====================================================  ==============================
none    every rollout log-prob equals the trainer's            ``disabled``
exact   max |log π_train − log π_rollout| ≤ 1e-6              ``disabled`` (assert it instead)
severe  KL > 0.1 (k1 or k3 estimate) or χ²_token > 1          ``decoupled_k3_rs_token_tis``
tails   ≥ 1 % of tokens with ρ ∉ [0.5, 2], or ≥ 1 % of rows    ``decoupled_token_icepop``
        with a token ρ < 1e-4
tiny    k3 KL < 1e-5 and sequence-weight ESS ≥ 0.99            ``bypass_ppo_clip``
seq     sequence-weight ESS ≥ 0.8                              ``decoupled_seq_is``
seq+rs  sequence-weight ESS ≥ 0.5                              ``decoupled_seq_is_rs``
long    mean length ≥ 512 tokens and geometric-weight          ``decoupled_geo_is``
        ESS ≥ 0.8
token   otherwise                                              ``decoupled_token_is``
======  =====================================================  ==============================

Why: the sequence weight ∏ρₜ is the unbiased correction, but its log has variance ≈ L·Var(log ρ),
so it degenerates when responses are long *and* the per-token gap is not tiny. Its Kish ESS
((Σw)²/(n·Σw²) over rows, measured on the raw weights) tells directly whether it is usable: high
ESS → sequence IS (with rejection of the outlying rows when ESS is only moderate); low ESS → the
product is dominated by a few rows. For long responses the length-normalised (geometric) weight
exp(mean log ρₜ) keeps one weight per sequence with a spread that does not grow with the length
(docs/diagnose.md shows a measured example); otherwise the biased-but-bounded token-level TIS is
the better trade. Heavy token tails are better handled by IcePop (dropping the out-of-band
tokens' weight) than by truncating every ratio, and a large average gap needs sequence rejection
(k3) on top of token TIS while the engine itself is fixed. When the gap is negligible the rollout policy is a
good proximal policy and bypass mode saves the extra forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_correction import METRIC_PREFIX, RolloutCorrectionConfig
from rollout_correction_core.primitives import DRIFT
from rollout_correction_core.vocabulary import PRESETS

from .profile import ProfileResult

P = METRIC_PREFIX

#: Thresholds of the rule above (documented in docs/diagnose.md), set against the published figures
#: of docs/metrics.md. Healthy production runs publish per-token gaps of 1e-3 (NeMo-RL, vLLM vs its
#: trainer, KL), 2.7e-3 (Nemotron, gen_kl) and 5.2e-3 (DeepSeek-V4 on verl, k3; verl #7242); engines
#: built to agree exactly hold |Δ log p| to 1e-6 (slime's true on-policy CI, slime #2262).
#:
#: EXACT_ATOL: slime's CI tolerance. Within it the engines agree as exactly as the engines that try to
#: agree do: no correction, and an assertion (``expect_zero_atol``) so that a regression like
#: slime #830 (mean |Δ log p| 4.5e-4, max 0.023) raises instead of passing for "tiny".
EXACT_ATOL = 1e-6
#: SEVERE_KL: verl's alert level, 19× DeepSeek-V4's k3, 37× Nemotron's gen_kl, 100× NeMo-RL's KL: no
#: published healthy run comes near it (NeMo-RL #2260 reports gen_kl_error 0.15–1.75 as a bug).
SEVERE_KL = 0.1
SEVERE_CHI2 = 1.0
TAIL_TOKENS = 0.01
TAIL_ROWS = 0.01
#: TINY_K3: 100× below NeMo-RL's 1e-3 and 500× below DeepSeek-V4's k3, so below every published
#: production gap, where bypass mode's clipping against π_rollout costs nothing measurable; above
#: what exact engines reach (|Δ| ≤ 1e-6 gives k3 ≈ Δ²/2 ≤ 5e-13).
TINY_K3 = 1e-5
TINY_SEQ_ESS = 0.99
#: ELEVATED_K3 (a health check, not a case of the rule): above every published healthy figure (the
#: largest: verl #7519's bf16 DAPO run, kl 0.0089 at its last step; DeepSeek-V4's k3 0.0052), below
#: verl #7519's FP8-tensorwise run at its last step (kl 0.0313): tests/test_published_figures.py.
ELEVATED_K3 = 0.01
SEQ_ESS = 0.8
SEQ_RS_ESS = 0.5
LONG_RESPONSE = 512
GEO_ESS = 0.8


@dataclass
class Recommendation:
    preset: str
    case: str
    reason: str
    inputs: dict[str, float]
    notes: list[str] = field(default_factory=list)


def recommend(res: ProfileResult) -> Recommendation:
    """The preset the rule (module docstring) picks, with :func:`length_notes` on the dump's lengths."""
    rec = _rule(res)
    c = res.counters
    rec.notes = length_notes(c.tokens / c.rows_used if c.rows_used else 0.0, res.metrics[f"{P}kl"])
    return rec


def length_notes(mean_length: float, kl: float) -> list[str]:
    """What a config's ``expected_response_length`` would warn about, from the measured lengths: the
    presets whose sequence-level (∏ρ_t) bounds a mean per-token log-ratio of 0.005 (or the measured
    |kl|, if larger) crosses before the dump's mean response length, grouped by the length where it
    starts (:meth:`RolloutCorrectionConfig.length_limits`)."""
    drift = max(DRIFT, abs(kl))
    starts: dict[int, set[str]] = {}
    for name in (n for n, p in PRESETS.items() if p.alias_of is None):
        for _, length, _ in RolloutCorrectionConfig.from_preset(name).length_limits(drift):
            starts.setdefault(length, set()).add(name)
    return [f"responses average {mean_length:.0f} tokens, and a mean per-token log-ratio of {drift:.3g} crosses the "
            f"sequence-level (∏ρ) bounds of {', '.join(sorted(names))} from {length} tokens on: those presets would "
            "truncate every sequence weight or reject whole batches here; prefer a geometric or token level, and "
            "give the config expected_response_length to be warned when it is built"
            for length, names in sorted(starts.items()) if length <= mean_length]


def _rule(res: ProfileResult) -> Recommendation:
    m, lv, c = res.metrics, res.levels, res.counters
    kl, k3, chi2 = m[f"{P}kl"], m[f"{P}k3_kl"], m[f"{P}chi2_token"]
    seq_ess = lv["sequence"]["ess"]
    tok_tail = lv["token"]["fraction_outside"]
    veto = c.rows_vetoed / c.rows_used if c.rows_used else 0.0
    mean_len = c.tokens / c.rows_used if c.rows_used else 0.0
    inputs = {"kl": kl, "k3_kl": k3, "chi2_token": chi2, "seq_ess": seq_ess, "geo_ess": lv["geometric"]["ess"],
              "token_fraction_outside": tok_tail, "veto_fraction": veto, "mean_length": mean_len}
    spread = lv["sequence"]["std"]

    if c.tokens and c.tokens_identical == c.tokens:
        return Recommendation("disabled", "none",
                              "rollout and trainer log-probs are identical, there is nothing to correct "
                              "(check that the rollout column really comes from the inference engine)", inputs)
    max_abs = m.get(f"{P}log_prob_abs_diff_max")
    if max_abs is not None:
        inputs["log_prob_abs_diff_max"] = max_abs
    if max_abs is not None and c.tokens and max_abs <= EXACT_ATOL:
        return Recommendation(
            "disabled", "exact",
            f"the engines agree to max |Δ log p| = {max_abs:.2g}, within slime's true on-policy tolerance "
            f"{EXACT_ATOL:g}: switch the correction off and assert the agreement (expect_zero_atol={EXACT_ATOL:g}), "
            "so that a regression (slime #830: mean |Δ log p| 4.5e-4) raises instead of passing unnoticed", inputs)
    if max(abs(kl), k3) > SEVERE_KL or chi2 > SEVERE_CHI2:
        return Recommendation(
            "decoupled_k3_rs_token_tis", "severe",
            f"the gap is large (kl = {kl:.3g}, k3 = {k3:.3g}, χ²_token = {chi2:.3g}): truncate token weights and reject "
            "the sequences whose mean k3 exceeds 0.01; correction cannot make such data on-policy, so fix the "
            "engine mismatch (precision, quantisation, sampling parameters, weight sync) as well", inputs)
    if tok_tail >= TAIL_TOKENS or veto >= TAIL_ROWS:
        return Recommendation(
            "decoupled_token_icepop", "tails",
            f"the average gap is moderate (k3 = {k3:.3g}) but the ratio has heavy tails "
            f"({100 * tok_tail:.2g} % of tokens outside [0.5, 2], {100 * veto:.2g} % of rows with a token "
            "below 1e-4): IcePop drops the weight of the out-of-band tokens and keeps the rest of each "
            "response", inputs)
    if k3 < TINY_K3 and seq_ess >= TINY_SEQ_ESS:
        return Recommendation(
            "bypass_ppo_clip", "tiny",
            f"the gap is negligible (k3 = {k3:.2g}, sequence-weight ESS = {seq_ess:.3f}): the rollout policy "
            "is a valid proximal policy, so PPO can clip against it and skip the old-log-prob pass", inputs)
    if seq_ess >= SEQ_ESS:
        return Recommendation(
            "decoupled_seq_is", "seq",
            f"per-token gap k3 = {k3:.2g} over {mean_len:.0f} tokens on average keeps sequence weights usable "
            f"(ESS = {seq_ess:.3f}, std of log ∏ρ = {lv['sequence']['log_std']:.3g}): the unbiased sequence-level "
            "weight, truncated at 2, is the right correction", inputs)
    if seq_ess >= SEQ_RS_ESS:
        return Recommendation(
            "decoupled_seq_is_rs", "seq+rs",
            f"sequence weights are usable but spread (ESS = {seq_ess:.3f}, weight std = {spread:.3g}): "
            "sequence-level IS plus rejection of the rows whose ∏ρ falls outside [0.5, 2]", inputs)
    geo = lv["geometric"]
    if mean_len >= LONG_RESPONSE and geo["ess"] >= GEO_ESS:
        return Recommendation(
            "decoupled_geo_is", "long",
            f"responses are long ({mean_len:.0f} tokens on average) and the product weight ∏ρ has collapsed "
            f"(ESS = {seq_ess:.3f}, mean raw weight = {lv['sequence']['mean']:.3g}, log ∏ρ spread "
            f"{lv['sequence']['log_std']:.3g}), while the length-normalised weight exp(mean log ρ) stays usable "
            f"(ESS = {geo['ess']:.3f}, mean = {geo['mean']:.3g}): geometric-level TIS keeps one weight per "
            "sequence without the length-driven collapse", inputs)
    return Recommendation(
        "decoupled_token_is", "token",
        f"sequence weights degenerate (ESS = {seq_ess:.3f}): {mean_len:.0f} tokens × per-token gap "
        f"k3 = {k3:.2g} makes ∏ρ dominated by a few rows; token-level TIS (cap 2) trades a small bias "
        "for bounded variance", inputs)

