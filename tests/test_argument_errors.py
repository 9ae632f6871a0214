"""The functional pieces' errors name the function that was called and its own argument, and say what is
allowed: a caller who never built a ``RolloutCorrectionConfig`` never reads about one (docs/api.md).

Each case calls a root function with one bad argument and matches the whole message: the function, the
argument as the caller wrote it, the value, and the allowed values or range."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch

from rollout_correction_core import (LOSS_AGG_MODES, Aggregation, ClipRange, ConfigError, CorrectionAccumulator,
                                     MissingSettingError, OffPolicyAccumulator, PolicyLoss, agg_loss,
                                     compute_offpolicy_metrics, compute_policy_loss, is_weights, log_ratio,
                                     policy_loss_term, ppo_clip_loss, rejection_mask)
from rollout_correction_core.primitives import RS_OPTIONS, IsLevel, IsMode, LossType

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]])
ROLLOUT = torch.tensor([[-1.1, -1.9, -0.7], [-0.2, -1.0, -2.5]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([[1.0, -1.0, 0.5], [0.2, 0.3, -0.4]])

LEVELS, MODES, LOSS_TYPES = list(get_args(IsLevel)), list(get_args(IsMode)), list(get_args(LossType))


def _raises(kind, *fragments):
    """pytest.raises of ``kind`` whose message holds every fragment, in order."""
    return pytest.raises(kind, match=".*".join(re.escape(f) for f in fragments))


@pytest.mark.parametrize("kwargs,kind,fragments", [
    ({"level": "seq"}, ConfigError, ["is_weights: level='seq' is invalid", str(LEVELS)]),
    ({"level": None}, ConfigError, ["is_weights: level=None is invalid", str(LEVELS)]),
    ({"mode": "trunc"}, ConfigError, ["is_weights: mode='trunc' is invalid", str(MODES)]),
    ({"upper": -1.0}, ConfigError, ["is_weights: upper=-1.0 is invalid", "must be > 0"]),
    ({"upper": "two"}, ConfigError, ["is_weights: upper='two' is invalid", "expected a number"]),
    ({"upper": None}, MissingSettingError, ["is_weights: upper=None is invalid", "required when level='token'"]),
    ({"mode": "clip", "lower": 3.0}, ConfigError, ["is_weights: lower=3.0 is invalid", "must lie in [0, upper=2.0]"]),
])
def test_is_weights_names_its_arguments(kwargs, kind, fragments):
    with _raises(kind, *fragments) as error:
        is_weights(OLD, ROLLOUT, MASK, **kwargs)
    assert "RolloutCorrectionConfig" not in str(error.value) and "rollout_is" not in str(error.value)


@pytest.mark.parametrize("criterion,threshold,kind,fragments", [
    ("seq_mean_k4", 0.1, ConfigError, ["rejection_mask: criterion='seq_mean_k4' is invalid",
                                       "did you mean 'seq_mean_k3'?", "'seq_max_k3'"]),
    ("seq_mean_k3,foo", 0.1, ConfigError, ["rejection_mask: criterion='seq_mean_k3,foo' is invalid",
                                           "unknown option 'foo'", "'token_k1'"]),
    ("", 0.1, ConfigError, ["rejection_mask: criterion='' is invalid", "expected at least one option"]),
    (None, 0.1, TypeError, ["rejection_mask: criterion=None is invalid", "'seq_mean_k3'", str(sorted(RS_OPTIONS))]),
    ("seq_mean_k3", -0.1, ConfigError, ["rejection_mask: threshold[seq_mean_k3]=-0.1 is invalid", "must be > 0"]),
    ("seq_mean_k3", None, MissingSettingError, ["rejection_mask: threshold=None is invalid",
                                                "required when criterion='seq_mean_k3'"]),
    ("seq_mean_k1", "2_1", ConfigError, ["rejection_mask: threshold[seq_mean_k1]='2_1' is invalid",
                                         "lower bound 2.0 exceeds upper bound 1.0"]),
])
def test_rejection_mask_names_its_arguments(criterion, threshold, kind, fragments):
    with _raises(kind, *fragments) as error:
        rejection_mask(OLD, ROLLOUT, MASK, criterion, threshold)
    assert "RolloutCorrectionConfig" not in str(error.value) and "rollout_rs" not in str(error.value)


def test_log_ratio_names_its_tensors():
    with _raises(ValueError, "old_log_prob (shape (2, 3)", "vs rollout_log_prob (shape (2, 2)"):
        log_ratio(OLD, ROLLOUT[:, :2], MASK)
    with _raises(TypeError, "old_log_prob (shape (2, 3), torch.int64", "must be a floating-point tensor"):
        log_ratio(OLD.long(), ROLLOUT, MASK)
    with _raises(TypeError, "response_mask must be a torch.Tensor, got list"):
        log_ratio(OLD, ROLLOUT, MASK.tolist())


@pytest.mark.parametrize("call,kind,fragments", [
    (lambda: ppo_clip_loss(OLD, ROLLOUT, ADV, ClipRange(dual=0.5)), ValueError,
     ["ppo_clip_loss: clip.dual=0.5 is invalid", "must be > 1"]),
    (lambda: ppo_clip_loss(OLD, ROLLOUT, ADV, ClipRange(low=-0.1)), ValueError,
     ["ppo_clip_loss: clip.low=-0.1, clip.high=0.2 are invalid", "must be ≥ 0"]),
    (lambda: ppo_clip_loss(OLD, ROLLOUT, ADV, 0.2), TypeError,
     ["ppo_clip_loss: clip=0.2 is not a ClipRange", "ClipRange(low, high, dual)"]),
    (lambda: policy_loss_term(OLD, ROLLOUT, ADV, MASK, loss_type="ppo"), ValueError,
     ["policy_loss_term: loss_type='ppo' is invalid", str(LOSS_TYPES)]),
    (lambda: policy_loss_term(OLD, ROLLOUT, ADV, MASK, clip=ClipRange(dual=1.0)), ValueError,
     ["policy_loss_term: clip.dual=1.0 is invalid", "must be > 1"]),
    (lambda: policy_loss_term(OLD, ROLLOUT, ADV, MASK, loss_type="cispo", clip=ClipRange(high=-1.0)), ValueError,
     ["policy_loss_term: clip.low=0.2, clip.high=-1.0 are invalid", "must be ≥ 0"]),
    (lambda: policy_loss_term(OLD, ROLLOUT, ADV, MASK, clip=(0.2, 0.28)), TypeError,
     ["policy_loss_term: clip=(0.2, 0.28) is not a ClipRange"]),
    (lambda: agg_loss(OLD, MASK, Aggregation("mean")), ValueError,
     ["agg_loss: aggregation.mode='mean' is invalid", str(list(LOSS_AGG_MODES))]),
    (lambda: agg_loss(OLD, MASK, "token-mean"), TypeError,
     ["agg_loss: aggregation='token-mean' is not an Aggregation", "Aggregation(mode, ...)"]),
    (lambda: agg_loss(OLD, MASK, Aggregation("token-mean", dp_size=2)), ValueError,
     ["agg_loss: aggregation.mode='token-mean' with aggregation.dp_size=2 needs aggregation.global_num_tokens"]),
    (lambda: agg_loss(OLD, MASK, Aggregation("seq-mean-token-mean", dp_size=4)), ValueError,
     ["with aggregation.dp_size=4 needs aggregation.global_num_seqs"]),
    (lambda: compute_offpolicy_metrics(OLD, ROLLOUT, MASK, on_nonfinite="skip"), ValueError,
     ["compute_offpolicy_metrics: on_nonfinite='skip' is invalid", "['reject', 'raise']"]),
    (lambda: OffPolicyAccumulator(on_nonfinite="drop"), ValueError,
     ["OffPolicyAccumulator: on_nonfinite='drop' is invalid", "['reject', 'raise']"]),
])
def test_loss_and_metric_pieces_name_their_arguments(call, kind, fragments):
    with _raises(kind, *fragments) as error:
        call()
    assert "loss_agg_mode" not in str(error.value) and "clip_ratio" not in str(error.value)


@pytest.mark.parametrize("loss,fragments", [
    (PolicyLoss(ClipRange(0.2, 0.2, 0.5)), ["compute_policy_loss: loss.clip.dual=0.5 is invalid", "must be > 1"]),
    (PolicyLoss(aggregation=Aggregation("mean")),
     ["compute_policy_loss: loss.aggregation.mode='mean' is invalid", str(list(LOSS_AGG_MODES))]),
    (PolicyLoss(aggregation=Aggregation("seq-mean-token-sum", dp_size=2)),
     ["compute_policy_loss: loss.aggregation.mode='seq-mean-token-sum' with loss.aggregation.dp_size=2 needs "
      "loss.aggregation.global_num_seqs"]),
    (Aggregation("token-mean"), ["compute_policy_loss: loss=Aggregation(", "is not a PolicyLoss"]),
])
def test_compute_policy_loss_names_the_loss_settings(loss, fragments):
    """An unknown aggregation mode used to reach the sequence-mean branch unnoticed: now it is refused."""
    with _raises(ValueError if isinstance(loss, PolicyLoss) else TypeError, *fragments):
        compute_policy_loss(OLD, OLD, ADV, MASK, loss=loss)


def test_settings_a_loss_type_does_not_use_are_not_checked():
    """The dual-clip constant c is PPO's: CISPO in bypass mode takes any (c is not part of its loss)."""
    out, _ = compute_policy_loss(OLD, None, ADV, MASK, config="bypass_cispo", rollout_log_prob=ROLLOUT,
                                 loss=PolicyLoss(ClipRange(0.2, 0.28, 0.5)))
    assert torch.isfinite(out)
    term, _, _ = policy_loss_term(OLD, ROLLOUT, ADV, MASK, loss_type="reinforce", clip=ClipRange(dual=0.5))
    assert torch.equal(term, torch.where(MASK.bool(), -ADV * OLD, 0.0))


def test_valid_arguments_still_compute():
    """The checks refuse only what is invalid: the boundaries pass (c just above 1, ratios 0)."""
    loss, clipped, _ = ppo_clip_loss(OLD, OLD, ADV, ClipRange(0.0, 0.0, 1.0 + 1e-6))
    torch.testing.assert_close(loss, -ADV)  # r = 1 inside the clip range
    assert not clipped.any()
    w = is_weights(OLD, ROLLOUT, MASK, "token", "clip", upper=2.0, lower=0.5)
    assert ((w >= 0.5) | (MASK == 0)).all() and (w <= 2.0).all()
    assert CorrectionAccumulator("token_is") is not None
