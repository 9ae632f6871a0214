"""Off-policy diagnostics (the 13 metrics, the 10 mismatch metrics + nonfinite_seq_fraction) against
hand-computed values."""

import math
import statistics

import pytest
import torch

from rollout_correction_core import (OffPolicyAccumulator, RolloutCorrectionConfig, compute_offpolicy_metrics,
                                     compute_rollout_correction, metrics_to_floats)


P = "rollout_corr/"
NAMES = ["training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
         "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
         "rollout_is_raw_mean", "rollout_is_seq_raw_mean", "chi2_token_sn", "chi2_seq_sn", "prob_abs_diff_mean", "prob_abs_diff_max", "prob_abs_diff_std", "prob_pearson", "log_prob_pearson",
         "js_divergence", "log_prob_abs_diff_seq_mean", "log_prob_abs_diff_max", "log_prob_abs_diff_gt1",
         "log_prob_abs_diff_gt2", "ratio_band_tight_fraction", "ratio_band_1pct_fraction",
         "ratio_band_5pct_fraction"]

# Two real rows and one all-padding row holding values that would wreck every statistic.
OLD = [[-1.0, -2.0, 7.0], [-0.5, -0.5, -0.5], [5.0, 5.0, 5.0]]
ROLL = [[-1.5, -1.5, -9.0], [-1.0, -0.25, -0.5], [-50.0, -50.0, -50.0]]
MASK = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]


def _inputs(rows=3):
    return (torch.tensor(OLD[:rows]), torch.tensor(ROLL[:rows]), torch.tensor(MASK[:rows], dtype=torch.bool))


def _expected():
    # log ρ = old − rollout on valid tokens: row 0 [0.5, −0.5], row 1 [0.5, −0.25, 0].
    lr = [0.5, -0.5, 0.5, -0.25, 0.0]
    train_nll = [1.5, 0.5]  # −mean log π_train per row
    roll_nll = [1.5, (1.0 + 0.25 + 0.5) / 3]
    d = [r - t for r, t in zip([-1.5, -1.75 / 3], [-1.5, -0.5])]  # mean log π_rollout − mean log π_train
    assert d[0] == 0.0 and d[1] == pytest.approx(-1 / 12)
    return {
        "training_ppl": (math.exp(train_nll[0]) + math.exp(train_nll[1])) / 2,
        "training_log_ppl": sum(train_nll) / 2,
        "kl": -0.05,  # mean over 5 tokens of (log π_rollout − log π_train): (−0.5+0.5−0.5+0.25+0)/5
        "k3_kl": sum(math.exp(x) - 1 - x for x in lr) / 5,
        "rollout_ppl": (math.exp(roll_nll[0]) + math.exp(roll_nll[1])) / 2,
        "rollout_log_ppl": sum(roll_nll) / 2,
        "log_ppl_diff": sum(d) / 2,
        "log_ppl_abs_diff": (abs(d[0]) + abs(d[1])) / 2,
        "log_ppl_diff_max": 0.0,
        "log_ppl_diff_min": -1 / 12,
        "ppl_ratio": (math.exp(d[0]) + math.exp(d[1])) / 2,
        "chi2_token": sum(math.exp(2 * x) for x in lr) / 5 - 1,
        "chi2_seq": (math.exp(2 * 0.0) + math.exp(2 * 0.25)) / 2 - 1,  # row sums of log ρ: 0 and 0.25
        # the raw statistics: ρ and ∏ρ (row sums of log ρ: 0 and 0.25) before any bound, and the
        # self-normalised χ² n·Σx²/(Σx)² − 1 of each
        "rollout_is_raw_mean": sum(math.exp(x) for x in lr) / 5,
        "rollout_is_seq_raw_mean": (1.0 + math.exp(0.25)) / 2,
        "chi2_token_sn": 5 * sum(math.exp(2 * x) for x in lr) / sum(math.exp(x) for x in lr) ** 2 - 1,
        "chi2_seq_sn": 2 * (1.0 + math.exp(0.5)) / (1.0 + math.exp(0.25)) ** 2 - 1,
        "nonfinite_seq_fraction": 0.0,
        "sentinel_token_fraction": 0.0,
        **_expected_mismatch(),
    }


def _expected_mismatch():
    """The mismatch metrics from the valid tokens, with the standard library's statistics."""
    lq, lp = [-1.0, -2.0, -0.5, -0.5, -0.5], [-1.5, -1.5, -1.0, -0.25, -0.5]
    q, p = [math.exp(x) for x in lq], [math.exp(x) for x in lp]
    d = [abs(a - b) for a, b in zip(q, p)]

    def js(a, b):  # NeMo-RL's estimate: ½ k3(π_train ‖ M) + ½ k3(π_rollout ‖ M) at the sampled token
        m = (a + b) / 2
        return 0.5 * (a / m - 1 - math.log(a / m)) + 0.5 * (b / m - 1 - math.log(b / m))

    return {
        "prob_abs_diff_mean": sum(d) / 5, "prob_abs_diff_max": max(d), "prob_abs_diff_std": statistics.stdev(d),
        "prob_pearson": statistics.correlation(q, p), "log_prob_pearson": statistics.correlation(lq, lp),
        "js_divergence": sum(js(a, b) for a, b in zip(q, p)) / 5,
        "log_prob_abs_diff_seq_mean": ((0.5 + 0.5) / 2 + (0.5 + 0.25 + 0.0) / 3) / 2,
        "log_prob_abs_diff_max": 0.5, "log_prob_abs_diff_gt1": 0.0, "log_prob_abs_diff_gt2": 0.0,
        # log ρ = 0.5, −0.5, 0.5, −0.25, 0: only the last token lies in any of the bands
        "ratio_band_tight_fraction": 1 / 5, "ratio_band_1pct_fraction": 1 / 5, "ratio_band_5pct_fraction": 1 / 5,
    }


def test_mismatch_metrics_count_large_log_prob_gaps_and_are_exact_without_mismatch():
    old = torch.tensor([[-0.1, -3.0, -0.2, -1.0], [-0.7, -0.05, -4.0, -2.0]])
    roll = old - torch.tensor([[1.5, -2.5, 0.0, 0.0], [0.5, 0.0, 3.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    got = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask, mismatch_metrics=True))
    assert got[P + "log_prob_abs_diff_max"] == pytest.approx(3.0)  # the 9.0 is padding
    assert got[P + "log_prob_abs_diff_gt1"] == pytest.approx(3 / 6)  # 1.5, −2.5, 3.0
    assert got[P + "log_prob_abs_diff_gt2"] == pytest.approx(2 / 6)  # −2.5, 3.0
    same = metrics_to_floats(compute_offpolicy_metrics(old, old, mask, mismatch_metrics=True))
    for k in ("prob_abs_diff_mean", "prob_abs_diff_max", "prob_abs_diff_std", "js_divergence",
              "log_prob_abs_diff_seq_mean", "log_prob_abs_diff_max", "log_prob_abs_diff_gt1"):
        assert same[P + k] == 0.0, k
    assert same[P + "prob_pearson"] == same[P + "log_prob_pearson"] == 1.0


def _check(got, expected):
    for k, v in expected.items():
        assert got[P + k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_all_offpolicy_metrics_by_hand():
    m = compute_offpolicy_metrics(*_inputs(), metrics="all")
    assert sorted(m) == sorted(P + k for k in NAMES + ["nonfinite_seq_fraction", "sentinel_token_fraction"])
    assert all(v.dim() == 0 for v in m.values())
    _check(metrics_to_floats(m), _expected())


def test_correction_reports_the_same_offpolicy_metrics():
    out = compute_rollout_correction(*_inputs(), config=RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, metrics="all"))
    _check(out.metrics_as_floats(), _expected())


def test_mismatch_metrics_are_opt_in():
    """By default neither entry point computes the mismatch metrics, the raw means, the self-normalised
    χ² or the sentinel share; the 13 others and nonfinite_seq_fraction are unchanged."""
    opt_in = set(NAMES[NAMES.index("rollout_is_raw_mean"):]) | {"sentinel_token_fraction"}  # ratio bands too
    plain = metrics_to_floats(compute_offpolicy_metrics(*_inputs()))
    assert sorted(plain) == sorted(P + k for k in NAMES + ["nonfinite_seq_fraction"] if k not in opt_in)
    _check(plain, {k: v for k, v in _expected().items() if k not in opt_in})
    mismatch = set(NAMES[NAMES.index("prob_abs_diff_mean"):NAMES.index("ratio_band_tight_fraction")])
    for chosen in ({"mismatch_metrics": True}, {"metrics": ["default", "mismatch"]}):
        got = metrics_to_floats(compute_offpolicy_metrics(*_inputs(), **chosen))
        assert sorted(got) == sorted(P + k for k in NAMES + ["nonfinite_seq_fraction"] if k not in opt_in - mismatch)
        _check(got, {k: v for k, v in _expected().items() if k not in opt_in - mismatch})
    out = compute_rollout_correction(*_inputs(), config=RolloutCorrectionConfig.decoupled_token_is())
    assert not {P + k for k in mismatch} & set(out.metrics)


def test_empty_rows_are_excluded_from_sequence_statistics():
    with_empty = metrics_to_floats(compute_offpolicy_metrics(*_inputs(3), mismatch_metrics=True))
    without = metrics_to_floats(compute_offpolicy_metrics(*_inputs(2), mismatch_metrics=True))
    assert with_empty == pytest.approx(without, rel=1e-12)
    # Counting the empty row as a sequence with mean 0 would give training_log_ppl 2/3, not 1.
    assert with_empty[P + "training_log_ppl"] == pytest.approx(1.0)


def test_float_mask_and_bool_mask_agree():
    old, roll, mask = _inputs()
    a = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask, mismatch_metrics=True))
    b = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask.float(), mismatch_metrics=True))
    assert a == b


@pytest.mark.parametrize("old_v,roll_v", [(0.0, -999.0), (-999.0, 0.0), (-80.0, -1.0)])  # above the floor
def test_extreme_inputs_give_finite_clamped_metrics(old_v, roll_v):
    old = torch.tensor([[old_v, -1.0], [-1.0, -1.0]])
    roll = torch.tensor([[roll_v, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    got = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask, mismatch_metrics=True))
    assert all(math.isfinite(v) for v in got.values()), got
    x = old_v - roll_v  # the one non-zero log-ratio, in row 0
    xc = max(-20.0, min(20.0, x))
    # k3 exponent clamped to ±20: k3 = e^xc − 1 − xc on that token, 0 on the other three.
    assert got[P + "k3_kl"] == pytest.approx((math.exp(xc) - 1 - xc) / 4, rel=1e-5)
    # ppl_ratio: row 0 has d = −x/2 (clamped to ±20), row 1 has d = 0.
    dc = max(-20.0, min(20.0, -x / 2))
    assert got[P + "ppl_ratio"] == pytest.approx((math.exp(dc) + 1.0) / 2, rel=1e-5)
    assert got[P + "chi2_token"] == pytest.approx((math.exp(2 * xc) + 3) / 4 - 1, rel=1e-5)
    assert got[P + "chi2_seq"] == pytest.approx((math.exp(2 * xc) + 1) / 2 - 1, rel=1e-5)
    assert got[P + "kl"] == pytest.approx(-x / 4, rel=1e-5)  # the k1 estimate itself is not clamped


def test_nonfinite_row_is_dropped_and_counted():
    old, roll, mask = _inputs()
    old = torch.cat([old, torch.tensor([[float("nan"), -1.0, -1.0]])])
    roll = torch.cat([roll, torch.tensor([[-1.0, -1.0, -1.0]])])
    mask = torch.cat([mask, torch.tensor([[True, True, False]])])
    got = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask, metrics="all"))
    exp = _expected()
    exp["nonfinite_seq_fraction"] = 1 / 3  # 3 rows with valid tokens in the input, 1 dropped
    _check(got, exp)


def test_all_masked_batch_gives_zero_metrics():
    old, roll, _ = _inputs()
    got = metrics_to_floats(compute_offpolicy_metrics(old, roll, torch.zeros(3, 3, dtype=torch.bool), mismatch_metrics=True))
    assert got == {k: 0.0 for k in got}


def test_mismatch_metrics_stay_finite_on_log_probs_that_are_no_probabilities():
    """Positive log-probs beyond float32's exp range and huge negative ones, with the floor and the ceiling
    off: every metric finite, the log-probs bounded to [−1e4, 0] (0 and 1 as probabilities)."""
    old = torch.tensor([[100.0, -1.0, -1e20], [50.0, -2.0, -3.0]])
    roll = torch.tensor([[100.0, -1.5, -1e20], [49.0, -2.0, -3.0]])
    acc = OffPolicyAccumulator(mismatch_metrics=True, log_prob_floor=None, log_prob_ceiling=None)  # all taken
    acc.update(old, roll, torch.ones(2, 3))
    got = metrics_to_floats(acc.compute())
    assert all(math.isfinite(v) for v in got.values()), got
    assert got[P + "prob_abs_diff_max"] == pytest.approx(math.exp(-1.0) - math.exp(-1.5), rel=1e-6)
    assert got[P + "log_prob_abs_diff_max"] == pytest.approx(1.0)
    # by default −1e20 is an engine's sentinel and a log-prob > 0 no probability: both rows are dropped, counted
    floored = metrics_to_floats(compute_offpolicy_metrics(old, roll, torch.ones(2, 3), metrics=["mismatch", "sentinel"]))
    assert floored[P + "nonfinite_seq_fraction"] == 1.0 and floored[P + "sentinel_token_fraction"] == pytest.approx(1 / 6)
