"""``rollout-correction demo --methods all``: every method (the verl-preset corrections and the
newer ones) runs through the real trainer, and the report compares them in one table and plot."""

from __future__ import annotations

import json

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
