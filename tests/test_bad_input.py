"""Bad input: a clear error naming the problem, or a documented safe result — never NaN/inf out."""

import math

import pytest
import torch

from rollout_correction_core import (RolloutCorrectionConfig, compute_offpolicy_metrics, compute_policy_loss,
                                     compute_rollout_correction)


NAN, INF = float("nan"), float("inf")
P = "rollout_corr/"

PRESETS = ["decoupled_token_is", "decoupled_seq_is_rs", "geo_mis", "decoupled_token_icepop", "bypass_pg_is",
           "decoupled_k3_rs_token_tis", "seq_is+batch_norm", "token_is+batch_norm"]


def _cfg(name):
    """A preset by name; "<preset>+batch_norm" adds batch normalisation of the weights."""
    base, _, extra = name.partition("+")
    cfg = RolloutCorrectionConfig.from_preset(base)
    return cfg.replace(rollout_is_batch_normalize=True) if extra else cfg


def _clean(B=3, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2 - 0.1
    old = (rollout + torch.randn(B, T, generator=g) * 0.1).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3] = False
    return old, rollout, mask


def _all_finite(out):
    floats = out.metrics_as_floats()
    assert all(math.isfinite(v) for v in floats.values()), floats
    if out.weights is not None:
        assert torch.isfinite(out.weights).all()
    return floats


# ---------------------------------------------------------------------------- shapes, devices, dtypes
def test_shape_mismatch_names_both_tensors():
    old, rollout, mask = _clean()
    both = r"old_log_prob \(shape \(3, 4\).* vs rollout_log_prob \(shape \(3, 5\)"
    with pytest.raises(ValueError, match=both):
        compute_rollout_correction(old, torch.zeros(3, 5), mask)
    both = r"old_log_prob \(shape \(3, 4\).* vs response_mask \(shape \(4, 3\)"
    with pytest.raises(ValueError, match=both):
        compute_rollout_correction(old, rollout, mask.T)
    with pytest.raises(ValueError, match=r"must be 2-D \(batch, response_length\)"):
        compute_rollout_correction(old[0], rollout[0], mask[0])


def test_device_mismatch_names_both_tensors():
    old, rollout, mask = _clean()
    with pytest.raises(ValueError, match=r"device mismatch: old_log_prob .*cpu.* vs rollout_log_prob .*meta"):
        compute_rollout_correction(old, rollout.to("meta"), mask)


def test_integer_log_probs_are_refused():
    old, rollout, mask = _clean()
    with pytest.raises(TypeError, match="rollout_log_prob .*torch.int64.* floating-point"):
        compute_rollout_correction(old, rollout.long(), mask)
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        compute_rollout_correction(old.tolist(), rollout, mask)


def test_policy_loss_shape_mismatch_names_both_tensors():
    old, rollout, mask = _clean()
    with pytest.raises(ValueError, match=r"log_prob \(shape \(3, 4\).* vs advantages \(shape \(3, 1\)"):
        compute_policy_loss(old, old, torch.ones(3, 1), mask, config=RolloutCorrectionConfig())
    with pytest.raises(ValueError, match="bypass mode needs rollout_log_prob"):
        compute_policy_loss(old, None, torch.ones(3, 4), mask, config=RolloutCorrectionConfig.bypass_ppo_clip())
    with pytest.raises(ValueError, match="decoupled mode needs old_log_prob"):
        compute_policy_loss(old, None, torch.ones(3, 4), mask, config=RolloutCorrectionConfig(),
                            rollout_log_prob=rollout)


# ---------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("where,value", [("old", NAN), ("rollout", INF), ("old", -INF), ("rollout", NAN),
                                         ("old", INF)])
@pytest.mark.parametrize("preset", PRESETS)
def test_nonfinite_at_valid_position_rejects_the_row(preset, where, value):
    cfg = _cfg(preset)
    old, rollout, mask = _clean()
    ref = compute_rollout_correction(old[[0, 2]], rollout[[0, 2]], mask[[0, 2]], config=cfg)  # without row 1
    (old if where == "old" else rollout)[1, 2] = value
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    floats = _all_finite(out)
    assert not out.response_mask[1].any()
    assert torch.equal(out.response_mask[[0, 2]], ref.response_mask)
    if out.weights is not None:
        assert torch.all(out.weights[1] == 0)
        torch.testing.assert_close(out.weights[[0, 2]], ref.weights)
    assert floats[P + "nonfinite_seq_fraction"] == pytest.approx(1 / 3)
    # Every other metric is that of the batch without the bad row.
    ref_floats = ref.metrics_as_floats()
    for k, v in ref_floats.items():
        if k != P + "nonfinite_seq_fraction":
            assert floats[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_nonfinite_with_raise_names_row_and_column():
    old, rollout, mask = _clean()
    old[2, 1] = NAN
    cfg = RolloutCorrectionConfig.decoupled_token_is().replace(on_nonfinite="raise")
    with pytest.raises(ValueError, match=r"row 2, column 1"):
        compute_rollout_correction(old, rollout, mask, config=cfg)
    with pytest.raises(ValueError, match=r"row 2, column 1"):
        compute_offpolicy_metrics(old, rollout, mask, on_nonfinite="raise")
    lp = old.clone()
    with pytest.raises(ValueError, match=r"row 2, column 1"):
        compute_policy_loss(lp, rollout, torch.ones(3, 4), mask, config=cfg, rollout_log_prob=rollout)


def test_nonfinite_in_policy_loss_inputs_drops_the_row():
    old, rollout, mask = _clean()
    lp = old.clone().requires_grad_(True)
    adv = torch.ones(3, 4)
    adv[1, 0] = NAN
    loss, m = compute_policy_loss(lp, old, adv, mask, config=RolloutCorrectionConfig.decoupled_token_is(),
                                  rollout_log_prob=rollout)
    assert math.isfinite(loss.item())
    loss.backward()
    assert torch.isfinite(lp.grad).all() and torch.all(lp.grad[1] == 0)
    assert m["actor/nonfinite_seq_fraction"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize("preset", PRESETS)
def test_garbage_at_masked_positions_changes_nothing(preset):
    cfg = _cfg(preset)
    old, rollout, mask = _clean()
    mask[1, 1:] = False
    ref = compute_rollout_correction(old, rollout, mask, config=cfg)
    old2, rollout2 = old.clone(), rollout.clone()
    old2[~mask] = torch.tensor([NAN, INF, -INF, 1e30])
    rollout2[0, 3] = NAN
    out = compute_rollout_correction(old2, rollout2, mask, config=cfg)
    assert out.metrics_as_floats() == ref.metrics_as_floats()
    assert torch.equal(out.response_mask, ref.response_mask)
    if ref.weights is not None:
        assert torch.equal(out.weights, ref.weights)


# ---------------------------------------------------------------------------- empty inputs
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("preset", PRESETS)
def test_empty_batches_give_zero_metrics(preset, shape):
    cfg = _cfg(preset)
    zeros = torch.zeros(shape)
    out = compute_rollout_correction(zeros, zeros, torch.zeros(shape, dtype=torch.bool), config=cfg)
    floats = _all_finite(out)
    assert out.response_mask.shape == shape
    if out.weights is not None:
        assert out.weights.shape == shape
    assert all(v == 0.0 for k, v in floats.items() if k != P + "rollout_is_batch_norm_factor"), floats


@pytest.mark.parametrize("preset", PRESETS + ["geo_rs", "seq_mis"])
def test_all_masked_batch_is_safe(preset):
    cfg = _cfg(preset)
    cfg = cfg.replace(rollout_is_batch_normalize=True) if cfg.is_enabled else cfg
    old, rollout, _ = _clean()
    mask = torch.zeros(3, 4, dtype=torch.long)
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    floats = _all_finite(out)
    assert torch.equal(out.response_mask, mask) and out.response_mask.dtype == torch.long
    if out.weights is not None:
        assert torch.all(out.weights == 0)
        assert floats[P + "rollout_is_batch_norm_factor"] == 1.0  # nothing to normalise
    assert all(v == 0.0 for k, v in floats.items() if not k.endswith("batch_norm_factor"))


# ---------------------------------------------------------------------------- reduced precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", PRESETS)
def test_half_precision_inputs_match_fp32_on_the_same_values(preset, dtype):
    cfg = _cfg(preset)
    old, rollout, mask = _clean(B=4, T=6, seed=3)
    old_h, rollout_h = old.to(dtype), rollout.to(dtype)
    low = compute_rollout_correction(old_h, rollout_h, mask, config=cfg)
    ref = compute_rollout_correction(old_h.float(), rollout_h.float(), mask, config=cfg)
    assert torch.equal(low.response_mask, ref.response_mask)
    if ref.weights is not None:
        assert low.weights.dtype == torch.float32
        torch.testing.assert_close(low.weights, ref.weights, rtol=1e-6, atol=1e-7)
    a, b = low.metrics_as_floats(), ref.metrics_as_floats()
    assert a == pytest.approx(b, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_policy_loss_matches_fp32(dtype):
    old, rollout, mask = _clean(B=4, T=6, seed=4)
    adv = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    cfg = RolloutCorrectionConfig.bypass_pg_is()
    lp_h = (old + 0.05).to(dtype).requires_grad_(True)
    lp_f = lp_h.detach().float().requires_grad_(True)
    loss_h, _ = compute_policy_loss(lp_h, None, adv.to(dtype), mask, config=cfg, rollout_log_prob=rollout.to(dtype))
    loss_f, _ = compute_policy_loss(lp_f, None, adv.to(dtype).float(), mask, config=cfg,
                                    rollout_log_prob=rollout.to(dtype).float())
    assert loss_h.item() == pytest.approx(loss_f.item(), rel=1e-5)
    loss_h.backward()
    loss_f.backward()
    assert lp_h.grad.dtype == dtype and torch.isfinite(lp_h.grad.float()).all()
    torch.testing.assert_close(lp_h.grad.float(), lp_f.grad.to(dtype).float())


# ---------------------------------------------------------------------------- mask values
@pytest.mark.parametrize("bad", [2.0, 0.5, -1.0, NAN])
def test_mask_values_other_than_zero_one_are_refused_or_mean_valid(bad):
    # Either a clear error naming response_mask, or "non-zero means valid" — never weights of
    # ρ^2 (mask 2), √ρ (mask 0.5), negative (mask −1) or NaN.
    old, rollout, mask = _clean()
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    odd = mask.float()
    odd[1, 1] = bad
    try:
        out = compute_rollout_correction(old, rollout, odd, config=cfg)
    except ValueError as e:
        assert "response_mask" in str(e)
        return
    ref = compute_rollout_correction(old, rollout, odd != 0, config=cfg)
    _all_finite(out)
    torch.testing.assert_close(out.weights, ref.weights)
    assert out.metrics_as_floats() == ref.metrics_as_floats()


def test_nonfinite_precomputed_weights_drop_the_row_and_masked_ones_do_not_matter():
    old, rollout, mask = _clean()
    lp = (old + 0.05).requires_grad_(True)
    adv = torch.ones(3, 4)
    w = torch.full((3, 4), 1.5)
    w[0, 3] = NAN  # masked position: ignored
    cfg = RolloutCorrectionConfig().replace(on_nonfinite="raise")
    loss_ok, _ = compute_policy_loss(lp, old, adv, mask, config=cfg, rollout_is_weights=w)
    assert math.isfinite(loss_ok.item())
    w[2, 0] = INF  # valid position
    with pytest.raises(ValueError, match=r"rollout_is_weights.*row 2, column 0"):
        compute_policy_loss(lp, old, adv, mask, config=cfg, rollout_is_weights=w)
    loss, m = compute_policy_loss(lp, old, adv, mask, config=RolloutCorrectionConfig(), rollout_is_weights=w)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and torch.all(lp.grad[2] == 0) and torch.all(lp.grad[1] != 0)
    assert m["actor/nonfinite_seq_fraction"].item() == pytest.approx(1 / 3)
