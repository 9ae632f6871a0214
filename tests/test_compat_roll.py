"""``rollout_correction.compat.roll`` against ROLL's definitions: hand-computed cases, and a
float-by-float re-derivation of ROLL's train-infer correction (roll/utils/train_infer_corrections.py:
ratios and Δp at token / geometric / sequence / segment granularity, the capped IS weight, the
ratio and diff filters, the metrics) on random batches and configs. ROLL's own test file and its
own function are run against the drop-in by tools/roll_suite.py (ROLL is not installable here)."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from rollout_correction.compat.roll import compute_segment_masked_mean, compute_train_infer_correction

AGGS = ["token", "geometric", "sequence", "segment"]


def cfg(enabled=True, weight_type="token", upper_bound=1.2, detach=True, filters=()):
    return SimpleNamespace(is_weight=SimpleNamespace(enabled=enabled, weight_type=weight_type,
                                                     upper_bound=upper_bound, detach=detach),
                           filters=[SimpleNamespace(**f) for f in filters])


def filt(agg, ratio=None, diff=None, enabled=True):
    return dict(enabled=enabled, agg_type=agg, ratio_enabled=ratio is not None, ratio_low=(ratio or (0, 0))[0],
                ratio_high=(ratio or (0, 0))[1], diff_enabled=diff is not None, diff_low=(diff or (0, 0))[0],
                diff_high=(diff or (0, 0))[1])


# -- the segment mean ------------------------------------------------------------------------

def test_segment_masked_mean_by_hand():
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0, 1]])
    x = torch.tensor([[2.0, 6.0, 9.0, 1.0, 2.0, 6.0, 7.0], [5.0, -3.0, 1.0, 1.0, 1.0, 1.0, 0.5]])
    want = torch.tensor([[4.0, 4.0, 0.0, 3.0, 3.0, 3.0, 0.0], [0.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.5]])
    for m in (mask, mask.bool(), mask.float()):
        torch.testing.assert_close(compute_segment_masked_mean(x, m), want)
    x64 = x.double()
    x64[0, 2] = x64[1, 0] = float("nan")  # outside the runs: never read
    out = compute_segment_masked_mean(x64, mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want.double())
    assert compute_segment_masked_mean(torch.ones(2, 0), torch.ones(2, 0)).shape == (2, 0)
    with pytest.raises(ValueError, match="batch, seq_len"):
        compute_segment_masked_mean(torch.ones(2, 3), torch.ones(2, 4))


def test_segment_masked_mean_carries_the_gradient():
    # ∂/∂x_t Σ_u c_u·out_u = mean of c over the run holding t (0 outside the runs)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    x = torch.randn(1, 6, requires_grad=True)
    c = torch.tensor([[1.0, 3.0, 5.0, 2.0, 4.0, 9.0]])
    (compute_segment_masked_mean(x, mask) * c).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[2.0, 2.0, 0.0, 5.0, 5.0, 5.0]]))


# -- compute_train_infer_correction by hand --------------------------------------------------

# one row, runs {0, 1} and {3}: ρ = [1.25, 1.8, ·, 0.8], Δp = [0.1, 0.4, ·, −0.05]
OLD = torch.tensor([[0.5, 0.9, 0.7, 0.2]]).log()
INFER = torch.tensor([[0.4, 0.5, 0.1, 0.25]]).log()
MASK = torch.tensor([[1, 1, 0, 1]])


def test_weights_filters_and_metrics_by_hand():
    c = cfg(weight_type="segment", upper_bound=1.2, filters=[
        filt("segment", ratio=(0.75, 1.3), diff=(-0.1, 0.3)),  # runs: ratio 1.5 ✗, 0.8 ✓; Δp 0.25 ✓, −0.05 ✓
        filt("token", diff=(-0.2, 0.2)),  # Δp 0.4 ✗
        filt("geometric", ratio=(2.0, 3.0), enabled=False)])
    w, f, m = compute_train_infer_correction(c, MASK, OLD, INFER)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2, 0.0, 0.8]]))  # exp(mean log ρ) per run, capped
    assert f.dtype == torch.float32 and f.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    p = "actor/train_infer_"
    expected = {
        p + "ratio_token_mean@sum": (1.25 + 1.8 + 0.8) / 3, p + "ratio_geometric_mean@sum": 1.8 ** (1 / 3),
        p + "ratio_sequence_mean@sum": 1.8, p + "ratio_segment_mean@sum": (2 * 1.5 + 0.8) / 3,
        p + "diff_token_mean@sum": 0.15, p + "diff_geometric_mean@sum": 0.15, p + "diff_sequence_mean@sum": 0.45,
        p + "diff_segment_mean@sum": 0.15, "actor/is_weight_clipfrac@sum": 2 / 3,
        p + "segment_ratio_mask_mean@sum": 1 / 3, p + "segment_diff_mask_mean@sum": 1.0,
        p + "token_diff_mask_mean@sum": 2 / 3, p + "final_mask_mean": 1 / 3}
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-5), k
        assert isinstance(m[k], float)


@pytest.mark.parametrize("agg, weight", [("token", [1.25, 1.8, 0.0, 0.8]), ("geometric", [1.8 ** (1 / 3)] * 2 + [0.0, 1.8 ** (1 / 3)]),
                                         ("sequence", [1.8, 1.8, 0.0, 1.8]), ("segment", [1.5, 1.5, 0.0, 0.8])])
def test_each_weight_type_uncapped(agg, weight):
    w, f, m = compute_train_infer_correction(cfg(weight_type=agg, upper_bound=None), MASK, OLD, INFER)
    torch.testing.assert_close(w, torch.tensor([weight]))
    assert f.dtype == torch.long and f.tolist() == [[1, 1, 1, 1]] and "actor/is_weight_clipfrac@sum" not in m


def test_defaults_and_disabled_weight():
    w, f, m = compute_train_infer_correction(SimpleNamespace(is_weight=SimpleNamespace(), filters=[]), MASK, OLD,
                                             INFER)
    assert torch.equal(w, torch.ones(1, 4)) and torch.equal(f, torch.ones(1, 4, dtype=torch.long))
    assert len(m) == 8 and all(k.endswith("_mean@sum") for k in m)  # the monitoring metrics only
    # a mapping works as well as an object; a filter's missing fields take ROLL's defaults (ratio 0.8–1.2)
    w, f, m = compute_train_infer_correction(
        {"is_weight": {"enabled": True}, "filters": [{"enabled": True, "agg_type": "sequence"}]}, MASK, OLD, INFER)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2, 0.0, 0.8]]))  # token level, cap 1.2
    assert f.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # ∏ρ = 1.8 > 1.2
    assert m["actor/train_infer_sequence_ratio_mask_mean@sum"] == 0.0 and "actor/train_infer_final_mask_mean" in m


def test_clear_errors():
    for bad, words in ((cfg(weight_type="turn"), "weight_type"),
                       (cfg(filters=[filt("segment", ratio=(1.3, 0.7))]), "ratio_low ≤ ratio_high"),
                       (cfg(filters=[filt("token", ratio=(-0.1, 1.2))]), "ratio_low"),
                       (cfg(filters=[filt("token", diff=(0.2, -0.2))]), "diff_low ≤ diff_high"),
                       (cfg(filters=[filt("run", diff=(-0.2, 0.2))]), "agg_type")):
        with pytest.raises(ValueError, match=words):
            compute_train_infer_correction(bad, MASK, OLD, INFER)
    with pytest.raises(ValueError, match="detach"):
        compute_train_infer_correction(cfg(detach=False), MASK, OLD.clone().requires_grad_(True), INFER)
    w, _, _ = compute_train_infer_correction(cfg(detach=False), MASK, OLD, INFER)  # nothing to detach
    assert not w.requires_grad


def test_non_finite_rows_are_rejected_not_propagated():
    old = torch.cat([OLD, OLD]).clone()
    old[1, 1] = float("nan")
    mask = torch.cat([MASK, MASK])
    w, f, m = compute_train_infer_correction(cfg(filters=[filt("token", ratio=(0.1, 10.0))]), mask, old,
                                             torch.cat([INFER, INFER]))
    assert f.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    assert torch.equal(w[1], torch.zeros(4)) and all(math.isfinite(v) for v in m.values())


def test_split_batches_add_up_to_the_whole_with_global_counts():
    """ROLL's data-parallel convention: each micro-batch divides by the global counts, the '@sum'
    metrics add up over micro-batches to the whole batch's value."""
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 9
    infer = torch.rand(B, T, generator=gen).clamp_min(0.05).log()
    old = (infer + 0.3 * torch.randn(B, T, generator=gen)).clamp_max(0.0)
    mask = (torch.rand(B, T, generator=gen) < 0.7).long()
    mask[2] = 0
    c = cfg(weight_type="segment", filters=[filt("geometric", ratio=(0.8, 1.25), diff=(-0.05, 0.05)),
                                            filt("segment", diff=(-0.1, 0.1))])
    g_samples, g_tokens = int((mask.sum(-1) > 0).sum()), int(mask.sum())
    w, f, whole = compute_train_infer_correction(c, mask, old, infer)
    parts = [compute_train_infer_correction(c, mask[s], old[s], infer[s], g_samples, g_tokens)
             for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), w)
    assert torch.equal(torch.cat([p[1] for p in parts]), f)
    for k, v in whole.items():
        if k.endswith("@sum"):
            assert sum(p[2][k] for p in parts) == pytest.approx(v, rel=1e-5, abs=1e-7), k


# -- against a re-derivation of ROLL's formulas on random batches ----------------------------

def _runs(mask_row):
    """The maximal runs of consecutive valid positions of a row, as lists of positions."""
    runs, cur = [], []
    for t, m in enumerate(mask_row):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def roll_reference(c, mask, old, infer, samples=None, tokens=None):
    """ROLL's definitions, one float at a time (token shares over the valid tokens)."""
    mask, old, infer = mask.tolist(), old.double().tolist(), infer.double().tolist()
    B, T = len(mask), len(mask[0])
    samples = samples or max(sum(any(r) for r in mask), 1)
    tokens = tokens or max(sum(map(sum, mask)), 1)
    ratio = {a: [[0.0] * T for _ in range(B)] for a in AGGS}
    diff = {a: [[0.0] * T for _ in range(B)] for a in AGGS}
    for b in range(B):
        cols = [t for t in range(T) if mask[b][t]]
        lr = {t: old[b][t] - infer[b][t] for t in cols}
        dp = {t: math.exp(old[b][t]) - math.exp(infer[b][t]) for t in cols}
        units = {"geometric": [cols], "sequence": [cols], "segment": _runs(mask[b])}
        for t in cols:
            ratio["token"][b][t], diff["token"][b][t] = math.exp(lr[t]), dp[t]
        for agg, groups in units.items():
            for g in groups:
                if not g:
                    continue
                s_lr, s_dp = sum(lr[t] for t in g), sum(dp[t] for t in g)
                if agg != "sequence":
                    s_lr, s_dp = s_lr / len(g), s_dp / len(g)
                for t in g:
                    ratio[agg][b][t], diff[agg][b][t] = math.exp(s_lr), s_dp
    valid = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
    metrics = {}
    for agg in AGGS:
        for kind, v in (("ratio", ratio[agg]), ("diff", diff[agg])):
            rows = [sum(v[b][t] for t in range(T) if mask[b][t]) / sum(mask[b]) for b in range(B) if any(mask[b])]
            metrics[f"actor/train_infer_{kind}_{agg}_mean@sum"] = sum(rows) / samples
    iw = c.is_weight
    weight = {(b, t): 1.0 for b, t in valid}
    if iw.enabled:
        weight = {(b, t): ratio[iw.weight_type][b][t] for b, t in valid}
        if iw.upper_bound is not None:
            metrics["actor/is_weight_clipfrac@sum"] = sum(x > iw.upper_bound for x in weight.values()) / tokens
            weight = {k: min(x, iw.upper_bound) for k, x in weight.items()}
    keep = {k: True for k in valid}
    for f in c.filters:
        if not f.enabled:
            continue
        for kind, on, lo, hi, v in (("ratio", f.ratio_enabled, f.ratio_low, f.ratio_high, ratio),
                                    ("diff", f.diff_enabled, f.diff_low, f.diff_high, diff)):
            if on:
                ok = {(b, t): lo <= v[f.agg_type][b][t] <= hi for b, t in valid}
                metrics[f"actor/train_infer_{f.agg_type}_{kind}_mask_mean@sum"] = sum(ok.values()) / tokens
                keep = {k: keep[k] and ok[k] for k in valid}
    if c.filters:
        metrics["actor/train_infer_final_mask_mean"] = sum(keep.values()) / max(len(valid), 1)
    return weight, keep, metrics


def _random_case(rng: random.Random):
    B, T = rng.randint(1, 5), rng.randint(1, 16)
    mask = torch.tensor([[int(rng.random() < rng.choice([0.5, 0.8, 1.0])) for _ in range(T)] for _ in range(B)])
    infer = torch.tensor([[math.log(rng.uniform(0.02, 1.0)) for _ in range(T)] for _ in range(B)])
    old = (infer + torch.tensor([[rng.gauss(0, rng.choice([0.03, 0.2])) for _ in range(T)] for _ in range(B)]))
    old = old.clamp_max(0.0)
    filters = [filt(rng.choice(AGGS), ratio=(rng.uniform(0.4, 0.99), rng.uniform(1.01, 2.0)) if rng.random() < 0.7 else None,
                    diff=(rng.uniform(-0.3, -0.005), rng.uniform(0.005, 0.3)) if rng.random() < 0.6 else None,
                    enabled=rng.random() < 0.85) for _ in range(rng.randint(0, 3))]
    c = cfg(enabled=rng.random() < 0.8, weight_type=rng.choice(AGGS), upper_bound=rng.choice([None, 1.1, 1.5, 3.0]),
            filters=filters)
    return c, mask, old, infer


@pytest.mark.parametrize("seed", range(40))
def test_matches_a_rederivation_of_rolls_formulas(seed):
    rng = random.Random(seed)
    c, mask, old, infer = _random_case(rng)
    samples, tokens = (None, None) if seed % 3 else (7, 101)  # the caller's global counts, or the batch's
    w, f, m = compute_train_infer_correction(c, mask, old, infer, samples, tokens)
    ref_w, ref_keep, ref_m = roll_reference(c, mask, old, infer, samples, tokens)
    for (b, t), x in ref_w.items():
        assert w[b, t].item() == pytest.approx(x, rel=2e-5), (b, t)
    assert all(w[b, t] == 0 for b in range(mask.shape[0]) for t in range(mask.shape[1]) if not mask[b, t]) or \
        not c.is_weight.enabled
    assert all(f[b, t] == 1 for b in range(mask.shape[0]) for t in range(mask.shape[1]) if not mask[b, t])
    assert {k: bool(f[k]) for k in ref_keep} == ref_keep
    assert set(m) == set(ref_m)
    for k, v in ref_m.items():
        assert m[k] == pytest.approx(v, rel=2e-5, abs=1e-7), k
