"""OpenRLHF adapter, against OpenRLHF's real ``PolicyLoss`` (``pip install --no-deps openrlhf==0.10.4``;
the option mapping of 0.11.2 is also checked here, its actor in tests/test_integration_openrlhf_actor.py).

``PolicyLoss`` is loaded unmodified from the installed release by tests/openrlhf_reference.py,
which says what it stands in for (heavy imports the loss never runs: DeepSpeed, Ray, vLLM, the
package ``__init__`` files) and why. Args come from OpenRLHF's own CLI parser. The actor-level
tests (the recipe's launcher and actor subclass over the unedited ``ppo_actor.py``, the denominators OpenRLHF counts) are in
tests/test_integration_openrlhf_actor.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import openrlhf_reference as ref
from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.integrations.openrlhf import (
    OPENRLHF_CORRECTION_GATES,
    RolloutCorrectionPolicyLoss,
    config_from_openrlhf,
    config_from_openrlhf_args,
    config_from_openrlhf_gate,
)

torch.set_num_threads(1)

PolicyLoss = ref.policy_loss_class()
CLI = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--algo.advantage.estimator", "group_norm",
       "--rollout.n_samples_per_prompt", "4"]


def _batch(B=5, T=6, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) - 0.1
    old = (rollout + scale * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    log_probs = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.ones(B, T)
    for i in range(B):
        mask[i, T - i % 3:] = 0
    return log_probs, old, rollout, adv, mask


def _theirs(kind, lo, hi, **kw):
    return PolicyLoss(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[lo, hi],
                      vllm_is_correction_type=kind, **kw)


def _ours(kind, lo, hi, **kw):
    return RolloutCorrectionPolicyLoss(PolicyLoss(**kw), config_from_openrlhf(kind, [lo, hi]))


def _run(fn, log_probs, old, rollout, adv, mask):
    lp = log_probs.detach().clone().requires_grad_(True)
    out = fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
    out[0].backward()
    return out, lp.grad


@pytest.mark.parametrize("kind", ["tis", "icepop"])
@pytest.mark.parametrize("kw", [{}, {"token_level_loss": False}, {"dual_clip": 3.0}])
def test_token_corrections_match_openrlhf_policy_loss(kind, kw):
    batch = _batch(scale=0.8)
    (l_t, clip_t, kl_t, vkl_t), g_t = _run(_theirs(kind, 0.5, 1.5, **kw), *batch)
    (l_o, clip_o, kl_o, vkl_o), g_o = _run(_ours(kind, 0.5, 1.5, **kw), *batch)
    torch.testing.assert_close(l_o, l_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_o, g_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(vkl_o, vkl_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(kl_o, kl_t)
    # The band really bit: some ratios lie outside [0.5, 1.5].
    ratio = torch.exp(batch[1] - batch[2])[batch[4].bool()]
    assert ((ratio < 0.5) | (ratio > 1.5)).any()


def test_seq_mask_tis_matches_openrlhf_when_nothing_is_out_of_band():
    batch = _batch(scale=0.2)
    ratio = torch.exp(batch[1] - batch[2])[batch[4].bool()]
    assert ((ratio > 0.5) & (ratio < 5.0)).all()
    (l_t, *_), g_t = _run(_theirs("seq-mask-tis", 0.5, 5.0), *batch)
    (l_o, *_), g_o = _run(_ours("seq-mask-tis", 0.5, 5.0), *batch)
    torch.testing.assert_close(l_o, l_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_o, g_t, rtol=1e-5, atol=1e-7)


def test_seq_mask_tis_rejected_rows_leave_the_denominator():
    log_probs, old, rollout, adv, mask = _batch(scale=0.2)
    rollout = rollout.clone()
    rollout[1] = old[1] - 3.0  # every ratio e³ ≈ 20 > 5: the row's geometric mean is out of band
    batch = (log_probs, old, rollout, adv, mask)
    (l_t, *_), _ = _run(_theirs("seq-mask-tis", 0.5, 5.0), *batch)
    loss = _ours("seq-mask-tis", 0.5, 5.0)
    (l_o, *_), _ = _run(loss, *batch)
    # OpenRLHF zeroes the row's loss but still divides by all tokens; we divide by the kept ones.
    n_all, n_kept = mask.sum(), mask.sum() - mask[1].sum()
    torch.testing.assert_close(l_o, l_t * n_all / n_kept, rtol=1e-5, atol=1e-7)
    assert loss.last_metrics["rollout_corr/rollout_rs_seq_masked_fraction"].item() == pytest.approx(1 / 5)


def test_seq_mask_tis_overflow_is_fixed():
    log_probs, old, rollout, adv, mask = _batch(B=3, T=200, scale=0.0)
    mask = torch.ones_like(mask)
    old, rollout = old.clone() - 1.0, rollout.clone() - 1.0
    # Row 0: one token with log ρ = +100 and 199 tokens at −99/199. The geometric-mean ratio lies in
    # [0.5, 5] raw (OpenRLHF: e^(1/200)) and with per-token log-ratios clamped to ±20 (ours:
    # e^(−79/200) ≈ 0.67), so both accept the row; OpenRLHF then multiplies by exp(100) = inf.
    rollout[0] = old[0] - torch.tensor([100.0] + [-99.0 / 199] * 199)  # log-probs stay ≤ 0
    adv[0] = 1.0
    batch = (log_probs, old, rollout, adv, mask)
    (l_t, *_), g_t = _run(_theirs("seq-mask-tis", 0.5, 5.0), *batch)
    assert not torch.isfinite(l_t) or not torch.isfinite(g_t).all()
    loss = _ours("seq-mask-tis", 0.5, 5.0)
    (l_o, *_), g_o = _run(loss, *batch)
    assert torch.isfinite(l_o) and torch.isfinite(g_o).all()
    assert loss.last_metrics["rollout_corr/rollout_rs_seq_masked_fraction"].item() == 0.0  # row 0 kept
    # The token's weight is clamped to OpenRLHF's TIS bound, 5.
    w = compute_rollout_correction(old, rollout, mask, config=config_from_openrlhf("seq-mask-tis", [0.5, 5.0])).weights
    assert w[0, 0].item() == pytest.approx(5.0)


def test_option_errors_name_the_problem():
    with pytest.raises(ValueError, match="is_correction_type"):
        config_from_openrlhf("tls", [0.5, 5.0])
    with pytest.raises(ValueError, match="LOW < HIGH"):
        config_from_openrlhf("tis", [5.0, 0.5])
    with pytest.raises(ValueError, match="two values"):
        config_from_openrlhf("tis", [3.0])
    # OpenRLHF 0.11.2's options: the combinations without an equivalent are refused by name.
    with pytest.raises(ValueError, match="is_correction_level is off"):
        config_from_openrlhf_gate("off")
    for gating in ("binary_kl", "tv"):  # a divergence gates (mask); it is no weight to clip, nor a band
        assert config_from_openrlhf_gate("seq", "mask", gating, [0.01]).rollout_rs == f"seq_mean_{gating}"
        assert config_from_openrlhf_gate("token", "mask", gating, [0.0, 0.01]).rollout_rs == f"token_{gating}"
        with pytest.raises(ValueError, match=f"is_correction_gating {gating} with --algo.advantage."
                                             "is_correction_mode clip: a divergence is a rejection filter"):
            config_from_openrlhf_gate("token", "clip", gating, [0.01])
        with pytest.raises(ValueError, match="takes an upper bound only"):
            config_from_openrlhf_gate("seq", "mask", gating, [0.001, 0.01])
    with pytest.raises(ValueError, match="is_correction_mode clip is not a correction"):
        config_from_openrlhf_gate("seq", "clip")
    with pytest.raises(ValueError, match=r"is_correction_mode 'clamp' is not one of \['mask', 'clip'\]"):
        config_from_openrlhf_gate("token", "clamp")


def test_gate_options_map_onto_the_three_types():
    for gate, kind in OPENRLHF_CORRECTION_GATES.items():
        assert config_from_openrlhf_gate(*gate, [0.5, 5.0]) == config_from_openrlhf(kind, [0.5, 5.0])
    # A single HIGH (0.11.2's upper bound only) is LOW = 0.
    upper_only = config_from_openrlhf_gate("token", "clip", "ratio", [2.0])
    assert upper_only == config_from_openrlhf("tis", [0.0, 2.0])


def test_seq_mask_tis_without_lower_bound_rejects_only_above():
    """LOW = 0: a sequence whose geometric-mean ratio is e^-30 (every log-ratio beyond the ±20
    clamp) is kept, one at e^3 > 5 is rejected."""
    _, old, rollout, _, mask = _batch(B=3, T=4, scale=0.0)
    mask = torch.ones_like(mask)
    old = old.clone()
    old[0] = rollout[0] - 30.0
    old[1] = rollout[1] + 3.0
    result = compute_rollout_correction(old, rollout, mask, config=config_from_openrlhf("seq-mask-tis", [0.0, 5.0]))
    assert result.response_mask.bool().all(-1).tolist() == [True, False, True]


def test_from_args_on_openrlhf_cli_builds_the_real_policy_loss_and_matches():
    args = ref.parse_cli(CLI + ["--actor.eps_clip_low_high", "0.2", "0.28", "--algo.advantage.is_correction_enable",
                                "--algo.advantage.is_correction_type", "icepop",
                                "--algo.advantage.is_correction_threshold", "0.5", "1.5"])
    ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=PolicyLoss)
    assert isinstance(ours.policy_loss, PolicyLoss) and not ours.policy_loss.enable_vllm_is_correction
    assert config_from_openrlhf_args(args) == config_from_openrlhf("icepop", [0.5, 1.5])
    theirs = _theirs("icepop", 0.5, 1.5, clip_eps_low=0.2, clip_eps_high=0.28)
    batch = _batch(scale=0.8, seed=3)
    (l_t, *_), _ = _run(theirs, *batch)
    (l_o, *_), _ = _run(ours, *batch)
    torch.testing.assert_close(l_o, l_t, rtol=1e-5, atol=1e-7)
    # A preset of this library in place of OpenRLHF's type.
    assert RolloutCorrectionPolicyLoss.from_args(args, "decoupled_geo_rs_token_tis", policy_loss_cls=PolicyLoss
                                                 ).config.rs_options[0].name == "seq_mean_k1"


def test_the_segment_level_is_refused():
    """OpenRLHF's loss call carries no segment ids."""
    with pytest.raises(ValueError, match=r"rollout_rs option 'segment_sum_k1'.*OpenRLHF"):
        RolloutCorrectionPolicyLoss(PolicyLoss(), RolloutCorrectionConfig(rollout_rs="segment_sum_k1",
                                                                          rollout_rs_threshold=2.0))


def test_wrapping_a_correcting_loss_is_refused():
    with pytest.raises(ValueError, match="correction would be applied twice"):
        RolloutCorrectionPolicyLoss(_theirs("tis", 0.5, 5.0), config_from_openrlhf("tis", [0.5, 5.0]))
    loss = _ours("tis", 0.5, 5.0)
    lp, old, rollout, adv, mask = _batch()
    with pytest.raises(ValueError, match="rollout_log_probs"):
        loss(lp, old, adv, action_mask=mask)
    assert math.isfinite(loss(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)[0].item())


ROOTS = ref.source_roots()


ROOT_IDS = [ref.release_of(r) if i else "installed" for i, r in enumerate(ROOTS)]


@pytest.mark.parametrize("root", ROOTS, ids=ROOT_IDS)
def test_example_runs_as_documented(root):
    """examples/integration_openrlhf.py, as the docs say to run it, with each release importable as
    ``openrlhf``: args from its parser (its flags), row 3 rejected (800 → 600 counted tokens),
    OpenRLHF's seq-mask-tis overflows, ours does not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ)
    if root != ROOTS[0]:  # the unpacked wheel's purelib directory holds the package `openrlhf`
        env["PYTHONPATH"] = os.pathsep.join([str(root.parent), *filter(None, [env.get("PYTHONPATH")])])
    example = Path(__file__).resolve().parents[1] / "examples" / "integration_openrlhf.py"
    code = ("import importlib.util, runpy, sys; print('openrlhf at', importlib.util.find_spec('openrlhf')"
            ".submodule_search_locations[0]); runpy.run_path(sys.argv[1], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, str(example)], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert f"openrlhf at {root}" in out
    assert "action tokens OpenRLHF counts: 800 -> 600" in out
    assert "rejected token fraction per sample: [0.0, 0.0, 0.0, 1.0]" in out
    assert "OpenRLHF seq-mask-tis    loss -inf  gradient finite: False" in out
    assert "gradient finite: True" in out.split("rollout-correction", 1)[1]
