"""Rejection sampling: every k1/k2/k3 option, ratio bounds, chaining, first-generation modes, veto,
``rollout_rs_*`` metrics and the dtype of the returned mask.

Ratios ρ_t per row (the fourth row is all padding):
    row 0: 1.5, 0.8, 3.0      row 1: 1.0, 0.4      row 2: 1.2, 1.1, 0.9, 2.5
Per token k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ. Expected keep masks below were worked
out on paper from these numbers (e.g. k2(3.0) = 0.603, k3(2.5) = 0.584, ∏ row 0 = 3.6) and are
cross-checked against a direct Python evaluation of the definitions.
"""

import math
import statistics

import pytest
import torch

from rollout_correction_core import ConfigError, RolloutCorrectionConfig, compute_rollout_correction


P = "rollout_corr/"
ROWS = [[1.5, 0.8, 3.0], [1.0, 0.4], [1.2, 1.1, 0.9, 2.5]]
T = 4
N_TOK, N_ROWS = 9, 3


def _k(est, rho):
    lr = math.log(rho)
    return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": rho - 1.0 - lr}[est]


def _ratio_band(thr):
    if isinstance(thr, str) and "_" in thr:
        lo, hi = (float(x) for x in thr.split("_"))
        return lo, hi
    return 1.0 / float(thr), float(thr)


def _row_stat(row, agg, est):
    ks = [_k(est, r) for r in row]
    return {"seq_sum": sum(ks), "seq_mean": sum(ks) / len(ks), "seq_max": max(ks)}[agg]


def _accepts(stat, est, thr):
    if est == "k1":
        lo, hi = _ratio_band(thr)
        return lo <= math.exp(-stat) <= hi  # bounds on the ratio ρ_agg = exp(−k1_agg)
    return stat <= float(thr)


def _reference_keep(name, thr, rows=ROWS):
    """Per-token keep lists from the definitions (token options) or row keep list (sequence options)."""
    agg, est = name.rsplit("_", 1)
    if agg == "token":
        return [[int(_accepts(_k(est, r), est, thr)) for r in row] for row in rows]
    return [int(_accepts(_row_stat(row, agg, est), est, thr)) for row in rows]


def _run(make_batch, rows=ROWS, empty_rows=1, mask_dtype=torch.bool, **cfg):
    old, roll, mask = make_batch(rows, T=T, empty_rows=empty_rows, mask_dtype=mask_dtype)
    return compute_rollout_correction(old, roll, mask, config=RolloutCorrectionConfig(**cfg)), mask


def _mask_from_token_keep(keep, B=4):
    out = torch.zeros(B, T, dtype=torch.bool)
    for i, r in enumerate(keep):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.bool)
    return out


def _mask_from_row_keep(row_keep, rows=ROWS, B=4):
    return _mask_from_token_keep([[k] * len(r) for k, r in zip(row_keep, rows)], B)


TOKEN_CASES = [
    ("token_k1", "0.5_2.0", [[1, 1, 0], [1, 0], [1, 1, 1, 0]]),
    ("token_k1", "0.5_4.0", [[1, 1, 1], [1, 0], [1, 1, 1, 1]]),  # asymmetric: 3.0 kept, 0.4 rejected
    ("token_k1", 2.0, [[1, 1, 0], [1, 0], [1, 1, 1, 0]]),  # one number x means [1/x, x]
    ("token_k1", "2.0", [[1, 1, 0], [1, 0], [1, 1, 1, 0]]),
    ("token_k2", 0.05, [[0, 1, 0], [1, 0], [1, 1, 1, 0]]),
    ("token_k3", 0.35, [[1, 1, 0], [1, 1], [1, 1, 1, 0]]),
]
ROW_CASES = [
    ("seq_sum_k1", "0.3_3.2", [0, 1, 1]),  # products 3.6, 0.4, 2.97
    ("seq_sum_k1", "0.5_4.0", [1, 0, 1]),  # asymmetric: the inverted comparison would give [0, 1, 0]
    ("seq_sum_k2", 0.5, [0, 1, 1]),  # sums 0.711, 0.420, 0.447
    ("seq_sum_k3", 0.5, [0, 1, 0]),  # sums 1.019, 0.316, 0.612
    ("seq_mean_k1", "0.6_1.4", [0, 1, 1]),  # geometric means 1.533, 0.632, 1.313
    ("seq_mean_k2", 0.15, [0, 0, 1]),  # means 0.237, 0.210, 0.112
    ("seq_mean_k3", 0.2, [0, 1, 1]),  # means 0.340, 0.158, 0.153
    ("seq_max_k2", 0.5, [0, 1, 1]),  # maxima 0.603, 0.420, 0.420
    ("seq_max_k3", 0.5, [0, 1, 0]),  # maxima 0.901, 0.316, 0.584
]


@pytest.mark.parametrize("name,thr,keep", TOKEN_CASES)
def test_token_options_mask_tokens(make_batch, name, thr, keep):
    assert _reference_keep(name, thr) == keep
    out, mask = _run(make_batch, rollout_rs=name, rollout_rs_threshold=thr)
    assert torch.equal(out.response_mask, _mask_from_token_keep(keep))


@pytest.mark.parametrize("name,thr,keep", ROW_CASES)
def test_sequence_options_mask_whole_rows(make_batch, name, thr, keep):
    assert _reference_keep(name, thr) == keep
    out, mask = _run(make_batch, rollout_rs=name, rollout_rs_threshold=thr)
    assert torch.equal(out.response_mask, _mask_from_row_keep(keep))


def test_k1_bounds_apply_to_the_ratio_not_to_minus_log_ratio(make_batch):
    # "0.5_4.0": ρ = 3.0 lies in [0.5, 4] → kept; ρ = 0.4 lies outside → rejected. Comparing the
    # bounds against −log ρ (log 0.5 ≤ −log ρ ≤ log 4, i.e. ρ ∈ [0.25, 2]) would do the opposite.
    out, _ = _run(make_batch, rows=[[3.0], [0.4]], empty_rows=0, rollout_rs="token_k1",
                  rollout_rs_threshold="0.5_4.0")
    assert out.response_mask[:, 0].tolist() == [True, False]


def test_rejection_leaves_weights_alone(make_batch):
    base, _ = _run(make_batch, rollout_is="token", rollout_is_threshold=2.0)
    out, _ = _run(make_batch, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_max_k3",
                  rollout_rs_threshold=0.5)
    torch.testing.assert_close(out.weights, base.weights)
    assert not torch.equal(out.response_mask, base.response_mask)


# ---------------------------------------------------------------------------- chaining
def test_chained_options_accept_only_when_all_accept(make_batch):
    out, _ = _run(make_batch, rollout_rs="token_k1,seq_sum_k3", rollout_rs_threshold="0.5_4.0,0.5")
    token_keep = _mask_from_token_keep([[1, 1, 1], [1, 0], [1, 1, 1, 1]])
    row_keep = _mask_from_row_keep([0, 1, 0])
    assert torch.equal(out.response_mask, token_keep & row_keep)
    assert out.response_mask.sum().item() == 1  # only row 1's first token survives
    got = out.metrics_as_floats()
    assert got[P + "rollout_rs_masked_fraction"] == pytest.approx(8 / 9)
    assert got[P + "rollout_rs_seq_masked_fraction"] == pytest.approx(3 / 3)
    assert got[P + "rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 9)
    assert got[P + "rollout_rs_seq_sum_k3_masked_fraction"] == pytest.approx(7 / 9)
    assert got[P + "rollout_rs_seq_sum_k3_seq_masked_fraction"] == pytest.approx(2 / 3)


def test_one_threshold_is_shared_by_all_chained_options(make_batch):
    out, _ = _run(make_batch, rollout_rs="seq_max_k2, seq_sum_k3", rollout_rs_threshold=0.5)
    assert torch.equal(out.response_mask, _mask_from_row_keep([0, 1, 1]) & _mask_from_row_keep([0, 1, 0]))


def test_threshold_count_must_match_options():
    with pytest.raises(ConfigError, match="rollout_rs_threshold.*exactly 2"):
        RolloutCorrectionConfig(rollout_rs="token_k1,seq_sum_k3", rollout_rs_threshold="2.0,0.5,0.1")


# ---------------------------------------------------------------------------- metrics
def _option_metrics(name, thr, rows=ROWS):
    """Every rollout_rs_<name>_* metric, recomputed from the definitions."""
    agg, est = name.rsplit("_", 1)
    if est == "k1":
        lo, hi = _ratio_band(thr)
        s_lo, s_hi = -math.log(hi), -math.log(lo)
    else:
        s_lo, s_hi = None, float(thr)
    if agg == "token":
        per_tok = [[_k(est, r) for r in row] for row in rows]
        flat = [x for r in per_tok for x in r]
        seq = [sum(r) / len(r) for r in per_tok]
        keep = _reference_keep(name, thr, rows)
        masked = sum(1 - k for r in keep for k in r)
        seq_masked = sum(any(k == 0 for k in r) for r in keep)
        extreme, den = flat, len(flat)
    else:
        seq = [_row_stat(row, agg, est) for row in rows]
        flat = [s for s, row in zip(seq, rows) for _ in row]
        keep = _reference_keep(name, thr, rows)
        masked = sum((1 - k) * len(row) for k, row in zip(keep, rows))
        seq_masked = sum(1 - k for k in keep)
        extreme, den = seq, len(seq)
    n = len(flat)
    clamped = [min(max(x, s_lo if s_lo is not None else 0.0), s_hi) for x in flat]
    m = {
        "mean": sum(flat) / n,
        "max": max(extreme),
        "min": min(extreme),
        "fraction_high": sum(x > s_hi for x in extreme) / den,
        "fraction_low": sum(x < s_lo for x in extreme) / den if s_lo is not None else 0.0,
        "std": statistics.pstdev(clamped),  # population std over tokens
        "seq_mean": statistics.mean(seq),
        "seq_std": statistics.stdev(seq),
        "seq_max": max(seq),
        "seq_min": min(seq),
        "seq_max_deviation": max(abs(x) for x in seq),
        "seq_fraction_high": sum(x > s_hi for x in seq) / len(seq),
        "masked_fraction": masked / n,
        "seq_masked_fraction": seq_masked / len(seq),
    }
    if s_lo is not None:
        m["seq_fraction_low"] = sum(x < s_lo for x in seq) / len(seq)
    return {f"rollout_rs_{name}_{k}": v for k, v in m.items()}


@pytest.mark.parametrize("name,thr", [("token_k1", "0.5_2.0"), ("token_k3", 0.35), ("seq_sum_k1", "0.5_4.0"),
                                      ("seq_mean_k3", 0.2), ("seq_max_k2", 0.5)])
def test_per_option_and_global_metrics(make_batch, name, thr):
    out, _ = _run(make_batch, rollout_rs=name, rollout_rs_threshold=thr)  # with an empty 4th row
    got = out.metrics_as_floats()
    expected = _option_metrics(name, thr)
    for k, v in expected.items():
        assert got[P + k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for k in ("masked_fraction", "seq_masked_fraction"):  # one option: the global masks are its own
        assert got[P + f"rollout_rs_{k}"] == pytest.approx(expected[f"rollout_rs_{name}_{k}"])
    if not name.endswith("k1"):
        assert P + f"rollout_rs_{name}_seq_fraction_low" not in got


def test_token_k1_metrics_spot_values(make_batch):
    out, _ = _run(make_batch, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    got = out.metrics_as_floats()
    pre = P + "rollout_rs_token_k1_"
    assert got[pre + "max"] == pytest.approx(-math.log(0.4), rel=1e-5)
    assert got[pre + "min"] == pytest.approx(-math.log(3.0), rel=1e-5)
    assert got[pre + "fraction_high"] == pytest.approx(1 / 9)  # ρ = 0.4 below the band
    assert got[pre + "fraction_low"] == pytest.approx(2 / 9)  # ρ = 3.0 and 2.5 above it
    assert got[pre + "masked_fraction"] == pytest.approx(3 / 9)
    assert got[pre + "seq_masked_fraction"] == pytest.approx(1.0)


# ---------------------------------------------------------------------------- first generation
@pytest.mark.parametrize("cfg,keep", [
    (dict(rollout_rs="token", rollout_rs_threshold=2.0), [[1, 1, 0], [1, 0], [1, 1, 1, 0]]),
    (dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.3),
     [[1, 1, 0], [1, 1], [1, 1, 1, 0]]),
    (dict(rollout_rs="token"), [[1, 1, 0], [1, 0], [1, 1, 1, 0]]),  # upper = rollout_is_threshold = 2
    (dict(rollout_rs="token", rollout_is_threshold=3.5), [[1, 1, 1], [1, 1], [1, 1, 1, 1]]),
])
def test_first_generation_token_mode(make_batch, cfg, keep):
    out, _ = _run(make_batch, **cfg)
    assert torch.equal(out.response_mask, _mask_from_token_keep(keep))


@pytest.mark.parametrize("cfg,row_keep", [
    (dict(rollout_rs="sequence", rollout_rs_threshold=3.2), [0, 1, 1]),  # [0.3125, 3.2] on 3.6, 0.4, 2.97
    (dict(rollout_rs="sequence", rollout_rs_threshold=3.2, rollout_rs_threshold_lower=0.5), [0, 0, 1]),
    (dict(rollout_rs="sequence", rollout_rs_threshold=3.2, rollout_rs_threshold_lower=0.0), [0, 1, 1]),
    (dict(rollout_rs="geometric", rollout_rs_threshold=1.4), [0, 0, 1]),  # [0.714, 1.4] on 1.53, 0.63, 1.31
    (dict(rollout_rs="geometric", rollout_rs_threshold=1.4, rollout_rs_threshold_lower=0.6), [0, 1, 1]),
])
def test_first_generation_sequence_and_geometric_modes(make_batch, cfg, row_keep):
    out, _ = _run(make_batch, **cfg)
    assert torch.equal(out.response_mask, _mask_from_row_keep(row_keep))
    got = out.metrics_as_floats()
    masked = sum((1 - k) * len(r) for k, r in zip(row_keep, ROWS)) / N_TOK
    # First-generation metric names for the same quantities.
    assert got[P + "rollout_is_masked_fraction"] == pytest.approx(masked)
    assert got[P + "rollout_is_seq_masked_fraction"] == pytest.approx(row_keep.count(0) / N_ROWS)
    assert got[P + "rollout_rs_masked_fraction"] == pytest.approx(masked)


# ---------------------------------------------------------------------------- veto
def test_veto_rejects_the_whole_sequence_and_reports_fractions(make_batch):
    rows = [[1.5, 1e-4, 1.0], [1.0, 0.4], [1.2, 1.1, 0.9, 2.5]]
    out, mask = _run(make_batch, rows=rows, rollout_token_veto_threshold=1e-3)
    assert torch.equal(out.response_mask, _mask_from_row_keep([0, 1, 1], rows))
    got = out.metrics_as_floats()
    assert got[P + "rollout_is_veto_fraction"] == pytest.approx(1 / 3)
    assert got[P + "rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 9)
    # Independent of RS: combined with token RS the veto still removes row 0 entirely.
    out, _ = _run(make_batch, rows=rows, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0",
                  rollout_token_veto_threshold=1e-3)
    assert torch.equal(out.response_mask, _mask_from_token_keep([[0, 0, 0], [1, 0], [1, 1, 1, 0]]))


def test_veto_uses_the_unclamped_ratio(make_batch):
    # e^-25 < 1e-10 < e^-20: the clamped ratio (e^-20) would pass the veto, the true one does not.
    out, _ = _run(make_batch, rows=[[math.exp(-25.0), 1.0], [math.exp(-22.0), 1.0]], empty_rows=0,
                  rollout_token_veto_threshold=1e-10)
    assert out.response_mask.tolist() == [[False, False, False, False], [True, True, False, False]]
    got = out.metrics_as_floats()
    assert got[P + "rollout_is_veto_fraction"] == pytest.approx(1 / 2)
    assert got[P + "rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 4)


# ---------------------------------------------------------------------------- mask dtype
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.long])
def test_output_mask_keeps_input_dtype(make_batch, dtype):
    out, mask = _run(make_batch, mask_dtype=dtype, rollout_rs="seq_max_k3", rollout_rs_threshold=0.5)
    assert out.response_mask.dtype == dtype
    expected = _mask_from_row_keep([0, 1, 0]).to(dtype)
    assert torch.equal(out.response_mask, expected)
    # The input mask is not modified in place.
    assert torch.equal(mask, make_batch(ROWS, T=T, empty_rows=1, mask_dtype=dtype)[2])


def test_std_of_identical_token_statistics_is_zero(make_batch):
    # k3 = e − 2 on both tokens: the std is exactly 0 (the core reports ~1.4e-4).
    out, _ = _run(make_batch, rows=[[math.e], [math.e]], empty_rows=0, rollout_rs="token_k3",
                  rollout_rs_threshold=2.0)
    assert out.metrics_as_floats()[P + "rollout_rs_token_k3_std"] == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------------------- probability space
# (π_train(y_t), π_rollout(y_t)) per token; TV = |p − q| and the binary KL
# p log(p/q) + (1 − p) log((1 − p)/(1 − q)) (p = π_rollout, q = π_train) worked out by hand:
#   row 0: TV 0.1, 0.6, 0.05   binary KL 0.0201, 1.0326, 0.0074   (mean 0.3534)
#   row 1: TV 0.0, 0.05        binary KL 0.0, 0.0207              (mean 0.0103)
#   row 2: TV 0.29             binary KL 0.7777
PROBS = [[(0.5, 0.4), (0.9, 0.3), (0.2, 0.25)], [(0.6, 0.6), (0.05, 0.1)], [(0.99, 0.7)]]


def _binary_kl(q, p):
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _prob_batch():
    old, roll, mask = torch.zeros(4, T), torch.zeros(4, T), torch.zeros(4, T, dtype=torch.bool)
    for i, row in enumerate(PROBS):
        for t, (q, p) in enumerate(row):
            old[i, t], roll[i, t], mask[i, t] = math.log(q), math.log(p), True
    old[3], roll[3] = 5.0, float("nan")  # an all-padding row with values that must never count
    return old, roll, mask


PROB_TOKEN_CASES = [("token_tv", 0.2, [[1, 0, 1], [1, 1], [0]]), ("token_binary_kl", 0.05, [[1, 0, 1], [1, 1], [0]])]
PROB_ROW_CASES = [("seq_mean_tv", 0.2, [0, 1, 0]), ("seq_max_tv", 0.3, [0, 1, 1]),
                  ("seq_mean_binary_kl", 0.5, [1, 1, 0]), ("seq_max_binary_kl", 0.5, [0, 1, 0])]


def _prob_reference(name, thr):
    agg, est = {"token_tv": ("token", "tv"), "token_binary_kl": ("token", "binary_kl"),
                "seq_mean_tv": ("seq_mean", "tv"), "seq_max_tv": ("seq_max", "tv"),
                "seq_mean_binary_kl": ("seq_mean", "binary_kl"), "seq_max_binary_kl": ("seq_max", "binary_kl")}[name]
    stat = [[abs(p - q) if est == "tv" else _binary_kl(q, p) for q, p in row] for row in PROBS]
    if agg == "token":
        return [[int(s <= thr) for s in row] for row in stat]
    return [int((sum(row) / len(row) if agg == "seq_mean" else max(row)) <= thr) for row in stat]


@pytest.mark.parametrize("name,thr,keep", PROB_TOKEN_CASES + PROB_ROW_CASES)
def test_probability_space_options(name, thr, keep):
    assert _prob_reference(name, thr) == keep
    out = compute_rollout_correction(*_prob_batch(), config=RolloutCorrectionConfig(rollout_rs=name,
                                                                                    rollout_rs_threshold=thr))
    rows = PROBS
    expected = (_mask_from_token_keep(keep) if name.startswith("token")
                else _mask_from_token_keep([[k] * len(r) for k, r in zip(keep, rows)]))
    assert torch.equal(out.response_mask, expected)
    got = out.metrics_as_floats()
    n_tok = sum(len(r) for r in rows)
    rejected = sum(len(r) for r in rows) - int(expected.sum())
    assert got[P + f"rollout_rs_{name}_masked_fraction"] == pytest.approx(rejected / n_tok)
    tv_or_kl = [[abs(p - q) if name.endswith("tv") else _binary_kl(q, p) for q, p in r] for r in rows]
    if name.startswith("token"):  # the option's mean is the token mean of the statistic
        assert got[P + f"rollout_rs_{name}_mean"] == pytest.approx(sum(map(sum, tv_or_kl)) / n_tok, rel=1e-5)
        assert got[P + f"rollout_rs_{name}_max"] == pytest.approx(max(map(max, tv_or_kl)), rel=1e-5)


def test_probability_space_options_need_the_log_probs():
    from rollout_correction_core._src.logratio import LogRatioBatch
    from rollout_correction_core._src.rejection import token_divergence

    batch = LogRatioBatch.from_log_ratio(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="need the log-probs"):
        token_divergence(batch, "tv")
    with pytest.raises(ConfigError, match="takes a single upper bound"):
        RolloutCorrectionConfig(rollout_rs="token_tv", rollout_rs_threshold="0.1_0.2")
    with pytest.raises(ConfigError, match="unknown option 'seq_sum_tv'"):
        RolloutCorrectionConfig(rollout_rs="seq_sum_tv", rollout_rs_threshold=0.1)


def test_high_side_veto_rejects_the_sequence_of_a_catastrophic_high_ratio(make_batch):
    rows = [[1.5, 150.0, 1.0], [1.0, 0.4], [1.2, 1.1, 0.9, 2.5]]
    out, _ = _run(make_batch, rows=rows, rollout_token_veto_threshold_high=100.0)
    assert torch.equal(out.response_mask, _mask_from_row_keep([0, 1, 1], rows))
    got = out.metrics_as_floats()
    assert got[P + "rollout_is_veto_high_fraction"] == pytest.approx(1 / 3)
    assert got[P + "rollout_is_catastrophic_high_token_fraction"] == pytest.approx(1 / 9)
    assert P + "rollout_is_veto_fraction" not in got
    # Both sides: row 1's 0.4 < 0.5 is vetoed too; the unclamped ratio counts (e^25 > e^22 > e^20).
    rows = [[1.5, math.exp(25.0), 1.0], [1.0, 0.4], [1.2, 1.1, 0.9, 2.5]]
    out, _ = _run(make_batch, rows=rows, rollout_token_veto_threshold=0.5,
                  rollout_token_veto_threshold_high=math.exp(22.0))
    assert torch.equal(out.response_mask, _mask_from_row_keep([0, 0, 1], rows))
    with pytest.raises(ConfigError, match="must exceed rollout_token_veto_threshold"):
        RolloutCorrectionConfig(rollout_token_veto_threshold=2.0, rollout_token_veto_threshold_high=1.5)
    with pytest.raises(ConfigError, match="rollout_token_veto_threshold_high"):
        RolloutCorrectionConfig(rollout_token_veto_threshold_high=0.0)
