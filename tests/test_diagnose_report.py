"""`rollout-correction diagnose`: health verdicts, the recommendation rule, the rendered report,
summary.json and the command line."""

import base64
import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("matplotlib")

from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
from rollout_correction.cli import main
from rollout_correction import RolloutCorrectionConfig
from rollout_correction.diagnose import diagnose_tensors, summary_dict, write_report

torch.set_num_threads(1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic(noise, B=200, T=100, seed=0, tail_fraction=0.0, tail_value=-2.0, shift=0.0):
    """Rollout log-probs ≤ 0; trainer = rollout + shift + N(0, noise²) per token; optional outliers."""
    g = torch.Generator().manual_seed(seed)
    roll = -0.5 - torch.rand(B, T, generator=g) * 2.0
    old = (roll + shift + noise * torch.randn(B, T, generator=g)).clamp(max=0.0)
    if tail_fraction:
        hit = torch.rand(B, T, generator=g) < tail_fraction
        old = torch.where(hit, roll + tail_value, old)
    return old, roll, torch.ones(B, T)


# ---------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("case,kwargs,preset", [
    # k3 ≈ σ²/2 = 0.125 > 0.1 at σ = 0.5 (k1 ≈ 0 for symmetric noise)
    ("severe", dict(noise=0.5), "decoupled_k3_rs_token_tis"),
    # a systematic shift: kl = mean(rollout − old) = 0.15 > 0.1
    ("severe", dict(noise=0.01, shift=-0.15), "decoupled_k3_rs_token_tis"),
    # 2 % of tokens at log ρ = −2 (ρ ≈ 0.14 ∉ [0.5, 2]); kl ≈ 0.04, χ² small
    ("tails", dict(noise=0.001, tail_fraction=0.02), "decoupled_token_icepop"),
    # σ = 1e-4: k3 ≈ σ²/2 = 5e-9, Var(log ∏ρ) = 100·σ² = 1e-6 → ESS ≈ 1
    ("tiny", dict(noise=1e-4), "bypass_ppo_clip"),
    # σ = 0.02 over 100 tokens: Var(log ∏ρ) = 0.04 → ESS ≈ e^−0.04 ≈ 0.96; k3 ≈ 2e-4
    ("seq", dict(noise=0.02), "decoupled_seq_is"),
    # σ = 0.07: Var(log ∏ρ) = 0.49 → ESS ≈ e^−0.49 ≈ 0.61
    ("seq+rs", dict(noise=0.07), "decoupled_seq_is_rs"),
    # σ = 0.2 over 100 tokens: Var(log ∏ρ) = 4 → ESS ≈ e^−4 ≈ 0.02; P(|log ρ| > log 2) ≈ 5e-4
    ("token", dict(noise=0.2), "decoupled_token_is"),
])
def test_recommendation_rule(case, kwargs, preset):
    diag = diagnose_tensors(*synthetic(**kwargs), presets=[])
    rec = diag.recommendation
    assert (rec.case, rec.preset) == (case, preset), rec.reason
    assert preset in RolloutCorrectionConfig.preset_names()
    assert rec.reason


def test_agreement_within_the_exact_tolerance_recommends_asserting_it():
    _, roll, mask = synthetic(noise=0.0)
    old = roll.clone()
    old[3, 7] += 5e-7  # one token off by float32 rounding of 5e-7: within slime's CI tolerance 1e-6
    rec = diagnose_tensors(old, roll, mask, presets=[]).recommendation
    assert (rec.case, rec.preset) == ("exact", "disabled") and "expect_zero_atol=1e-06" in rec.reason
    assert 0 < rec.inputs["log_prob_abs_diff_max"] <= 1e-6
    # slime #830's regression: mean |Δ| 4.5e-4 is negligible for the correction but not exact
    old = (roll + 4.5e-4 * torch.sign(torch.randn(roll.shape, generator=torch.Generator().manual_seed(1)))).clamp(max=0.0)
    rec = diagnose_tensors(old, roll, mask, presets=[]).recommendation
    assert rec.case == "tiny"


def test_k3_above_published_healthy_runs_warns():
    checks = {h.name: h for h in diagnose_tensors(*synthetic(noise=0.2), presets=[]).health}
    k3 = checks["k3 per token vs published healthy runs"]
    assert k3.value == pytest.approx(0.02, rel=0.1) and k3.verdict == "warn"  # k3 ≈ σ²/2 = 0.02 > 0.01
    checks = {h.name: h for h in diagnose_tensors(*synthetic(noise=0.1), presets=[]).health}
    assert checks["k3 per token vs published healthy runs"].verdict == "ok"  # k3 ≈ 0.005, DeepSeek-V4's level


def test_identical_log_probs_recommend_disabled_and_warn():
    _, roll, mask = synthetic(noise=0.0)
    diag = diagnose_tensors(roll.clone(), roll, mask, presets=[])
    assert diag.recommendation.preset == "disabled"
    verdicts = {h.name: h.verdict for h in diag.health}
    assert verdicts["identical log-probs"] == "warn"


def test_health_verdicts_follow_the_published_thresholds():
    healthy = diagnose_tensors(*synthetic(noise=0.01), presets=[])
    assert {h.verdict for h in healthy.health} == {"ok"}
    assert healthy.worst_verdict == "ok"
    bad = diagnose_tensors(*synthetic(noise=0.5, shift=-0.2), presets=[])
    v = {h.name: h for h in bad.health}
    kl = bad.profile.metrics["rollout_corr/kl"]
    assert abs(kl) > 0.1 and v["|kl| (rollout − trainer, per token)"].verdict == "warn"
    assert v["|kl| (rollout − trainer, per token)"].value == pytest.approx(abs(kl))
    # log ∏ρ ~ N(−20, 25) over 100 tokens: ESS ≪ 0.3 and the mean weight far below 0.5
    assert v["ESS (sequence weights)"].verdict == "warn"
    assert v["mean weight (sequence)"].verdict == "warn" and v["mean weight (sequence)"].value < 0.5
    assert bad.worst_verdict == "warn"
    # log ∏ρ ~ N(0, 25): a handful of rows carry weights ≫ 1, std ≫ 1
    wide = {h.name: h for h in diagnose_tensors(*synthetic(noise=0.5), presets=[]).health}
    assert wide["weight std (sequence)"].verdict == "warn" and wide["weight std (sequence)"].value > 1
    assert wide["weight std (token)"].verdict == "ok"  # e^{σ²}(e^{σ²} − 1) ≈ 0.37 → std ≈ 0.6


def test_veto_fraction_and_positive_log_probs():
    old, roll, mask = synthetic(noise=0.01, B=50, T=20)
    old[:10, 3] = roll[:10, 3] + math.log(1e-5)  # 20 % of rows hold a token with ρ = 1e-5 < 1e-4
    diag = diagnose_tensors(old, roll, mask, presets=[])
    v = {h.name: h for h in diag.health}
    assert v["veto fraction (rows with a token ρ < 0.0001)"].value == pytest.approx(0.2)
    assert v["veto fraction (rows with a token ρ < 0.0001)"].verdict == "warn"
    with pytest.raises(ValueError, match="every row holds a value > 0, which no log-probability is"):
        diagnose_tensors(old.exp(), roll.exp(), mask, presets=[])  # probabilities, not log-probs
    half = old.clone()
    half[::2] = half[::2].exp()  # every other row holds probabilities: those rows are dropped and counted
    diag = diagnose_tensors(half, roll, mask, presets=[])
    check = {h.name: h for h in diag.health}["tokens with log-prob > 0"]
    assert check.verdict == "fail" and check.value > 0


def test_one_token_shift_is_flagged():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(64, 41, generator=g) * 3
    old = (lp[:, 1:] + 0.01 * torch.randn(64, 40, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    roll = lp[:, :-1]  # the rollout column is one position early
    diag = diagnose_tensors(old, roll, torch.ones(64, 40), presets=[])
    check = [h for h in diag.health if h.name.startswith("alignment")][0]
    assert check.verdict == "fail" and "shifted" in check.detail
    ok = diagnose_tensors(*synthetic(noise=0.05), presets=[])
    assert [h for h in ok.health if h.name.startswith("alignment")][0].verdict == "ok"


# ---------------------------------------------------------------------------------------- report


@pytest.fixture(scope="module")
def small_diag():
    old, roll, mask = synthetic(noise=0.05, B=120, T=60, seed=3)
    lengths = torch.randint(1, 61, (120,), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(60)[None] < lengths[:, None]).float()
    return diagnose_tensors(old, roll, mask), (old, roll, mask)


@pytest.fixture(scope="module")
def written(small_diag, tmp_path_factory):
    return write_report(small_diag[0], str(tmp_path_factory.mktemp("report")))


def test_report_files_render(small_diag, written):
    diag, _ = small_diag
    for name in ("report.md", "report.html", "summary.json", "diagnose_log_ratio.png", "diagnose_weights.png",
                 "diagnose_position.png", "diagnose_length.png", "diagnose_what_if.png"):
        assert name in written and os.path.getsize(written[name]) > 0, name
    pngs = [n for n in written if n.endswith(".png")]
    for n in pngs:
        with open(written[n], "rb") as fh:
            assert fh.read(8) == PNG_MAGIC
    md = open(written["report.md"], encoding="utf-8").read()
    for n in pngs:
        assert f"]({n})" in md
    assert f"Recommended preset: `{diag.recommendation.preset}`" in md
    assert "rollout_corr/chi2_seq" in md and "What-if" in md
    html = open(written["report.html"], encoding="utf-8").read()
    # self-contained: every figure embedded, no external resource
    embedded = html.count("src='data:image/png;base64,")
    assert embedded == len(pngs)
    assert "http://" not in html and "https://" not in html
    first = html.split("src='data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(first)[:8] == PNG_MAGIC


def test_summary_json_holds_the_core_metrics_recommendation_and_verdicts(small_diag, written):
    diag, (old, roll, mask) = small_diag
    summary = json.load(open(written["summary.json"]))
    ref = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask))
    for k, v in ref.items():
        assert k.startswith("rollout_corr/")
        assert summary[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert summary["recommended_preset"] == diag.recommendation.preset
    assert summary["recommended_preset"] in RolloutCorrectionConfig.preset_names()
    assert summary["health_verdict"] in ("ok", "warn", "fail")
    assert {h["verdict"] for h in summary["health"]} <= {"ok", "warn", "fail"}
    assert {"name", "value", "threshold", "verdict", "detail"} <= set(summary["health"][0])
    assert len(summary["what_if"]) == len(RolloutCorrectionConfig.preset_names())
    assert summary["input"]["tokens"] == int(mask.sum())
    assert summary == json.loads(json.dumps(summary_dict(diag)))  # the file is exactly summary_dict


def test_terminal_summary(small_diag):
    import io

    from rollout_correction.diagnose import print_summary

    diag, _ = small_diag
    buf = io.StringIO()
    print_summary(diag, "out", file=buf)
    text = buf.getvalue()
    assert "Recommended preset" in text and diag.recommendation.preset in text
    assert "Health checks" in text and "k3_kl" in text


def test_summary_fits_an_80_column_terminal(small_diag, monkeypatch):
    """In an 80-column terminal no line is wider and no name is cut (a long preset name folds)."""
    import io
    import re

    from rollout_correction.diagnose import print_summary

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "80")
    diag, _ = small_diag
    buf = Terminal()
    print_summary(diag, "out", file=buf)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()).splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if "…" in line and "rollout_corr/…" not in line]


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless Chromium not installed (.ci/run installs it)")
def test_html_renders_in_headless_chromium(tmp_path, written):
    shot = tmp_path / "shot.png"
    subprocess.run([shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900",
                    f"--screenshot={shot}", "file://" + written["report.html"]],
                   check=True, capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


# ---------------------------------------------------------------------------------------- command line


def test_cli_on_a_file(tmp_path, capsys):
    g = torch.Generator().manual_seed(5)
    roll = -torch.rand(30, 16, generator=g)
    old = (roll + 0.02 * torch.randn(30, 16, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    path = tmp_path / "dump.pt"
    torch.save({"lp_roll": roll, "lp_old": old, "lens": torch.full((30,), 16)}, path)
    out = tmp_path / "rep"
    rc = main(["diagnose", str(path), "--out", str(out), "--rollout-col", "lp_roll", "--old-col", "lp_old",
               "--lengths-col", "lens", "--presets", "decoupled_seq_is,decoupled_token_is", "--quiet"])
    assert rc == 0
    summary = json.load(open(out / "summary.json"))
    ref = metrics_to_floats(compute_offpolicy_metrics(old, roll, torch.ones(30, 16)))
    assert summary["rollout_corr/kl"] == pytest.approx(ref["rollout_corr/kl"], rel=1e-5)
    assert [w["preset"] for w in summary["what_if"]] == ["decoupled_seq_is", "decoupled_token_is"]
    assert capsys.readouterr().out == ""


def test_cli_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "missing.parquet"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["diagnose"]) == 2
    assert "give a FILE" in capsys.readouterr().err
    path = tmp_path / "x.npz"
    np.savez(path, a=np.zeros(3))
    assert main(["diagnose", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "missing column(s)" in capsys.readouterr().err


def test_cli_example_generates_a_real_mismatch(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "ex"
    rc = main(["diagnose", "--example", "--out", str(out), "--example-rows", "24", "--quiet",
               "--presets", "decoupled_seq_is"])
    assert rc == 0
    summary = json.load(open(out / "summary.json"))
    assert os.path.getsize(out / "example_rollouts.parquet") > 0
    assert os.path.getsize(out / "report.html") > 0
    # a bf16 engine with int4 weights vs the fp32 recompute: a small but non-zero gap
    assert 1e-7 < summary["rollout_corr/k3_kl"] < 1e-2
    assert summary["input"]["tokens"] > 24
    assert summary["recommended_preset"] in RolloutCorrectionConfig.preset_names()


def test_log_probs_renormalised_over_a_truncated_support_are_flagged():
    """Rollout log-probs of top-p sampling ('processed'): log q_S(y) = log q(y) − log Z with Z < 1."""
    g = torch.Generator().manual_seed(2)
    logits = 3.0 * torch.randn(64, 30, 50, generator=g)
    full = torch.log_softmax(logits, -1)
    y = torch.distributions.Categorical(logits=logits).sample()
    old = full.gather(-1, y[..., None]).squeeze(-1)
    # keep the 10 most likely tokens, renormalise (the sampled token is made part of the kept set)
    top = torch.topk(full, 10, dim=-1).values
    kept_mass = torch.logsumexp(top, -1).exp()
    sampled_in = (full.gather(-1, y[..., None]).squeeze(-1) >= top[..., -1])
    mass = torch.where(sampled_in, kept_mass, kept_mass + old.exp())
    roll = old - mass.log()
    diag = diagnose_tensors(old, roll, torch.ones(64, 30), presets=[])
    check = {h.name: h for h in diag.health}["tokens where the rollout log-prob is higher"]
    assert check.verdict == "warn" and check.value > 0.95 and "truncated sampling support" in check.detail
    healthy = diagnose_tensors(*synthetic(noise=0.05), presets=[])
    assert {h.name: h for h in healthy.health}["tokens where the rollout log-prob is higher"].verdict == "ok"


def test_optional_columns_add_their_sections(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout_correction.diagnose import diagnose_file

    g = np.random.default_rng(3)
    n = 90
    lengths = g.integers(1, 30, size=n)
    versions = np.arange(n) % 3
    roll = [-g.exponential(1.0, size=L) for L in lengths]
    # staler rows (lower version) carry a larger gap
    old = [np.minimum(r + (0.01 + 0.05 * (2 - v)) * g.standard_normal(L), 0) for r, L, v in zip(roll, lengths, versions)]
    path = tmp_path / "opt.parquet"
    pq.write_table(pa.table({"rollout_log_probs": [r.tolist() for r in roll], "old_log_probs": [o.tolist() for o in old],
                             "responses": [g.integers(0, 20, size=L).tolist() for L in lengths],
                             "reward": g.random(n), "policy_version": versions}), path)
    diag = diagnose_file(str(path), presets=["decoupled_token_is"])
    k3 = {v: e["k3"] / e["tokens"] for v, e in diag.profile.version.items()}
    assert k3[0] > k3[1] > k3[2]
    written = write_report(diag, str(tmp_path / "out"))
    assert os.path.getsize(written["diagnose_version.png"]) > 0
    md = open(written["report.md"], encoding="utf-8").read()
    assert "## By policy version" in md and "## Tokens contributing most to the KL" in md
    assert "Correlation between the reward" in md
    summary = json.load(open(written["summary.json"]))
    assert set(summary["by_policy_version"]) == {"0", "1", "2"}
    assert summary["by_policy_version"]["0"]["k3_kl"] == pytest.approx(k3[0])
