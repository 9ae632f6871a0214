"""IS weights and every ``rollout_is_*`` metric against values computed by hand.

Each case uses three short rows of hand-picked ratios ρ_t (valid tokens) padded with ρ = 100, so
a leak of padding into weights or metrics would be visible. Expected numbers are derived here
with ``math`` / ``statistics`` on Python floats from the same ratios.
"""

import math
import statistics

import pytest
import torch

from rollout_correction_core import RolloutCorrectionConfig, compute_rollout_correction


P = "rollout_corr/"
ROWS = [[3.0, 0.6, 1.5], [0.25, 0.8], [0.4, 1.25, 2.5, 1.0]]
T = 4
N_TOK = 9


def _run(make_batch, rows=ROWS, empty_rows=0, **cfg):
    old, roll, mask = make_batch(rows, T=T, empty_rows=empty_rows)
    return compute_rollout_correction(old, roll, mask, config=RolloutCorrectionConfig(**cfg))


def _padded(rows_of_weights, B=None):
    B = B or len(rows_of_weights)
    out = torch.zeros(B, T)
    for i, r in enumerate(rows_of_weights):
        out[i, : len(r)] = torch.tensor(r)
    return out


def _close(actual, expected, rel=1e-5, abs_=1e-7):
    assert actual == pytest.approx(expected, rel=rel, abs=abs_)


def _moments_and_seq(token_w, seq, seq_raw, U, L):
    """Entries shared by every level: mean / std / ESS over valid tokens and per-row statistics."""
    mean = statistics.fmean(token_w)
    return {
        "rollout_is_mean": mean,
        "rollout_is_std": statistics.pstdev(token_w),
        "rollout_is_eff_sample_size": (mean + 1e-8) ** 2 / statistics.fmean(x * x for x in token_w),
        "rollout_is_seq_mean": statistics.mean(seq),
        "rollout_is_seq_std": statistics.stdev(seq),
        "rollout_is_seq_max": max(seq),
        "rollout_is_seq_min": min(seq),
        "rollout_is_seq_max_deviation": max(abs(x - 1.0) for x in seq),
        "rollout_is_seq_fraction_high": sum(x > U for x in seq_raw) / len(seq),
        "rollout_is_seq_fraction_low": sum(x < L for x in seq_raw) / len(seq),
    }


def _token_level_metrics(w, raw, rows_w, rows_raw, U, L):
    """rollout_is_* metrics from flat token weights and per-row lists (independent recomputation)."""
    n = len(w)
    seq = [sum(r) / len(r) for r in rows_w]
    seq_raw = [sum(r) / len(r) for r in rows_raw]
    out = _moments_and_seq(w, seq, seq_raw, U, L)
    out.update({
        "rollout_is_max": max(w),
        "rollout_is_min": min(w),
        "rollout_is_ratio_fraction_high": sum(x > U for x in raw) / n,
        "rollout_is_ratio_fraction_low": sum(x < L for x in raw) / n,
    })
    return out


def _seq_level_metrics(row_w, row_raw, lengths, U, L):
    """rollout_is_* metrics for sequence/geometric weights (one weight per row, broadcast)."""
    token_w = [w for w, k in zip(row_w, lengths) for _ in range(k)]  # broadcast over each row's tokens
    out = _moments_and_seq(token_w, row_w, row_raw, U, L)
    out.update({
        "rollout_is_max": max(row_raw),  # from the unbounded row weight
        "rollout_is_min": min(row_raw),
        "rollout_is_ratio_fraction_high": sum(x > U for x in row_raw) / len(row_raw),
        "rollout_is_ratio_fraction_low": sum(x < L for x in row_raw) / len(row_raw),
    })
    return out


def _check_metrics(out, expected):
    got = out.metrics_as_floats()
    for k, v in expected.items():
        assert got[P + k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


# ---------------------------------------------------------------------------- token level
def test_token_truncate_weights_and_every_metric(make_batch):
    # C = 1.6: ratios above 1.6 are cut to 1.6; lower metric bound 1/1.6 = 0.625.
    out = _run(make_batch, rollout_is="token", rollout_is_threshold=1.6)
    rows_w = [[1.6, 0.6, 1.5], [0.25, 0.8], [0.4, 1.25, 1.6, 1.0]]
    torch.testing.assert_close(out.weights, _padded(rows_w))
    assert out.weights.dtype == torch.float32
    flat_w = [x for r in rows_w for x in r]
    flat_raw = [x for r in ROWS for x in r]
    exp = _token_level_metrics(flat_w, flat_raw, rows_w, ROWS, U=1.6, L=1 / 1.6)
    # Spot values worked out on paper for this batch.
    assert exp["rollout_is_ratio_fraction_high"] == 2 / 9  # 3.0 and 2.5
    assert exp["rollout_is_ratio_fraction_low"] == 3 / 9  # 0.6, 0.25, 0.4
    assert exp["rollout_is_seq_fraction_high"] == 1 / 3  # row 0 raw mean 1.7
    assert exp["rollout_is_seq_fraction_low"] == 1 / 3  # row 1 raw mean 0.525
    _close(exp["rollout_is_mean"], 9.0 / 9)
    _check_metrics(out, exp)
    # An all-padding row (holding ratio 100) changes no metric: it is not a sequence.
    _check_metrics(_run(make_batch, empty_rows=2, rollout_is="token", rollout_is_threshold=1.6), exp)
    assert P + "rollout_is_oob_ratio" not in out.metrics
    assert P + "rollout_is_batch_norm_factor" not in out.metrics
    # The response mask is never touched by IS weighting.
    assert torch.equal(out.response_mask, make_batch(ROWS, T=T)[2])


def test_token_icepop_zeroes_weights_outside_band_and_keeps_mask(make_batch):
    out = _run(make_batch, rollout_is="token", rollout_is_threshold="0.5_2.0")
    rows_w = [[0.0, 0.6, 1.5], [0.0, 0.8], [0.0, 1.25, 0.0, 1.0]]
    torch.testing.assert_close(out.weights, _padded(rows_w))
    assert torch.equal(out.response_mask, make_batch(ROWS, T=T)[2])
    got = out.metrics_as_floats()
    _close(got[P + "rollout_is_oob_ratio"], 4 / 9)  # 3.0, 0.25, 0.4, 2.5
    _close(got[P + "rollout_is_ratio_fraction_low"], 2 / 9)  # IcePop lower 0.5: 0.25, 0.4
    _close(got[P + "rollout_is_ratio_fraction_high"], 2 / 9)
    _close(got[P + "rollout_is_mean"], (0.6 + 1.5 + 0.8 + 1.25 + 1.0) / 9)
    _close(got[P + "rollout_is_min"], 0.0)


def test_token_clip_mode_clamps_both_sides(make_batch):
    out = _run(make_batch, rollout_is="token", rollout_is_threshold=1.6, rollout_is_mode="clip")
    lo = 1 / 1.6  # default lower bound
    torch.testing.assert_close(out.weights, _padded([[1.6, lo, 1.5], [lo, 0.8], [lo, 1.25, 1.6, 1.0]]))
    out = _run(make_batch, rollout_is="token", rollout_is_threshold=1.6, rollout_is_mode="clip",
               rollout_is_threshold_lower=0.3)
    torch.testing.assert_close(out.weights, _padded([[1.6, 0.6, 1.5], [0.3, 0.8], [0.4, 1.25, 1.6, 1.0]]))
    # "lo_hi" with mode clip uses the string's bounds.
    out = _run(make_batch, rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_mode="clip")
    torch.testing.assert_close(out.weights, _padded([[2.0, 0.6, 1.5], [0.5, 0.8], [0.5, 1.25, 2.0, 1.0]]))


def test_numeric_threshold_with_mask_mode_is_icepop_with_reciprocal_lower(make_batch):
    out = _run(make_batch, rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="mask")
    torch.testing.assert_close(out.weights, _padded([[0.0, 0.6, 1.5], [0.0, 0.8], [0.0, 1.25, 0.0, 1.0]]))
    _close(out.metrics_as_floats()[P + "rollout_is_oob_ratio"], 4 / 9)


# ---------------------------------------------------------------------------- sequence level
def test_sequence_truncate_weights_and_every_metric(make_batch):
    out = _run(make_batch, rollout_is="sequence", rollout_is_threshold=1.6)
    raw = [3.0 * 0.6 * 1.5, 0.25 * 0.8, 0.4 * 1.25 * 2.5 * 1.0]  # 2.7, 0.2, 1.25
    row_w = [min(x, 1.6) for x in raw]
    torch.testing.assert_close(out.weights, _padded([[row_w[0]] * 3, [row_w[1]] * 2, [row_w[2]] * 4]))
    exp = _seq_level_metrics(row_w, raw, [3, 2, 4], U=1.6, L=1 / 1.6)
    _close(exp["rollout_is_mean"], (3 * 1.6 + 2 * 0.2 + 4 * 1.25) / 9)
    _close(exp["rollout_is_max"], 2.7)  # the untruncated product
    _close(exp["rollout_is_seq_max_deviation"], 0.8)  # |0.2 - 1|
    _check_metrics(out, exp)
    _check_metrics(_run(make_batch, empty_rows=1, rollout_is="sequence", rollout_is_threshold=1.6), exp)


def test_geometric_truncate_weights_and_metrics(make_batch):
    out = _run(make_batch, rollout_is="geometric", rollout_is_threshold=1.2)
    raw = [2.7 ** (1 / 3), 0.2 ** (1 / 2), 1.25 ** (1 / 4)]  # 1.392, 0.447, 1.057
    row_w = [1.2, raw[1], raw[2]]
    torch.testing.assert_close(out.weights, _padded([[row_w[0]] * 3, [row_w[1]] * 2, [row_w[2]] * 4]))
    _check_metrics(out, _seq_level_metrics(row_w, raw, [3, 2, 4], U=1.2, L=1 / 1.2))


def test_sequence_and_geometric_icepop(make_batch):
    out = _run(make_batch, rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(out.weights, _padded([[0.0] * 3, [0.0] * 2, [1.25] * 4]))
    assert torch.equal(out.response_mask, make_batch(ROWS, T=T)[2])
    _close(out.metrics_as_floats()[P + "rollout_is_oob_ratio"], 5 / 9)  # tokens of rows 0 and 1
    out = _run(make_batch, rollout_is="geometric", rollout_is_threshold="0.5_1.2")
    g = 1.25 ** 0.25
    torch.testing.assert_close(out.weights, _padded([[0.0] * 3, [0.0] * 2, [g] * 4]))
    _close(out.metrics_as_floats()[P + "rollout_is_oob_ratio"], 5 / 9)


def test_sequence_clip_mode(make_batch):
    out = _run(make_batch, rollout_is="sequence", rollout_is_threshold=1.6, rollout_is_mode="clip")
    torch.testing.assert_close(out.weights, _padded([[1.6] * 3, [1 / 1.6] * 2, [1.25] * 4]))


# ---------------------------------------------------------------------------- safety clamp
def test_log_space_clamp_bounds_token_and_sequence_weights(make_batch):
    e20 = math.exp(20.0)
    rows = [[math.exp(30.0), math.exp(-30.0)], [math.exp(12.0), math.exp(12.0)], [1.0]]
    out = _run(make_batch, rows=rows, rollout_is="token", rollout_is_threshold=1e12)
    w = out.weights
    assert w[0, 0].item() == pytest.approx(e20, rel=1e-5)
    assert w[1, 0].item() == pytest.approx(math.exp(12.0), rel=1e-5)
    assert out.metrics_as_floats()[P + "rollout_is_max"] == pytest.approx(e20, rel=1e-5)
    # Sequence: row 0 sums to 0 (weight 1); row 1 sums to 24, clamped to 20 before exp.
    out = _run(make_batch, rows=rows, rollout_is="sequence", rollout_is_threshold=1e12)
    torch.testing.assert_close(out.weights[:, 0], torch.tensor([1.0, e20, 1.0]), rtol=1e-5, atol=0)
    got = out.metrics_as_floats()
    assert got[P + "rollout_is_max"] == pytest.approx(e20, rel=1e-5)
    assert all(math.isfinite(v) for v in got.values())
    # A very negative row: the weight is e^-20, never 0/NaN from underflow of exp(-60).
    out = _run(make_batch, rows=[[math.exp(-30.0), math.exp(-30.0)], [1.0]], rollout_is="sequence",
               rollout_is_threshold=2.0)
    assert out.weights[0, 0].item() == pytest.approx(math.exp(-20.0), rel=1e-5)
    got = out.metrics_as_floats()
    assert 0.0 <= got[P + "rollout_is_min"] <= math.exp(-20.0) * (1 + 1e-6)
    assert all(math.isfinite(v) for v in got.values())


def test_small_token_weights_keep_relative_precision(make_batch):
    # ρ = 1e-6 and ρ = e^-30 (clamped to e^-20): weights must be 1e-6 and 2.06e-9, not 0.
    out = _run(make_batch, rows=[[1e-6, math.exp(-30.0)]], rollout_is="token", rollout_is_threshold=1e12)
    assert out.weights[0, 0].item() == pytest.approx(1e-6, rel=1e-4)
    assert out.weights[0, 1].item() == pytest.approx(math.exp(-20.0), rel=1e-4)


# ---------------------------------------------------------------------------- padding, grad
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_weights_are_zero_on_padding_and_empty_rows_and_detached(make_batch, level):
    old, roll, mask = make_batch(ROWS, T=T, empty_rows=1)
    old = old.clone().requires_grad_(True)
    out = compute_rollout_correction(old, roll, mask, config=RolloutCorrectionConfig(rollout_is=level))
    assert not out.weights.requires_grad and out.weights.grad_fn is None
    assert torch.all(out.weights[~mask] == 0)
    assert torch.all(out.weights[mask] > 0)
    assert torch.all(out.weights[3] == 0)


# ---------------------------------------------------------------------------- batch norm
def test_token_batch_normalisation_over_valid_tokens(make_batch):
    out = _run(make_batch, rollout_is="token", rollout_is_threshold=1.6, rollout_is_batch_normalize=True,
               empty_rows=1)
    rows_w = [[1.6, 0.6, 1.5], [0.25, 0.8], [0.4, 1.25, 1.6, 1.0]]
    factor = sum(x for r in rows_w for x in r) / N_TOK  # after truncation, over the 9 valid tokens
    expected = _padded([[x / factor for x in r] for r in rows_w], B=4)
    torch.testing.assert_close(out.weights, expected)
    got = out.metrics_as_floats()
    _close(got[P + "rollout_is_batch_norm_factor"], factor)
    _close(got[P + "rollout_is_mean"], factor)  # metrics describe the weights before normalisation
    _close(out.weights[make_batch(ROWS, T=T, empty_rows=1)[2]].mean().item(), 1.0)


@pytest.mark.parametrize("level,raw", [
    ("sequence", [2.7, 0.2, 1.25]),
    ("geometric", [2.7 ** (1 / 3), 0.2 ** 0.5, 1.25 ** 0.25]),
])
def test_sequence_batch_normalisation_over_nonempty_rows(make_batch, level, raw):
    # An all-padding fourth row must not count in the mean over sequences.
    out = _run(make_batch, rollout_is=level, rollout_is_threshold=1.6, rollout_is_batch_normalize=True,
               empty_rows=1)
    row_w = [min(x, 1.6) for x in raw]
    factor = sum(row_w) / 3
    expected = _padded([[row_w[0] / factor] * 3, [row_w[1] / factor] * 2, [row_w[2] / factor] * 4], B=4)
    torch.testing.assert_close(out.weights, expected)
    _close(out.metrics_as_floats()[P + "rollout_is_batch_norm_factor"], factor)
    _close(out.weights[:3, 0].mean().item(), 1.0)  # mean 1 over the three non-empty rows


def test_batch_normalisation_skipped_when_mean_is_tiny(make_batch):
    # Every weight falls outside the IcePop band → all weights 0, factor reported as 1, no NaN.
    out = _run(make_batch, rows=[[3.0, 4.0], [5.0]], rollout_is="token", rollout_is_threshold="0.5_2.0",
               rollout_is_batch_normalize=True)
    assert torch.all(out.weights == 0)
    got = out.metrics_as_floats()
    assert got[P + "rollout_is_batch_norm_factor"] == 1.0
    assert got[P + "rollout_is_eff_sample_size"] == 0.0
    assert all(math.isfinite(v) for v in got.values())


def test_ess_of_uniform_weights_is_one_and_of_one_spike_is_small(make_batch):
    out = _run(make_batch, rows=[[1.5, 1.5], [1.5, 1.5]], rollout_is="token", rollout_is_threshold=10.0)
    _close(out.metrics_as_floats()[P + "rollout_is_eff_sample_size"], 1.0)
    # Weights [9, 1, 1, 1]: E[w] = 3, E[w²] = 21 → ESS = 9/21.
    out = _run(make_batch, rows=[[9.0, 1.0], [1.0, 1.0]], rollout_is="token", rollout_is_threshold=10.0)
    _close(out.metrics_as_floats()[P + "rollout_is_eff_sample_size"], (3 + 1e-8) ** 2 / 21)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_std_of_identical_weights_is_zero(make_batch, level):
    # Two tokens / rows with the same weight e: the spread is exactly 0. Squaring in float32
    # before the float64 sum leaves ~5e-7 in E[w²] − E[w]², i.e. a std of ~3e-4.
    out = _run(make_batch, rows=[[math.e], [math.e]], rollout_is=level, rollout_is_threshold=3.0)
    assert out.metrics_as_floats()[P + "rollout_is_std"] == pytest.approx(0.0, abs=1e-6)
