"""Health monitor: every rule on hand-built histories (fires / does not fire, at the exact step),
persistence, the active-monitor hook and the plot."""

import json
import logging
import math

import pytest
import torch

from rollout_correction.monitor import (STATIC_THRESHOLDS, HealthMonitor, observe, plot_metrics,
                                        set_active_monitor)
from rollout_correction.monitor.rules import TREND_SPEC

P = "rollout_corr/"


def feed(mon, values, key, start=0):
    """Feed ``values`` of one metric as consecutive steps; return {rule: first alert step}."""
    for i, v in enumerate(values):
        mon.update(start + i, {P + key: v})
    first = {}
    for a in mon.alerts:
        first.setdefault(a.name, a.step)
    return first


# ---------------------------------------------------------------------------------------------
# Static rules (seed 001): value, threshold, direction

STATIC_CASES = [  # rule, metric, healthy value, alarming value
    ("is_mean_low", "rollout_is_mean", 1.0, 0.49),
    ("is_mean_high", "rollout_is_mean", 1.0, 2.01),
    ("ess_low", "rollout_is_eff_sample_size", 0.9, 0.29),
    ("veto_high", "rollout_is_veto_fraction", 0.0, 0.11),
    ("is_std_high", "rollout_is_std", 0.2, 1.01),
    ("kl_high", "kl", 0.01, 0.11),
    ("kl_high", "kl", 0.01, -0.11),      # |kl|
    ("chi2_token_high", "chi2_token", 0.1, 1.01),
    ("rejected_high", "rollout_rs_masked_fraction", 0.1, 0.51),
    ("routing_match_low", "routing_match", 0.98, 0.89),   # MoE routing agreement
]


@pytest.mark.parametrize("rule,metric,ok,bad", STATIC_CASES)
def test_static_rule_per_step_fires_at_the_first_crossing(rule, metric, ok, bad):
    """static_window=1: seed 001's check of every step on its own."""
    mon = HealthMonitor(trends=False, log_alerts=False, static_window=1)
    first = feed(mon, [ok] * 7 + [bad, ok, bad] + [ok] * 6 + [bad], metric)
    assert first == {rule: 7}
    # edge-triggered: one alert per entry into the firing state; the rule is clear again after 5
    # clear steps (10–14), so step 9 raises nothing and step 16 raises the second alert
    assert [a.step for a in mon.alerts] == [7, 16]
    assert mon.alerts[0].severity == "warn" and mon.alerts[0].kind == "static"
    assert mon.alerts[0].value == pytest.approx(abs(bad) if rule == "kl_high" else bad)


@pytest.mark.parametrize("rule,metric,ok,bad", STATIC_CASES)
def test_static_rule_default_median_of_five(rule, metric, ok, bad):
    """Default static_window=5: isolated spikes (2 of 5 steps) never fire; the rule fires at the
    step where 3 of the last 5 values are across the line."""
    mon = HealthMonitor(trends=False, log_alerts=False)
    # steps 5–24: spikes at most 2 in any 5 consecutive steps; steps 27–29 across the line
    first = feed(mon, [ok] * 5 + ([bad, ok, ok, bad, ok] * 4) + [ok, ok, bad, bad, bad, ok], metric)
    assert first == {rule: 29}
    assert mon.alerts[0].value == pytest.approx(abs(bad) if rule == "kl_high" else bad)


@pytest.mark.parametrize("rule,metric,ok,bad", STATIC_CASES)
def test_static_rule_silent_at_the_threshold_and_on_healthy_values(rule, metric, ok, bad):
    name = {"is_mean_low": 0.5, "is_mean_high": 2.0}.get(rule, STATIC_THRESHOLDS[rule])
    at = math.copysign(name, bad)
    mon = HealthMonitor(trends=False, log_alerts=False, static_window=1)
    assert feed(mon, [ok] * 5 + [at] * 3, metric) == {}


def test_thresholds_override_and_disable():
    mon = HealthMonitor({"ess_low": 0.5, "kl_high": None}, trends=False, log_alerts=False, static_window=1)
    mon.update(0, {P + "rollout_is_eff_sample_size": 0.45, P + "kl": 5.0})
    assert [a.name for a in mon.alerts] == ["ess_low"]
    with pytest.raises(ValueError, match="unknown threshold"):
        HealthMonitor({"ess": 0.5})


# ---------------------------------------------------------------------------------------------
# Trend rules. With B=20, W=10, D=5, F=2: 20 baseline steps at b, then x from step 20. The window
# median at step t is b while ≤ 4 of its 10 values are x, (b + x)/2 with 5 (step 24), x after.
# For x = 10·b every rule's limit (F·b, or √F·b, F = 2) is exceeded from step 24, so the rule
# fires at step 24 + D − 1 = 28.

F2W10 = dict(trend_factor=2.0, window=10)
TRENDS = {name: (metric, transform, scale, floor) for name, metric, transform, scale, floor, _ in TREND_SPEC}


def _trend_values(transform, b, x):
    if transform == "deficit":  # ESS: badness 1 − value
        return 1.0 - b, 1.0 - x
    return b, x


@pytest.mark.parametrize("name", list(TRENDS))
def test_trend_rule_fires_at_the_exact_step(name):
    metric, transform, scale, floor = TRENDS[name]
    b = 20 * floor if transform != "deficit" else 0.02
    base, high = _trend_values(transform, b, 10 * b)
    mon = HealthMonitor(log_alerts=False, thresholds={k: None for k in STATIC_THRESHOLDS}, **F2W10)
    first = feed(mon, [base] * 20 + [high] * 20, metric)
    assert first.get(name) == 28
    a = next(a for a in mon.alerts if a.name == name)
    assert a.kind == "trend" and a.severity == "warn"
    assert a.value == pytest.approx(10 * b)   # the window median of the badness


@pytest.mark.parametrize("name", list(TRENDS))
def test_trend_rule_silent_below_its_factor(name):
    metric, transform, scale, floor = TRENDS[name]
    factor = 2.0 if scale == 2 else math.sqrt(2.0)  # F2W10
    b = 20 * floor if transform != "deficit" else 0.02
    base, high = _trend_values(transform, b, 0.95 * factor * b)
    mon = HealthMonitor(log_alerts=False, thresholds={k: None for k in STATIC_THRESHOLDS}, **F2W10)
    assert name not in feed(mon, [base] * 20 + [high] * 100, metric)


@pytest.mark.parametrize("name", list(TRENDS))
def test_trend_rule_ignores_changes_under_its_noise_floor(name):
    """An on-policy run: the gap is fp32 rounding noise, far below the floor; a 1000× relative rise
    of that noise is not an alarm."""
    metric, transform, scale, floor = TRENDS[name]
    base, high = _trend_values(transform, floor * 1e-4, floor * 0.9)
    mon = HealthMonitor(log_alerts=False, thresholds={k: None for k in STATIC_THRESHOLDS}, **F2W10)
    assert name not in feed(mon, [base] * 20 + [high] * 100, metric)


def test_default_trend_parameters():
    """Defaults B = W = 20, D = 5, F = 3: with x = 10·b from step 20 the median of the last 20 is b
    while ≤ 9 are high, (b + 10b)/2 = 5.5·b > 3·b with 10 (step 29): fires at 29 + 4 = 33. A rise
    to 2.9·b never fires."""
    mon = HealthMonitor(log_alerts=False)
    assert feed(mon, [0.01] * 20 + [0.1] * 20, "kl")["kl_rising"] == 33
    mon = HealthMonitor(log_alerts=False)
    assert "kl_rising" not in feed(mon, [0.01] * 20 + [0.029] * 200, "kl")
    # first-order rule (log-PPL gap) at √3: 1.8·b fires, 1.7·b does not
    mon = HealthMonitor(log_alerts=False)
    assert "log_ppl_gap_rising" in feed(mon, [0.01] * 20 + [0.018] * 40, "log_ppl_abs_diff")
    mon = HealthMonitor(log_alerts=False)
    assert "log_ppl_gap_rising" not in feed(mon, [0.01] * 20 + [0.017] * 200, "log_ppl_abs_diff")


def test_trend_needs_min_duration_and_ignores_spikes():
    mon = HealthMonitor(log_alerts=False, **F2W10)
    # isolated spikes (4 of every 10 steps at 100× the baseline) never move the window median
    vals = [0.01] * 20 + ([1.0] * 4 + [0.01] * 6) * 10
    assert "kl_rising" not in feed(mon, vals, "kl")
    # an excursion of L steps from step 20 keeps ≥ 5 of the 10 window values high from step 24 to
    # step 20 + L − 1 + 5, i.e. L + 1 steps: with D = 8, L = 5 stays silent and L = 7 fires at 31
    mon = HealthMonitor(log_alerts=False, trend_factor=2.0, window=10, min_duration=8)
    assert "kl_rising" not in feed(mon, [0.01] * 20 + [0.1] * 5 + [0.01] * 30, "kl")
    mon = HealthMonitor(log_alerts=False, trend_factor=2.0, window=10, min_duration=8)
    assert feed(mon, [0.01] * 20 + [0.1] * 7 + [0.01] * 30, "kl")["kl_rising"] == 31


def test_trend_parameters_change_the_step():
    # F = 4: x = 10·b, limit 4·b: the median (b + 10b)/2 = 5.5·b > 4·b at step 24 -> fires at 24 + D − 1
    mon = HealthMonitor(log_alerts=False, trend_factor=4.0, window=10, min_duration=3)
    assert feed(mon, [0.01] * 20 + [0.1] * 20, "k3_kl")["k3_kl_rising"] == 26
    # F = 6: 5.5·b is not enough; from step 25 the median is 10·b -> fires at 25 + 3 − 1
    mon = HealthMonitor(log_alerts=False, trend_factor=6.0, window=10, min_duration=3)
    assert feed(mon, [0.01] * 20 + [0.1] * 20, "k3_kl")["k3_kl_rising"] == 27
    # B = 5, W = 1, D = 1: the first step above 2·b fires
    mon = HealthMonitor(log_alerts=False, trend_factor=2.0, baseline_steps=5, window=1, min_duration=1)
    assert feed(mon, [0.01] * 5 + [0.015, 0.019, 0.021], "k3_kl")["k3_kl_rising"] == 7
    with pytest.raises(ValueError, match="factor"):
        HealthMonitor(trend_factor=1.0)


def test_baseline_is_the_median_of_the_first_steps():
    mon = HealthMonitor(log_alerts=False, trend_factor=2.0, baseline_steps=5, window=1, min_duration=1)
    # baseline median(0.01, 0.02, 0.03, 0.5, 0.01) = 0.02 -> limit 0.04
    first = feed(mon, [0.01, 0.02, 0.03, 0.5, 0.01, 0.039, 0.041], "kl")
    assert first.get("kl_rising") == 6


# ---------------------------------------------------------------------------------------------
# Non-finite: critical, immediately


def test_nonfinite_fraction_is_critical_at_once(caplog):
    mon = HealthMonitor()
    with caplog.at_level(logging.WARNING, logger="rollout_correction.monitor"):
        for s in range(5):
            mon.update(s, {P + "nonfinite_seq_fraction": 0.0 if s != 3 else 0.25, P + "kl": 0.01})
    assert [(a.name, a.step, a.severity) for a in mon.alerts] == [("nonfinite", 3, "critical")]
    assert any(r.levelno == logging.ERROR and "nonfinite" in r.getMessage() for r in caplog.records)


def test_nan_metric_is_critical_and_skipped_by_other_rules():
    mon = HealthMonitor(log_alerts=False)
    mon.update(0, {P + "kl": 0.01})
    mon.update(1, {P + "kl": float("nan"), P + "rollout_is_eff_sample_size": float("inf")})
    assert [(a.name, a.step) for a in mon.alerts] == [("nonfinite", 1)]
    assert "kl" in mon.alerts[0].message and "rollout_is_eff_sample_size" in mon.alerts[0].message
    assert mon.health_metrics()[P + "health/status"] == 2.0


# ---------------------------------------------------------------------------------------------
# Inputs, health numbers, persistence


def test_inputs_tensors_prefixes_and_missing_keys():
    mon = HealthMonitor(log_alerts=False, trends=False, static_window=1)
    mon.update(0, {"train/rollout_corr/rollout_is_eff_sample_size": torch.tensor(0.2, dtype=torch.float64),
                   "loss": 1.0, "note": "text", P + "health/status": 5.0})
    assert mon.history == [{"step": 0, P + "rollout_is_eff_sample_size": pytest.approx(0.2)}]
    assert [a.name for a in mon.alerts] == ["ess_low"]
    # a step without the metric keeps the state (no new alert when it comes back low)
    mon.update(1, {"loss": 1.0})
    mon.update(2, {P + "rollout_is_eff_sample_size": 0.1})
    assert len(mon.alerts) == 1


def test_health_metrics():
    mon = HealthMonitor(log_alerts=False, static_window=1)
    h = mon.health_metrics()
    assert h[P + "health/status"] == 0.0 and h[P + "health/alerts"] == 0.0
    assert set(k.split("/")[-1] for k in h) >= set(STATIC_THRESHOLDS) | set(TRENDS) | {"nonfinite"}
    mon.update(0, {P + "kl": 0.5})
    h = mon.health_metrics()
    assert h[P + "health/kl_high"] == 1.0 and h[P + "health/status"] == 1.0 and h[P + "health/alerts"] == 1.0
    for s in range(1, 5):
        mon.update(s, {P + "kl": 0.05})
    assert mon.health_metrics()[P + "health/kl_high"] == 1.0  # 4 clear steps: still firing
    mon.update(5, {P + "kl": 0.05})
    assert mon.health_metrics()[P + "health/kl_high"] == 0.0


def _rising_run(n=80):
    g = torch.Generator().manual_seed(0)
    for s in range(n):
        kl = 0.01 * (1 + (s / 20) ** 2) * float(1 + 0.3 * torch.rand((), generator=g))
        yield s, {P + "kl": kl, P + "k3_kl": kl * 1.05, P + "chi2_token": 2.2 * kl,
                  P + "rollout_is_eff_sample_size": 1 / (1 + 2.2 * kl), P + "rollout_is_mean": 1.0}


def test_save_load_roundtrip_and_resume(tmp_path):
    steps = list(_rising_run())
    full = HealthMonitor(log_alerts=False, trend_factor=2.0)
    full.replay(steps)
    assert full.alerts  # the run does trigger something
    half = HealthMonitor(log_alerts=False, trend_factor=2.0)
    half.replay(steps[:40])
    half.save(tmp_path / "h.jsonl")
    lines = (tmp_path / "h.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["config"]["trend_factor"] == 2.0 and len(lines) == 41
    loaded = HealthMonitor.load(tmp_path / "h.jsonl")
    assert loaded.history == half.history and loaded.alerts == half.alerts
    loaded.replay(steps[40:])  # continues exactly as if never saved
    assert loaded.alerts == full.alerts and loaded.health_metrics() == full.health_metrics()
    with pytest.raises(ValueError, match="HealthMonitor.save"):
        (tmp_path / "plain.jsonl").write_text('{"step": 1, "rollout_corr/kl": 0.1}\n')
        HealthMonitor.load(tmp_path / "plain.jsonl")


def test_observe_counts_steps_and_returns_the_health_numbers():
    mon = HealthMonitor(log_alerts=False)
    h = mon.observe({P + "kl": 0.5})
    mon.observe({P + "kl": 0.01}, step=10)
    last = mon.observe({P + "kl": 0.01})
    assert h[P + "health/kl_high"] == 1.0 and last == mon.health_metrics()
    assert [x["step"] for x in mon.history] == [0, 10, 11]


def test_the_process_wide_monitor_is_deprecated_and_still_works():
    """0.2.0 deprecates set_active_monitor / observe (removed in 0.3.0, docs/api.md): they warn,
    and keep their behaviour for the deprecation's minor release."""
    with pytest.warns(DeprecationWarning, match="0.3.0"):
        assert observe({P + "kl": 0.5}) == {}  # no monitor: no-op
    with pytest.warns(DeprecationWarning, match="set_active_monitor is deprecated"):
        mon = set_active_monitor(HealthMonitor(log_alerts=False))
    try:
        with pytest.warns(DeprecationWarning):
            h = observe({P + "kl": 0.5})
        assert h[P + "health/kl_high"] == 1.0 and [x["step"] for x in mon.history] == [0]
    finally:
        with pytest.warns(DeprecationWarning):
            set_active_monitor(None)


def test_plot_metrics_png_and_svg(tmp_path):
    mon = HealthMonitor(log_alerts=False)
    mon.replay(_rising_run(120))
    png = plot_metrics(mon, tmp_path / "m.png", title="test")
    svg = plot_metrics(mon, tmp_path / "m.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = svg.read_text()
    for title in ("Mean IS weight", "Effective sample size", "Veto / rejected fraction", "KL divergence",
                  "PPL ratio", "Chi-squared divergence", "not logged in this history"):
        assert title in text
    assert mon.alerts[0].name in text  # the first alert is labelled
    # seed 001's dict-of-lists history works too
    plot_metrics({P + "kl": [0.01, 0.02], P + "chi2_token": [0.1, 0.2]}, tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_engine_named_mismatch_metrics_are_read_and_rules_watch_them():
    """A log that holds only an engine's own names (verl's debug metrics, NeMo-RL's, slime's) is read
    under ours; ours win when both are present; the probability-space trend rules watch them."""
    from rollout_correction import engine_metrics
    from rollout_correction.monitor.monitor import canonical_metrics

    logged = {"training/rollout_probs_diff_mean": 0.02, "train/js_divergence_error": 1e-3,
              "train/train_rollout_logprob_abs_diff": 0.05, "train/gen_kl_error": 2e-3, "step": 3,
              "train/rollout_corr/k3_kl": 4e-3}
    got = canonical_metrics(logged)
    assert got == {"prob_abs_diff_mean": 0.02, "js_divergence": 1e-3, "log_prob_abs_diff_seq_mean": 0.05,
                   "k3_kl": 4e-3}
    assert {m for _, m, *_ in TREND_SPEC} >= {"prob_abs_diff_mean", "js_divergence"}
    ours = {"rollout_corr/js_divergence": 0.5, "rollout_corr/k3_kl": 0.25, "rollout_corr/kl": 0.1}
    assert engine_metrics(ours, "nemo_rl") == {"gen_kl_error": 0.25, "js_divergence_error": 0.5}
    assert engine_metrics(ours, "verl") == {}
    with pytest.raises(ValueError, match="known engines"):
        engine_metrics(ours, "skyrl")
