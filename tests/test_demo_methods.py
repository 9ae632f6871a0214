"""``rollout-correction demo --methods all``: every method (the verl-preset corrections and the
newer ones) runs through the real trainer, and the report compares them in one table and plot."""

from __future__ import annotations

import json
import math

from rollout_correction import RolloutCorrectionConfig
from rollout_correction.cli import main
from rollout_correction.demo.cli import _method_list
from rollout_correction.demo.config import DEFAULT_METHODS, METHODS


def test_all_expands_to_every_method_and_the_default_is_unchanged():
    assert _method_list("all") == tuple(METHODS)
    assert set(DEFAULT_METHODS) < set(METHODS)
    new = {"geo_is", "opsm", "m2po", "topr", "gspo", "cispo", "dppo_tv", "dppo_kl"}
    assert new <= set(METHODS) and not new & set(DEFAULT_METHODS)
    losses = {RolloutCorrectionConfig.from_preset(METHODS[m].preset).loss_type for m in new}
    assert losses == {"ppo_clip", "topr", "gspo", "cispo", "dppo_tv", "dppo_kl"}


def test_quick_run_of_every_method_writes_one_comparison(tmp_path):
    out = tmp_path / "report"
    code = main(["demo", "--quick", "--methods", "all", "--out", str(out), "--workers", "1", "--no-progress",
                 "--steps", "4", "--eval-every", "2", "--eval-prompts", "32", "--prompts", "4", "--samples", "4",
                 "--sft-steps", "5"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    dense = [m for m in METHODS if not METHODS[m].replay]  # routing replay needs an MoE model
    assert list(summary["methods"]) == dense
    assert sorted(r["method"] for r in summary["runs"]) == sorted(dense)
    for m, s in summary["methods"].items():
        assert s["runs"] == 1 and 0 <= s["collapsed"] <= 1
        assert 0.0 <= s["final_reward"]["mean"] <= s["best_reward"]["mean"] <= 1.0
        assert s["seconds"]["mean"] > 0
        assert s["final_mismatch_kl"] is not None
    report = (out / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| method | preset"))
    assert header.endswith("| wall s / run |")
    for m in METHODS.values():
        if not m.replay:
            assert f"| {m.label} | {m.setting or '—'} |" in report, m.name
    assert (out / "methods.png").stat().st_size > 0 and "![methods](methods.png)" in report


def test_prime_rl_presets_train_in_the_quantized_scenario(tmp_path):
    """prime-rl's IPO and IcePop as rows of the quantized scenario: a quick run of each next to naive,
    through the real trainer, with finite losses and gradients and its own gate's metrics."""
    out = tmp_path / "report"
    code = main(["demo", "--quick", "--scenario", "quantized", "--methods", "naive,prime_rl_ipo,prime_rl_icepop",
                 "--out", str(out), "--workers", "1", "--no-progress", "--steps", "6", "--eval-every", "3",
                 "--eval-prompts", "32", "--prompts", "4", "--samples", "4", "--sft-steps", "20"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == ["naive", "prime_rl_ipo", "prime_rl_icepop"]
    runs = {m: json.loads((out / "runs" / f"{m}-seed0.json").read_text()) for m in summary["methods"]}
    for name in ("prime_rl_ipo", "prime_rl_icepop"):
        history = runs[name]["history"]
        assert len(history["loss"]) == 6 and all(math.isfinite(x) for x in history["loss"] + history["grad_norm"])
        assert all(0.0 <= x <= 1.0 for x in history["rejected"])
        assert METHODS[name].preset == name
    # each ran its own gate: the probability band on Δp, the log-ratio band
    assert "rollout_corr/rollout_rs_token_dp_masked_fraction" in runs["prime_rl_ipo"]["history"]
    assert "rollout_corr/rollout_rs_token_k1_masked_fraction" in runs["prime_rl_icepop"]["history"]
    report = (out / "report.md").read_text()
    assert "| prime-rl IPO | prime_rl_ipo |" in report and "| prime-rl IcePop | prime_rl_icepop |" in report
