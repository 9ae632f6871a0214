"""Diffusion (FlowGRPO-style) rollout correction: hand-computed values for the bypass and decoupled
paths, the clipped loss, all-rejected batches, shape errors and the tuning warnings."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig
from rollout_correction.diffusion import (
    MissingLogProbsError,
    apply_bypass_mode,
    apply_rollout_correction,
    config_notes,
    flow_grpo_loss,
    gaussian_step_log_prob,
    per_step_metrics,
    sde_step_mean_std,
    step_correction,
)
from rollout_correction.diffusion.sde import ode_step, sde_sigma, time_grid

torch.set_num_threads(1)

QUICKSTART = {
    "bypass_mode": True,
    "rollout_is": "sequence",
    "rollout_rs": "seq_mean_k1",
    "rollout_rs_threshold": "0.5_2.0",
}
DECOUPLED = dict(QUICKSTART, bypass_mode=False)
LOG2 = math.log(2.0)


# ----------------------------------------------------------------------------------------- SDE
def test_gaussian_step_log_prob_matches_normal_density_mean_over_dims():
    x_next = torch.tensor([[1.0, 2.0], [-0.5, 0.25]])
    mean = torch.tensor([[0.0, 0.0], [0.5, 0.0]])
    got = gaussian_step_log_prob(x_next, mean, 2.0)
    # by hand, row 0: z = (0.5, 1) → mean(−z²/2) = −0.3125; − log 2 − ½ log 2π
    assert got[0].item() == pytest.approx(-0.3125 - math.log(2.0) - 0.5 * math.log(2 * math.pi), abs=1e-6)
    ref = torch.distributions.Normal(mean, 2.0).log_prob(x_next).mean(-1)
    torch.testing.assert_close(got, ref)


def test_sde_step_mean_std_by_hand_and_eta_zero_is_the_ode_step():
    x = torch.tensor([[1.0, 0.0]])
    v = torch.tensor([[2.0, 0.0]])
    # t = 0.5, h = 0.25, η = 1: σ = √(0.5/0.5) = 1; drift = v + 1/(2·0.5)·(x + 0.5·v) = 2 + 2 = 4
    mean, std = sde_step_mean_std(x, v, 0.5, 0.25, 1.0)
    torch.testing.assert_close(mean, torch.tensor([[0.0, 0.0]]))
    assert std == pytest.approx(0.5)
    mean0, std0 = sde_step_mean_std(x, v, 0.5, 0.25, 0.0)
    torch.testing.assert_close(mean0, ode_step(x, v, 0.25))
    assert std0 == 0.0


def test_sde_sigma_is_capped_at_the_first_step_and_grid():
    assert time_grid(4) == [1.0, 0.75, 0.5, 0.25, 0.0]
    # t = 1 is capped to 1 − h = 0.75: σ = η·√3
    assert sde_sigma(1.0, 0.25, 0.5) == pytest.approx(0.5 * math.sqrt(3.0))


def test_sde_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="std must be > 0"):
        gaussian_step_log_prob(torch.zeros(2, 2), torch.zeros(2, 2), 0.0)
    with pytest.raises(ValueError, match="same shape"):
        gaussian_step_log_prob(torch.zeros(2, 2), torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match="step size"):
        sde_step_mean_std(torch.zeros(1, 2), torch.zeros(1, 2), 0.1, 0.5, 1.0)


# --------------------------------------------------------------------------------------- bypass
def test_apply_bypass_mode_sets_old_to_rollout():
    ro = torch.randn(4, 2)
    batch = {"rollout_log_probs": ro}
    assert apply_bypass_mode(batch) is batch
    assert batch["old_log_probs"] is ro


def test_apply_bypass_mode_works_on_objects_with_a_batch_attribute():
    class Proto:  # the shape of verl's DataProto: tensors live in .batch
        def __init__(self):
            self.batch = {"rollout_log_probs": torch.ones(2, 1)}

    p = Proto()
    apply_bypass_mode(p)
    assert torch.equal(p.batch["old_log_probs"], torch.ones(2, 1))


@pytest.mark.parametrize("batch", [{"old_log_probs": torch.zeros(2, 2)}, {"rollout_log_probs": None}])
def test_apply_bypass_mode_names_the_missing_key(batch):
    with pytest.raises(MissingLogProbsError) as err:
        apply_bypass_mode(batch)
    assert "'rollout_log_probs'" in str(err.value)
    assert isinstance(err.value, KeyError)


# ------------------------------------------------------------------------------------ decoupled
OLD = torch.tensor([[0.1, 0.2], [1.0, 0.9], [-0.3, -0.5]])
RO = torch.zeros(3, 2)


def test_decoupled_weights_are_is_times_rs_keep_by_hand():
    w, m = apply_rollout_correction(OLD, RO, DECOUPLED)
    # row 0: Σ log ρ = 0.3 → IS e^0.3; mean 0.15 ∈ [−log 2, log 2] → kept
    # row 1: Σ = 1.9 → IS min(e^1.9, 2) = 2, but mean 0.95 > log 2 → rejected → 0
    # row 2: Σ = −0.8 → IS e^−0.8; mean −0.4 ≥ −log 2 → kept
    expected = torch.tensor([[math.exp(0.3)] * 2, [0.0, 0.0], [math.exp(-0.8)] * 2])
    torch.testing.assert_close(w, expected)
    assert w.shape == (3, 2) and w.dtype == torch.float32 and not w.requires_grad
    assert m["rollout_corr/rejected_fraction"].item() == pytest.approx(2 / 6)
    assert m["rollout_corr/step_0/logprob_abs_diff"].item() == pytest.approx((0.1 + 1.0 + 0.3) / 3)
    assert m["rollout_corr/step_1/logprob_abs_diff"].item() == pytest.approx((0.2 + 0.9 + 0.5) / 3)
    assert m["rollout_corr/logprob_abs_diff"].item() == pytest.approx(3.0 / 6)
    assert m["rollout_corr/step_1/rejected_fraction"].item() == pytest.approx(1 / 3)
    # the standard set of the core is there, per step too
    for key in (
        "rollout_corr/rollout_is_mean",
        "rollout_corr/kl",
        "rollout_corr/rollout_rs_seq_masked_fraction",
        "rollout_corr/step_0/kl",
        "rollout_corr/step_1/chi2_token",
    ):
        assert key in m
    assert m["rollout_corr/step_0/kl"].item() == pytest.approx(-(0.1 + 1.0 - 0.3) / 3)


def test_decoupled_token_is_without_rs_and_rs_without_is():
    w, _ = apply_rollout_correction(OLD, RO, {"rollout_is": "token", "rollout_is_threshold": 2.0})
    torch.testing.assert_close(w, OLD.exp().clamp(max=2.0))
    w, _ = apply_rollout_correction(OLD, RO, {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"})
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    w, _ = apply_rollout_correction(OLD, RO, {})  # nothing configured: weights 1, metrics only
    torch.testing.assert_close(w, torch.ones(3, 2))


def test_decoupled_non_finite_rollout_row_gets_weight_zero_and_no_nan():
    ro = RO.clone()
    ro[1, 0] = float("nan")
    ro[2, 1] = float("-inf")
    w, m = apply_rollout_correction(OLD, ro, DECOUPLED)
    torch.testing.assert_close(w[0], torch.full((2,), math.exp(0.3)))
    assert torch.equal(w[1:], torch.zeros(2, 2))
    assert all(math.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize(
    "old, ro, match",
    [
        (torch.zeros(3), torch.zeros(3), r"\(B, S\)"),
        (torch.zeros(3, 2), torch.zeros(3, 1), "same"),
        (torch.zeros(3, 2, 1), torch.zeros(3, 2, 1), r"\(B, S\)"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), "floating-point"),
    ],
)
def test_decoupled_shape_errors(old, ro, match):
    with pytest.raises((ValueError, TypeError), match=match):
        apply_rollout_correction(old, ro, DECOUPLED)


def test_quickstart_config_forms_work_unchanged():
    cfg = RolloutCorrectionConfig.from_dict(QUICKSTART)
    assert cfg.bypass_mode and cfg.rollout_is == "sequence"
    k1, _ = step_correction(OLD[:, :1], RO[:, :1], cfg)
    k2, _ = step_correction(OLD[:, :1], RO[:, :1], QUICKSTART)  # a plain mapping is accepted too
    torch.testing.assert_close(k1, k2)


# -------------------------------------------------------------------------------- bypass steps
def test_step_correction_ppo_clip_returns_the_rs_keep_mask_only():
    lp = torch.tensor([[0.1], [1.0], [-1.0]], requires_grad=True)
    keep, m = step_correction(lp, torch.zeros(3, 1), QUICKSTART)
    # log ρ = 0.1 kept; 1.0 > log 2 and −1.0 < −log 2 rejected. IS e^0.1 is NOT applied.
    assert torch.equal(keep, torch.tensor([[1.0], [0.0], [0.0]]))
    assert not keep.requires_grad
    # IS stays a diagnostic: its metrics are reported
    assert m["rollout_corr/rollout_is_max"].item() == pytest.approx(math.exp(1.0), rel=1e-5)
    assert m["rollout_corr/logprob_abs_diff"].item() == pytest.approx(0.7)
    assert m["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(2 / 3)


def test_step_correction_reinforce_applies_is_times_keep():
    keep, _ = step_correction(
        torch.tensor([[0.1], [1.0], [0.5]]), torch.zeros(3, 1), dict(QUICKSTART, loss_type="reinforce")
    )
    torch.testing.assert_close(keep, torch.tensor([[math.exp(0.1)], [0.0], [math.exp(0.5)]]))


def test_step_correction_accepts_1d_and_prefixes_metrics_with_the_step():
    keep, m = step_correction(torch.tensor([0.1, 1.0]), torch.zeros(2), QUICKSTART, step_index=3)
    assert keep.shape == (2,)
    assert torch.equal(keep, torch.tensor([1.0, 0.0]))
    assert m and all(k.startswith("rollout_corr/step_3/") for k in m)
    assert "rollout_corr/step_3/logprob_abs_diff" in m


def test_step_correction_rejects_a_window():
    with pytest.raises(ValueError, match="one SDE step.*apply_rollout_correction"):
        step_correction(torch.zeros(4, 2), torch.zeros(4, 2), QUICKSTART)
    with pytest.raises(ValueError, match="same shape"):
        step_correction(torch.zeros(4, 1), torch.zeros(3, 1), QUICKSTART)


def test_one_step_levels_are_identical_as_the_warning_says():
    g = torch.Generator().manual_seed(0)
    lp, ro = torch.randn(256, 1, generator=g), torch.randn(256, 1, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keeps = [
            step_correction(lp, ro, dict(QUICKSTART, rollout_rs=o))[0]
            for o in ("token_k1", "seq_sum_k1", "seq_mean_k1")
        ]
    assert 0 < keeps[0].sum() < 256
    assert torch.equal(keeps[0], keeps[1]) and torch.equal(keeps[0], keeps[2])


# ------------------------------------------------------------------------------------- warnings
def test_warnings_for_ineffective_settings():
    with pytest.warns(UserWarning, match="token-level and sequence-level rejection are identical"):
        step_correction(torch.zeros(2, 1), torch.zeros(2, 1), dict(QUICKSTART, rollout_rs="token_k1"))
    with pytest.warns(UserWarning, match="test the same k1 statistic"):
        step_correction(
            torch.zeros(2, 1), torch.zeros(2, 1), dict(QUICKSTART, rollout_rs="seq_sum_k1,seq_mean_k1")
        )
    with pytest.warns(UserWarning, match="bypass_mode is False"):
        step_correction(torch.zeros(2, 1), torch.zeros(2, 1), DECOUPLED)
    with pytest.warns(UserWarning, match="decoupled correction is a no-op"):
        apply_rollout_correction(OLD, RO, QUICKSTART)
    with pytest.warns(UserWarning, match="little power with a 2-step SDE window"):
        apply_rollout_correction(OLD, RO, dict(DECOUPLED, rollout_rs="token_k1"))
    with pytest.warns(UserWarning, match="batch_normalize=True has no effect"):
        step_correction(
            torch.zeros(2, 1), torch.zeros(2, 1), dict(QUICKSTART, rollout_is_batch_normalize=True)
        )


def test_recommended_settings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_correction(torch.zeros(2, 1), torch.zeros(2, 1), QUICKSTART)
        apply_rollout_correction(OLD, RO, DECOUPLED)
    assert config_notes(QUICKSTART, window_size=1, path="bypass_step") == []
    assert config_notes(dict(DECOUPLED, rollout_rs="token_k1"), window_size=8, path="decoupled") == []


# ----------------------------------------------------------------------------------------- loss
def test_flow_grpo_loss_by_hand_with_weights_and_gradient():
    # element 0: A = 1, r = 1.5 → max(−1.5, −1.2) = −1.2 (clipped, no gradient)
    # element 1: A = −1, r = 1.1 → max(1.1, 1.1) = 1.1 (inside the band, d/dlog π = −A·r = 1.1)
    lp = torch.tensor([[math.log(1.5)], [math.log(1.1)]], requires_grad=True)
    old = torch.zeros(2, 1)
    adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([[0.5], [2.0]])
    loss, m = flow_grpo_loss(lp, old, adv, w, clip_range=0.2)
    assert loss.item() == pytest.approx((0.5 * -1.2 + 2.0 * 1.1) / 2)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [2.0 * 1.1 / 2]]))
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_higher"].item() == pytest.approx(0.5)
    assert m["actor/kept_fraction"].item() == 1.0


def test_flow_grpo_loss_denominator_all_vs_kept():
    lp = torch.tensor([[math.log(1.5)], [math.log(1.1)]], requires_grad=True)
    args = (lp, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.tensor([[0.0], [2.0]]))
    all_loss, _ = flow_grpo_loss(*args, clip_range=0.2, denominator="all")
    kept_loss, m = flow_grpo_loss(*args, clip_range=0.2, denominator="kept")
    assert all_loss.item() == pytest.approx(2.2 / 2)  # gradient dilution: the rejected row still counts
    assert kept_loss.item() == pytest.approx(2.2 / 1)
    assert m["actor/kept_fraction"].item() == 0.5


def test_flow_grpo_loss_explicit_keep_keeps_zero_weight_in_the_denominator():
    lp = torch.zeros(2, 1, requires_grad=True)
    loss, _ = flow_grpo_loss(
        lp,
        torch.zeros(2, 1),
        torch.tensor([1.0, 1.0]),
        torch.tensor([[0.0], [1.0]]),
        keep=torch.tensor([[True], [True]]),
        denominator="kept",
    )
    assert loss.item() == pytest.approx(-1.0 / 2)


def test_flow_grpo_loss_clamps_advantages_and_broadcasts_them_over_steps():
    lp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = flow_grpo_loss(lp, torch.zeros(1, 3), torch.tensor([10.0]), adv_clip_max=5.0)
    assert loss.item() == pytest.approx(-5.0)


@pytest.mark.parametrize("denominator", ["all", "kept"])
def test_all_rejected_batch_gives_exact_zero_attached_loss_and_zero_gradient(denominator):
    lp = torch.tensor([[0.3, float("nan")], [float("inf"), -2.0]], requires_grad=True)
    old = torch.tensor([[float("-inf"), 0.0], [0.1, float("nan")]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = flow_grpo_loss(lp, old, adv, torch.zeros(2, 2), denominator=denominator)
    assert loss.item() == 0.0
    assert loss.requires_grad and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 2))
    assert m["actor/kept_fraction"].item() == 0.0
    assert all(math.isfinite(float(v)) for v in m.values())


def test_rejected_nan_is_isolated_but_a_kept_nan_is_an_error():
    lp = torch.tensor([[0.0], [float("nan")]], requires_grad=True)
    loss, _ = flow_grpo_loss(lp, torch.zeros(2, 1), torch.tensor([1.0, 1.0]), torch.tensor([[1.0], [0.0]]))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    with pytest.raises(ValueError, match="non-finite"):
        flow_grpo_loss(lp, torch.zeros(2, 1), torch.tensor([1.0, 1.0]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(log_prob=torch.zeros(4)), r"\(B, S\)"),
        (dict(old_log_prob=torch.zeros(4, 3)), "old_log_prob"),
        (dict(advantages=torch.zeros(3)), "advantages has shape"),
        (dict(weights=torch.zeros(4, 3)), "weights has shape"),
        (dict(denominator="mean"), "denominator"),
    ],
)
def test_flow_grpo_loss_shape_errors(kwargs, match):
    args = dict(log_prob=torch.zeros(4, 2), old_log_prob=torch.zeros(4, 2), advantages=torch.zeros(4))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flow_grpo_loss(**args)


def test_bypass_pipeline_loss_equals_the_loss_over_kept_steps_only():
    """bypass: old := rollout; per step keep = RS mask; the loss is the FlowGRPO mean with rejected
    elements contributing 0 — checked against the same sum written out explicitly."""
    g = torch.Generator().manual_seed(3)
    ro = torch.randn(64, 2, generator=g)
    batch = apply_bypass_mode({"rollout_log_probs": ro})
    lp = (ro + 0.8 * torch.randn(64, 2, generator=g)).requires_grad_(True)
    adv = torch.randn(64, generator=g)
    total = 0.0
    manual = 0.0
    for s in range(2):
        keep, _ = step_correction(lp[:, s : s + 1], ro[:, s : s + 1], QUICKSTART, step_index=s)
        loss, _ = flow_grpo_loss(
            lp[:, s : s + 1], batch["old_log_probs"][:, s : s + 1], adv, keep, clip_range=0.2
        )
        total = total + loss / 2
        d = (lp[:, s] - ro[:, s]).detach()
        kept = d.abs() <= LOG2
        r = d.exp()
        per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
        manual += float(per[kept].sum()) / 64 / 2
    assert 0 < int(((lp - ro).detach().abs() > LOG2).sum()) < 128  # some, not all, rejected
    assert total.item() == pytest.approx(manual, rel=1e-5)


def test_per_step_metrics_skip_non_finite_pairs():
    old = torch.tensor([[0.5, 0.0], [float("nan"), 1.0]])
    m = per_step_metrics(old, torch.zeros(2, 2), step_offset=4)
    assert m["rollout_corr/step_4/logprob_abs_diff"].item() == pytest.approx(0.5)
    assert m["rollout_corr/step_5/logprob_abs_diff"].item() == pytest.approx(0.5)


def test_config_from_omegaconf_node_and_bad_config_type():
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(QUICKSTART)
    keep, _ = step_correction(torch.tensor([[0.1], [1.0]]), torch.zeros(2, 1), node)
    assert torch.equal(keep, torch.tensor([[1.0], [0.0]]))
    with pytest.raises(TypeError, match="RolloutCorrectionConfig or a mapping"):
        step_correction(torch.zeros(2, 1), torch.zeros(2, 1), "seq_mean_k1")
    with pytest.raises(ValueError, match="path must be"):
        config_notes(QUICKSTART, window_size=1, path="bypass")


def test_gradient_dilution_and_the_kept_denominator():
    """Under "all" each kept element keeps its 1/(B·S) share and rejected ones give 0, so rejecting
    half the elements halves the total gradient (the dilution note of docs/diffusion.md); "kept"
    divides by the kept count instead, scaling the kept elements' gradient by 1 / kept fraction."""
    g = torch.Generator().manual_seed(5)
    lp0 = 0.05 * torch.randn(8, 2, generator=g)
    adv = torch.randn(8, generator=g)
    keep = torch.tensor([[1.0, 1.0], [0.0, 0.0]] * 4)

    def grad(weights, denominator):
        lp = lp0.clone().requires_grad_(True)
        flow_grpo_loss(lp, torch.zeros(8, 2), adv, weights, clip_range=0.2, denominator=denominator)[
            0
        ].backward()
        return lp.grad

    full = grad(None, "all")
    rows = keep[:, 0].bool()
    torch.testing.assert_close(grad(keep, "all")[rows], full[rows])
    torch.testing.assert_close(grad(keep, "kept")[rows], 2.0 * full[rows])
    assert torch.equal(grad(keep, "all")[~rows], torch.zeros(4, 2))
