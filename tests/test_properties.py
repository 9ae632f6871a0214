"""Property tests (hypothesis) of the core: weights, truncation bounds, AND-composition of rejection
options, reciprocal-bound symmetry, the REINFORCE gradient, chunk-independence of metrics, and
weights / masks / metrics / policy losses against a float-by-float evaluation of their definitions."""

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_correction_core import (Aggregation, PolicyLoss, RolloutCorrectionConfig, compute_policy_loss,
                                     compute_rollout_correction)
from rollout_correction_core._src.config import RS_OPTIONS
from rollout_correction_core._src.correction import CorrectionAccumulator
from rollout_correction_core._src.metrics import OffPolicyAccumulator, compute_offpolicy_metrics


FAST = settings(max_examples=150, deadline=None)
LEVELS = ["token", "sequence", "geometric"]
K1_OPTIONS = ["token_k1", "seq_sum_k1", "seq_mean_k1"]
PROB_OPTIONS = ["token_tv", "seq_mean_tv", "seq_max_tv", "token_binary_kl", "seq_mean_binary_kl", "seq_max_binary_kl",
                "token_kpop", "seq_sum_kpop", "seq_mean_kpop", "seq_max_kpop"]
LOGPROB_ERROR = ["seq_logprob_error"]  # bounds ≥ 1; its metrics: tests/test_rejection_kpop.py
ALL_OPTIONS = K1_OPTIONS + ["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                            "seq_max_k2", "seq_max_k3"] + PROB_OPTIONS + LOGPROB_ERROR
DP_OPTIONS = ["token_dp", "seq_sum_dp", "seq_mean_dp"]  # signed Δp = p_train − p_rollout bands
PROB_OPTIONS, ALL_OPTIONS = PROB_OPTIONS + DP_OPTIONS, ALL_OPTIONS + DP_OPTIONS

log_ratio_values = st.one_of(
    st.floats(-3.0, 3.0, allow_nan=False, width=32),
    st.sampled_from([-30.0, -21.0, 0.0, 21.0, 30.0]),  # beyond the ±20 safety clamp
)


@st.composite
def batches(draw, max_b=5, max_t=6, min_b=1):
    """(old, rollout, mask) with arbitrary log-ratios, some empty rows and garbage padding."""
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(1, max_t))
    lr = torch.tensor(draw(st.lists(log_ratio_values, min_size=B * T, max_size=B * T))).view(B, T)
    logp = st.floats(-6.0, 0.0, width=32)
    rollout = torch.tensor(draw(st.lists(logp, min_size=B * T, max_size=B * T))).view(B, T)
    rollout = rollout - lr.clamp_min(0.0).amax()  # both log-probs ≤ 0, whatever the log-ratio
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    old = torch.where(mask, rollout + lr, torch.tensor(float("nan")))  # NaN at padding must never matter
    return old, rollout, mask


@st.composite
def is_configs(draw):
    level = draw(st.sampled_from(LEVELS))
    kind = draw(st.sampled_from(["truncate", "icepop", "clip"]))
    hi = draw(st.floats(1.05, 5.0))
    lo = draw(st.floats(0.05, 0.95))
    if kind == "truncate":
        return RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=hi), (None, hi)
    if kind == "icepop":
        return RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=f"{lo}_{hi}"), (lo, hi)
    return RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=hi, rollout_is_mode="clip",
                                   rollout_is_threshold_lower=lo), (lo, hi)


def _threshold(draw, option):
    if option.endswith("_dp"):
        return f"{-draw(st.floats(0.0, 0.6)):.3f}_{draw(st.floats(0.0, 0.6)):.3f}"
    if option.endswith("k1"):
        return f"{draw(st.floats(0.1, 0.99)):.3f}_{draw(st.floats(1.01, 8.0)):.3f}"
    if option.endswith("logprob_error"):
        return f"{draw(st.floats(1.0, 3.0)):.4f}"
    return f"{draw(st.floats(0.001, 2.0)):.4f}"


@FAST
@given(batches(), is_configs())
def test_weights_nonnegative_zero_on_padding_and_within_bounds(batch, cfg_bounds):
    old, rollout, mask = batch
    cfg, (lo, hi) = cfg_bounds
    w = compute_rollout_correction(old, rollout, mask, config=cfg).weights
    assert torch.isfinite(w).all() and (w >= 0).all()
    assert torch.all(w[~mask] == 0)
    valid = w[mask]
    tol = 1e-6 * hi
    if cfg.is_spec.mode == "truncate":
        assert (valid <= hi + tol).all()
        assert (valid >= math.exp(-20) * (1 - 1e-4)).all()
    elif cfg.is_spec.mode == "mask":  # IcePop: w ∈ {0} ∪ [lo, hi]
        assert ((valid == 0) | ((valid >= lo * (1 - 1e-6)) & (valid <= hi + tol))).all()
    else:
        assert ((valid >= lo * (1 - 1e-6)) & (valid <= hi + tol)).all()


def _mean_weight(w, mask, level):
    """Mean over valid tokens (token level) or over rows with ≥ 1 valid token (one weight per row)."""
    if level == "token":
        return w[mask].mean().item()
    rows = mask.any(-1)
    return (w.sum(-1)[rows] / mask.sum(-1)[rows]).mean().item()


@FAST
@given(batches(), st.sampled_from(LEVELS), st.floats(1.05, 5.0))
def test_batch_normalised_weights_have_mean_one(batch, level, cap):
    old, rollout, mask = batch
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=cap)
    raw = compute_rollout_correction(old, rollout, mask, config=cfg).weights.double()
    out = compute_rollout_correction(old, rollout, mask, config=cfg.replace(rollout_is_batch_normalize=True))
    w = out.weights.double()
    if not mask.any():
        assert torch.all(w == 0)
        return
    raw_mean = _mean_weight(raw, mask, level)
    factor = out.metrics_as_floats()["rollout_corr/rollout_is_batch_norm_factor"]
    if raw_mean > 1e-8:  # documented: normalise only when the mean exceeds 1e-8
        assert abs(_mean_weight(w, mask, level) - 1.0) < 1e-5
        assert abs(factor - raw_mean) <= 1e-5 * raw_mean
    else:
        assert torch.equal(w, raw) and factor == 1.0


@FAST
@given(batches(), st.data())
def test_rejection_options_compose_as_and(batch, data):
    old, rollout, mask = batch
    a, b = data.draw(st.lists(st.sampled_from(ALL_OPTIONS), min_size=2, max_size=2, unique=True))
    ta, tb = _threshold(data.draw, a), _threshold(data.draw, b)

    def keep(rs, thr):
        return compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(
            rollout_rs=rs, rollout_rs_threshold=thr)).response_mask

    assert torch.equal(keep(f"{a},{b}", f"{ta},{tb}"), keep(a, ta) & keep(b, tb))
    assert torch.equal(keep(a, ta) & ~mask, torch.zeros_like(mask))  # rejection never adds tokens


@FAST
@given(batches(), st.sampled_from(K1_OPTIONS), st.integers(10, 99), st.integers(101, 800))
def test_reciprocal_bounds_mirror_acceptance_when_swapping_policies(batch, option, lo_pct, hi_pct):
    # Accepting ρ in [lo, hi] is the same event as accepting 1/ρ in [1/hi, 1/lo].
    old, rollout, mask = batch
    lo, hi = lo_pct / 100, hi_pct / 100
    fwd = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(
        rollout_rs=option, rollout_rs_threshold=f"{lo}_{hi}")).response_mask
    new_old = torch.where(mask, rollout, old)  # swapped on valid tokens; padding keeps its NaN
    new_rollout = torch.where(mask, old, rollout)
    bwd = compute_rollout_correction(new_old, new_rollout, mask, config=RolloutCorrectionConfig(
        rollout_rs=option, rollout_rs_threshold=f"{1 / hi!r}_{1 / lo!r}")).response_mask
    assert torch.equal(fwd, bwd)


@FAST
@given(batches(max_b=4, max_t=5), st.sampled_from(LEVELS), st.floats(1.05, 10.0), st.integers(0, 2 ** 16))
def test_reinforce_gradient_is_minus_weight_times_advantage_times_score(batch, level, cap, seed):
    old, rollout, mask = batch
    B, T = mask.shape
    V = 3
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    rollout = rollout.double().clamp(max=-0.01)
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=cap, bypass_mode=True,
                                  loss_type="reinforce")
    loss, _ = compute_policy_loss(log_prob, None, adv, mask, config=cfg, rollout_log_prob=rollout)
    loss.backward()
    # Closed form: ∇ = −Σ_t sg(w_t) A_t (onehot(y_t) − softmax_t) / N_tok.
    w = compute_rollout_correction(log_prob.detach(), rollout, mask, config=cfg).weights.double()
    probs = torch.softmax(logits.detach(), -1)
    score = torch.nn.functional.one_hot(tokens, V).double() - probs
    coef = torch.where(mask, -w * adv, 0.0) / max(int(mask.sum()), 1)
    torch.testing.assert_close(logits.grad, coef.unsqueeze(-1) * score, rtol=1e-5, atol=1e-6)


@st.composite
def any_config(draw):
    cfg, _ = draw(is_configs())
    extra = {"rollout_is_batch_normalize": draw(st.booleans())}
    if draw(st.booleans()):
        opts = draw(st.lists(st.sampled_from(ALL_OPTIONS), min_size=1, max_size=2, unique=True))
        extra["rollout_rs"] = ",".join(opts)
        extra["rollout_rs_threshold"] = ",".join(_threshold(draw, o) for o in opts)
    if draw(st.booleans()):
        extra["rollout_token_veto_threshold"] = draw(st.sampled_from([1e-3, 0.1, 0.5]))
    if draw(st.booleans()):
        extra["rollout_token_veto_threshold_high"] = draw(st.sampled_from([2.0, 10.0, 1e3]))
    return cfg.replace(**extra)


@FAST
@given(batches(min_b=2, max_b=6), any_config(), st.data())
def test_chunked_accumulation_equals_one_call(batch, cfg, data):
    old, rollout, mask = batch
    cut = data.draw(st.integers(1, mask.shape[0] - 1))
    one = compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats()
    acc = CorrectionAccumulator(cfg)
    acc.update(old[:cut], rollout[:cut], mask[:cut])
    acc.update(old[cut:], rollout[cut:], mask[cut:])
    chunked = {k: float(v) for k, v in acc.compute().items()}
    assert chunked.keys() == one.keys()
    for k, v in one.items():
        assert math.isfinite(v), k
        assert chunked[k] == _approx(v), k
    off = OffPolicyAccumulator()
    off.update(old[:cut], rollout[:cut], mask[:cut])
    off.update(old[cut:], rollout[cut:], mask[cut:])
    whole = compute_offpolicy_metrics(old, rollout, mask)
    for k, v in off.compute().items():
        assert float(v) == _approx(float(whole[k])), k


def _approx(v):
    return pytest.approx(v, rel=1e-6, abs=1e-9)


@FAST
@given(batches(), st.sampled_from(RolloutCorrectionConfig.preset_names()))
def test_every_preset_gives_finite_outputs(batch, preset):
    old, rollout, mask = batch
    out = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.from_preset(preset))
    assert all(math.isfinite(v) for v in out.metrics_as_floats().values())
    assert torch.equal(out.response_mask & ~mask, torch.zeros_like(mask))
    if out.weights is not None:
        assert torch.isfinite(out.weights).all() and (out.weights >= 0).all()
        assert torch.all(out.weights[~mask] == 0)


def _prob(log_p):
    """π = exp(log π) as the library holds it (float32), clamped to [1e-6, 1 − 1e-6] in float32."""
    x = torch.tensor(log_p, dtype=torch.float32).exp().clamp(1e-6, 1 - 1e-6)
    return float(x)


def _direct_weights_and_keep(lr_rows, cfg, lp_rows=None):
    """Weights and keep masks from the definitions, one Python float at a time (no tensors but the
    float32 exp of :func:`_prob`); ``lp_rows``: (log π_train, log π_rollout) of the valid tokens."""
    spec = cfg.is_spec

    def bound(w):
        if spec.mode == "truncate":
            return min(w, spec.upper)
        if spec.mode == "clip":
            return min(max(w, spec.lower), spec.upper)
        return w if spec.lower <= w <= spec.upper else 0.0

    def k(est, x, lqp):
        if est == "dp":  # exp in float32, as the library holds the probabilities
            return float(torch.tensor(lqp[0]).exp()) - float(torch.tensor(lqp[1]).exp())
        if est in ("tv", "binary_kl", "kpop"):
            q, p = _prob(lqp[0]), _prob(lqp[1])
            kl = lambda a, b: a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))  # noqa: E731
            return abs(p - q) if est == "tv" else kl(p, q) if est == "binary_kl" else max(kl(p, q), kl(q, p))
        x = max(-20.0, min(20.0, x))
        if est == "logprob_error":
            return math.exp(abs(x))
        return {"k1": -x, "k2": 0.5 * x * x, "k3": math.expm1(x) - x}[est]

    def accepts(opt, s):
        return (opt.stat_lower is None or s >= opt.stat_lower) and s <= opt.stat_upper

    weights, keep, near = [], [], []
    for i, xs in enumerate(lr_rows):  # xs: log ρ of the row's valid tokens, in order
        lps = lp_rows[i] if lp_rows is not None else [None] * len(xs)
        n = len(xs)
        if spec is None:
            w = None
        elif spec.level == "token":
            w = [bound(math.exp(max(-20.0, min(20.0, x)))) for x in xs]
        else:
            agg = sum(xs) if spec.level == "sequence" else (sum(xs) / n if n else 0.0)
            w = [bound(math.exp(max(-20.0, min(20.0, agg))))] * n
        tok = [True] * n
        row = True
        for opt in cfg.rs_options:
            ks = [k(opt.estimator, x, lqp) for x, lqp in zip(xs, lps)]
            if opt.agg == "token":
                tok = [t and accepts(opt, s) for t, s in zip(tok, ks)]
                stats = ks
            else:
                s = {"seq_sum": sum(ks), "seq_mean": sum(ks) / max(n, 1), "seq_max": max(ks, default=0.0)}[opt.agg]
                row = row and accepts(opt, s)
                stats = [s]
            bounds = [b for b in (opt.stat_lower, opt.stat_upper) if b is not None and math.isfinite(b)]
            near += [abs(s - b) < 1e-4 * (1 + abs(b)) for s in stats for b in bounds]
        if cfg.rollout_token_veto_threshold is not None:
            row = row and not any(x < math.log(cfg.rollout_token_veto_threshold) for x in xs)
        if cfg.rollout_token_veto_threshold_high is not None:
            row = row and not any(x > math.log(cfg.rollout_token_veto_threshold_high) for x in xs)
        weights.append(w)
        keep.append([t and row for t in tok])
    return weights, keep, any(near)


@FAST
@given(batches(), any_config())
def test_weights_and_mask_match_a_direct_evaluation_of_the_definitions(batch, cfg):
    old, rollout, mask = batch
    cfg = cfg.replace(rollout_is_batch_normalize=False)
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    lr = (old - rollout).tolist()  # the fp32 log-ratio the library also starts from
    rows = [[x for x, m in zip(r, mr) if m] for r, mr in zip(lr, mask.tolist())]
    lps = [[(a, b) for a, b, m in zip(ro, rr, mr) if m] for ro, rr, mr in zip(old.tolist(), rollout.tolist(),
                                                                               mask.tolist())]
    weights, keep, near_boundary = _direct_weights_and_keep(rows, cfg, lps)
    for i, mr in enumerate(mask.tolist()):
        cols = [t for t, m in enumerate(mr) if m]
        if weights[i] is not None:
            got = [out.weights[i, t].item() for t in cols]
            assert got == pytest.approx(weights[i], rel=5e-5, abs=1e-12), i
        if not near_boundary:  # a float32-vs-float64 tie at a bound may go either way
            assert [bool(out.response_mask[i, t]) for t in cols] == keep[i], i


def _direct_mismatch(rows):
    """The mismatch metrics from their definitions (module docstring of _src/metrics.py), in float64."""
    toks = [(o, r) for row in rows for o, r in row]
    n = len(toks)
    bounded = [(max(-1e4, min(0.0, o)), max(-1e4, min(0.0, r))) for o, r in toks]  # log-probs in [−1e4, 0]
    q, p = [math.exp(o) for o, _ in bounded], [math.exp(r) for _, r in bounded]
    lr32 = [[float(np.float32(o) - np.float32(r)) for o, r in row] for row in rows]  # the library's fp32 Δ
    flat32 = [x for row in lr32 for x in row]
    d = [abs(a - b) for a, b in zip(q, p)]

    def corr(x, y):
        mx, my = sum(x) / n, sum(y) / n
        ex2, ey2 = sum(v * v for v in x) / n, sum(v * v for v in y) / n
        vx, vy = ex2 - mx * mx, ey2 - my * my
        if not (vx > 1e-6 * ex2 and vy > 1e-6 * ey2):
            return 0.0
        return max(-1.0, min(1.0, (sum(a * b for a, b in zip(x, y)) / n - mx * my) / math.sqrt(vx * vy)))

    return {
        "prob_abs_diff_mean": sum(d) / n, "prob_abs_diff_max": max(d),
        "prob_abs_diff_std": statistics.stdev(d) if n > 1 else 0.0,
        "prob_pearson": corr(q, p), "log_prob_pearson": corr([o for o, _ in bounded], [r for _, r in bounded]),
        "js_divergence": sum(math.log(math.cosh(x / 2)) for x in flat32) / n,
        "log_prob_abs_diff_seq_mean": sum(sum(map(abs, row)) / len(row) for row in lr32) / len(rows),
        "log_prob_abs_diff_max": max(map(abs, flat32)),
        "log_prob_abs_diff_gt1": sum(abs(x) > 1 for x in flat32) / n,
        "log_prob_abs_diff_gt2": sum(abs(x) > 2 for x in flat32) / n,
        # ratio bands: the fp32 Δ against the bounds' logs as float32 (what the comparison rounds them to)
        **{f"ratio_band_{name}_fraction": sum(float(np.float32(math.log(lo))) <= x <= float(np.float32(math.log(hi)))
                                              for x in flat32) / n
           for name, (lo, hi) in (("tight", (0.999, 1.002)), ("1pct", (0.99, 1.01)), ("5pct", (0.95, 1.05)))},
    }


@FAST
@given(batches())
def test_offpolicy_metrics_match_a_direct_evaluation(batch):
    old, rollout, mask = batch
    got = {k.split("/", 1)[1]: float(v) for k, v in compute_offpolicy_metrics(old, rollout, mask, metrics="all").items()}
    rows = [[(o, r) for o, r, m in zip(orow, rrow, mrow) if m]
            for orow, rrow, mrow in zip(old.tolist(), rollout.tolist(), mask.tolist())]
    rows = [r for r in rows if r]  # sequences with no valid token do not count
    if not rows:
        assert all(v == 0.0 for v in got.values())
        return
    c20 = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    toks = [o - r for row in rows for o, r in row]
    mean_o = [sum(o for o, _ in row) / len(row) for row in rows]
    mean_r = [sum(r for _, r in row) / len(row) for row in rows]
    d = [mr - mo for mo, mr in zip(mean_o, mean_r)]
    n, m = len(toks), len(rows)
    expected = {
        "training_log_ppl": sum(-x for x in mean_o) / m,
        "training_ppl": sum(math.exp(min(-x, 700.0)) for x in mean_o) / m,
        "rollout_log_ppl": sum(-x for x in mean_r) / m,
        "rollout_ppl": sum(math.exp(min(-x, 700.0)) for x in mean_r) / m,
        "kl": -sum(toks) / n,
        "k3_kl": sum(math.expm1(c20(x)) - c20(x) for x in toks) / n,
        "log_ppl_diff": sum(d) / m,
        "log_ppl_abs_diff": sum(abs(x) for x in d) / m,
        "log_ppl_diff_max": max(d),
        "log_ppl_diff_min": min(d),
        "ppl_ratio": sum(math.exp(c20(x)) for x in d) / m,
        "chi2_token": sum(math.exp(2 * c20(x)) for x in toks) / n - 1,
        "chi2_seq": sum(math.exp(2 * c20(sum(o - r for o, r in row))) for row in rows) / m - 1,
        "rollout_is_raw_mean": sum(math.exp(c20(x)) for x in toks) / n,
        "rollout_is_seq_raw_mean": sum(math.exp(c20(sum(o - r for o, r in row))) for row in rows) / m,
        "chi2_token_sn": max(0.0, n * sum(math.exp(2 * c20(x)) for x in toks)
                             / sum(math.exp(c20(x)) for x in toks) ** 2 - 1),
        "chi2_seq_sn": max(0.0, m * sum(math.exp(2 * c20(sum(o - r for o, r in row))) for row in rows)
                           / sum(math.exp(c20(sum(o - r for o, r in row))) for row in rows) ** 2 - 1),
        "nonfinite_seq_fraction": 0.0,
        "sentinel_token_fraction": 0.0,
        **_direct_mismatch(rows),
    }
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k


# The hand-written metric definitions of test_weights / test_rejection, applied to arbitrary batches.
from test_rejection import _option_metrics  # noqa: E402
from test_weights import _seq_level_metrics, _token_level_metrics  # noqa: E402

# The std metrics are compared once .notes/core-tests.md #4 (fp32 squares) is fixed; until then the
# deterministic xfail tests test_std_of_identical_* cover them.
STD_PENDING = False
moderate_batches = batches(min_b=2).filter(lambda b: bool((b[2].sum(-1) > 0).sum() >= 2))


def _moderate(batch):
    """Log-ratios squeezed into [−3, 3] (no safety clamp involved) on the same masks."""
    old, rollout, mask = batch
    lr = torch.where(mask, old - rollout, 0.0).clamp(-3.0, 3.0)
    return torch.where(mask, rollout + lr, old), rollout, mask, lr


@FAST
@given(moderate_batches, is_configs())
def test_is_metrics_match_their_definitions(batch, cfg_bounds):
    old, rollout, mask, _ = _moderate(batch)
    cfg, _ = cfg_bounds
    spec = cfg.is_spec
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    got = {k.split("/", 1)[1]: v for k, v in out.metrics_as_floats().items()}
    lr = (old - rollout).tolist()
    rows = [[x for x, m in zip(r, mr) if m] for r, mr in zip(lr, mask.tolist())]
    rows = [r for r in rows if r]
    weights, _, _ = _direct_weights_and_keep(rows, cfg)
    flat_w = [w for r in weights for w in r]
    if not any(flat_w):
        return  # every weight masked out by IcePop: covered by the hand tests (ESS 0)
    if spec.level == "token":
        raw = [[math.exp(x) for x in r] for r in rows]
        exp = _token_level_metrics(flat_w, [x for r in raw for x in r], weights, raw, spec.upper, spec.metric_lower)
        raw_flat = [x for r in raw for x in r]
    else:
        row_raw = [math.exp(sum(r) if spec.level == "sequence" else sum(r) / len(r)) for r in rows]
        exp = _seq_level_metrics([w[0] for w in weights], row_raw, [len(r) for r in rows], spec.upper,
                                 spec.metric_lower)
        raw_flat = [x for x, r in zip(row_raw, rows) for _ in r]
    if spec.mode == "mask":
        exp["rollout_is_oob_ratio"] = sum(not spec.lower <= x <= spec.upper for x in raw_flat) / len(raw_flat)
    for k, v in exp.items():
        if not (STD_PENDING and k.endswith("_std") and k != "rollout_is_seq_std"):
            assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


@FAST  # (the metrics of the probability-space options, computed by the same code: tests/test_rejection.py)
@given(moderate_batches, st.sampled_from([o for o in ALL_OPTIONS if o not in PROB_OPTIONS + LOGPROB_ERROR]), st.data())
def test_rs_metrics_match_their_definitions(batch, option, data):
    old, rollout, mask, _ = _moderate(batch)
    thr = _threshold(data.draw, option)
    out = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(
        rollout_rs=option, rollout_rs_threshold=thr))
    got = {k.split("/", 1)[1]: v for k, v in out.metrics_as_floats().items()}
    lr = (old - rollout).tolist()
    rows = [[math.exp(x) for x, m in zip(r, mr) if m] for r, mr in zip(lr, mask.tolist())]
    for k, v in _option_metrics(option, thr, [r for r in rows if r]).items():
        if not (STD_PENDING and k.endswith("_std") and not k.endswith("_seq_std")):
            assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def _ppo_token_loss(lp, prox, a, eps_lo=0.2, eps_hi=0.2, c=3.0):
    r = math.exp(max(-20.0, min(20.0, lp - prox)))
    loss = max(-a * r, -a * min(max(r, 1 - eps_lo), 1 + eps_hi))
    return min(loss, -c * a) if a < 0 else loss


def _aggregate(rows, mode, T):
    """rows: per-row lists of the kept tokens' losses (empty rows included)."""
    n_tok = sum(len(r) for r in rows)
    n_seq = sum(1 for r in rows if r)
    if mode == "token-mean":
        return sum(map(sum, rows)) / max(n_tok, 1)
    if mode == "token-sum":
        return sum(map(sum, rows))
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(n_seq, 1)
    seq = sum(map(sum, rows)) / max(n_seq, 1)
    return seq / T if mode == "seq-mean-token-sum-norm" else seq


@FAST
@given(batches(), any_config(), st.sampled_from(["decoupled", "bypass_ppo_clip", "bypass_reinforce",
                                                  "bypass_rollout_is"]),
       st.sampled_from(["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                        "seq-mean-token-sum-norm"]), st.integers(0, 2 ** 16))
def test_policy_loss_matches_its_definition(batch, cfg, mode_name, agg, seed):
    old, rollout, mask = batch
    B, T = mask.shape
    g = torch.Generator().manual_seed(seed)
    log_prob = torch.where(mask, (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0), torch.tensor(float("nan")))
    adv = torch.where(mask, torch.randn(B, T, generator=g), torch.tensor(float("nan")))
    if mode_name != "decoupled":
        cfg = cfg.replace(bypass_mode=True, loss_type=mode_name.split("_", 1)[1])
    loss, _ = compute_policy_loss(
        log_prob, old, adv, mask, config=cfg, rollout_log_prob=rollout,
        loss=PolicyLoss(aggregation=Aggregation(agg)))
    assert math.isfinite(loss.item())
    # The correction the loss must use: π_old vs π_rollout (decoupled) or π_θ vs π_rollout (bypass).
    train_side = old if mode_name == "decoupled" else log_prob
    corr = compute_rollout_correction(train_side, rollout, mask, config=cfg)
    rows = []
    for i in range(B):
        row = []
        for t in range(T):
            if not corr.response_mask[i, t]:
                continue
            lp, a = log_prob[i, t].item(), adv[i, t].item()
            w = corr.weights[i, t].item() if corr.weights is not None else 1.0
            if mode_name == "decoupled":
                row.append(w * _ppo_token_loss(lp, old[i, t].item(), a))
            elif mode_name == "bypass_ppo_clip":  # IS weights are diagnostics only
                row.append(_ppo_token_loss(lp, rollout[i, t].item(), a))
            elif mode_name == "bypass_rollout_is":  # r zeroed outside (0.8, 1.2); no IS weight
                r = math.exp(max(-20.0, min(20.0, lp - rollout[i, t].item())))
                row.append(-(r if 0.8 < r < 1.2 else 0.0) * a * lp)
            else:
                row.append(-w * a * lp)
        rows.append(row)
    assert loss.item() == pytest.approx(_aggregate(rows, agg, T), rel=1e-4, abs=1e-5)


SEGMENT_PAIRS = [("segment", "sequence"), ("segment_geometric", "geometric")] + [
    (f"segment_{o[4:]}", o) for o in ALL_OPTIONS if o.startswith("seq_") and f"segment_{o[4:]}" in RS_OPTIONS]


@FAST
@given(batches(max_b=4, max_t=7), st.integers(1, 4), st.data())
def test_segment_level_is_the_sequence_level_of_each_segment(batch, S, data):
    """Segment IS and every segment option equal the sequence level on the batch whose rows are the
    (row, segment) pairs: weights, masks and the IS / option metrics."""
    from test_segments import assert_matches_exploded, segment_vs_exploded

    old, rollout, mask = batch
    B, T = mask.shape
    ids = torch.tensor(data.draw(st.lists(st.integers(0, S - 1), min_size=B * T, max_size=B * T))).view(B, T)
    ids = torch.where(mask, ids, -3)  # masked positions: ignored, whatever they hold
    seg, seq = data.draw(st.sampled_from(SEGMENT_PAIRS))
    if seg in ("segment", "segment_geometric"):
        cfg, _ = data.draw(is_configs())
        d = {k: v for k, v in cfg.to_dict().items() if k.startswith("rollout_is")}
        seg_cfg, seq_cfg = dict(d, rollout_is=seg), dict(d, rollout_is=seq)
    else:
        thr = _threshold(data.draw, seq)
        seg_cfg, seq_cfg = dict(rollout_rs=seg, rollout_rs_threshold=thr), dict(rollout_rs=seq, rollout_rs_threshold=thr)
    a, b, w, keep = segment_vs_exploded(old, rollout, mask, ids, S, seg_cfg, seq_cfg)
    assert_matches_exploded(a, b, w, keep, mask.float())
