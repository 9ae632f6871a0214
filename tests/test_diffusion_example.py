"""The diffusion toy: rollout engine vs trainer log-probs, GRPO advantages, and the example's quick
form end to end (reports written, numbers finite, the fp32 engine has no gap)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout_correction.diffusion.example import main
from rollout_correction.diffusion.toy import (
    RingTarget,
    RolloutEngine,
    VelocityMLP,
    fp8_round_trip,
    group_advantages,
    window_log_probs,
)

torch.set_num_threads(1)


def _model() -> VelocityMLP:
    torch.manual_seed(0)
    return VelocityMLP(hidden=32, depth=2)


def test_fp32_engine_log_probs_equal_the_trainer_recompute():
    model = _model()
    engine = RolloutEngine("fp32")
    engine.load_weights(model)
    traj = engine.sample(64, 6, 1, 3, 0.5, torch.Generator().manual_seed(0))
    assert traj.rollout_log_probs.shape == (64, 3) and traj.states.shape == (64, 4, 2)
    torch.testing.assert_close(window_log_probs(model, traj, 0.5), traj.rollout_log_probs, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp8", torch.bfloat16)]
)
def test_low_precision_engine_states_are_representable_and_log_probs_differ(precision, dtype):
    model = _model()
    engine = RolloutEngine(precision)
    engine.load_weights(model)
    traj = engine.sample(256, 6, 2, 2, 0.3, torch.Generator().manual_seed(1))
    assert torch.equal(traj.states.to(dtype).float(), traj.states)  # sampled in the engine dtype
    gap = (window_log_probs(model, traj, 0.3).detach() - traj.rollout_log_probs).abs()
    assert torch.isfinite(gap).all()
    assert gap.mean() > 0
    # the trainer keeps its own weights in fp32
    assert next(model.parameters()).dtype == torch.float32


def test_fp8_round_trip_error_is_bounded_by_the_e4m3_step():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    q = fp8_round_trip(w)
    # e4m3 has 3 mantissa bits: relative rounding ≤ 2^-4 for normal numbers; subnormals are
    # bounded by the absolute step of the scaled grid, 2^-9 · max|w| / 448 · 448 = 2^-9 · max|w|.
    err = (q - w).abs()
    bound = torch.maximum(w.abs() * 2.0**-4, torch.full_like(w, 2.0**-9 * float(w.abs().max())))
    assert (err <= bound * 1.0001).all()
    assert err.max() > 0


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    # group 1: mean 0.5, std 0.5 → ±0.5 / (0.5 + 1e-4); group 2: identical rewards → 0
    torch.testing.assert_close(adv, torch.tensor([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0]))
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), group_size=2)


def test_group_baselines_leave_out_rejected_trajectories():
    # Group 1 = rewards (1, 0, 0) with trajectory 0 rejected: baseline over (0, 0) → identical
    # rewards, every advantage 0 (with trajectory 0 it would be mean 1/3, std √2/3).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    keep = torch.tensor([False, True, True, True, True, True])
    adv = group_advantages(rewards, group_size=3, keep=keep)
    s = 2**0.5 / 3
    expected = [0.0, 0.0, 0.0, (1 / 3) / (s + 1e-4), -(2 / 3) / (s + 1e-4), (1 / 3) / (s + 1e-4)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert group_advantages(rewards, group_size=3)[1].item() < -0.5


def test_ring_reward_is_one_only_near_a_rewarded_mode():
    target = RingTarget()
    c = target.centers()
    x = torch.stack([c[0], c[2] + 0.4, c[5], torch.zeros(2)])
    torch.testing.assert_close(target.reward(x), torch.tensor([1.0, 0.0, 0.0, 0.0]))  # ‖(0.4,0.4)‖ > 0.5
    torch.testing.assert_close(target.in_any_mode(x), torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_example_quick_form_end_to_end(tmp_path):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    variants = summary["variants"]
    assert set(variants) == {"fp32_reference", "naive", "decoupled_is_rs", "bypass", "bypass_rs"}
    for name, v in variants.items():
        for key in (
            "eval_reward_mean",
            "train_reward_last10pct",
            "logprob_abs_diff_mean",
            "rejected_fraction_mean",
        ):
            assert math.isfinite(v[key]), (name, key)
        assert 0.0 <= v["eval_reward_mean"] <= 1.0
    # the fp32 engine has no gap; the reduced-precision engine has one, reported per denoising step
    assert variants["fp32_reference"]["logprob_abs_diff_mean"] < 1e-6
    assert variants["naive"]["logprob_abs_diff_mean"] > 1e-4
    assert all(float(k) >= 0 for k in variants["naive"]["logprob_abs_diff_per_step"])
    # variants without rejection never reject; the corrected ones report their correction metrics
    for name in ("fp32_reference", "naive", "bypass"):
        assert variants[name]["rejected_fraction_mean"] == 0.0
    assert any(
        k.startswith("rollout_corr/step_") for k in variants["bypass_rs"]["last_correction_metrics_seed0"]
    )
    assert "rollout_corr/rollout_is_mean" in variants["decoupled_is_rs"]["last_correction_metrics_seed0"]
    # nothing was rejected in this short run, so per-step RS left every weight at exactly 1: the
    # bypass run with RS is the same computation as the one without
    assert variants["bypass_rs"]["rejected_fraction_mean"] == 0.0
    assert variants["bypass_rs"]["eval_reward_per_seed"] == variants["bypass"]["eval_reward_per_seed"]
    assert variants["bypass_rs"]["train_reward_last10pct"] == variants["bypass"]["train_reward_last10pct"]
    report = (tmp_path / "report.md").read_text()
    assert "| `bypass_rs` |" in report and "What the numbers show" in report
    for png in ("reward.png", "gap_per_step.png", "mismatch.png"):
        assert (tmp_path / png).stat().st_size > 1000
