"""GSPO, CISPO, DPPO-TV and DPPO-KL side by side with verl 0.9.1's own ``core_algos`` functions.

verl's files run unmodified (see tests/verl_reference.py); its ``ActorConfig`` carries the clip
range, the dual-clip / truncation constant and the global batch information. Both sides get the
same log-probs, advantages, response mask and IS weights — ours computed by the library from the
rollout log-probs inside ``compute_policy_loss``, verl's handed to it as ``rollout_is_weights``
together with the rejection-adjusted mask, as verl's trainer does. Losses, gradients with respect
to the current log-probs, and verl's three loss metrics must agree.
"""

from __future__ import annotations

import pytest
import torch

from verl_reference import assert_metrics_match, load_verl_core_algos, require_verl

require_verl()

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction  # noqa: E402
from rollout_correction import Aggregation, ClipRange, PolicyLoss

VERL_ALGOS = load_verl_core_algos()

LOSSES = {"gspo": "compute_policy_loss_gspo", "cispo": "compute_policy_loss_cispo",
          "dppo_tv": "compute_policy_loss_dppo_tv", "dppo_kl": "compute_policy_loss_dppo_kl"}
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# Correction paired with the loss: none, token TIS, geometric TIS, sequence TIS + sequence RS (rows rejected).
CORRECTIONS = {
    "none": None,
    "token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
    "geo_tis": dict(rollout_is="geometric", rollout_is_threshold=1.5),
    "seq_tis_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
                       rollout_rs_threshold="0.3_3.0"),
}
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


def _actor_config(loss_mode, loss_agg_mode, global_batch_info=None):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                       clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
                       loss_agg_mode=loss_agg_mode, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
                       global_batch_info=global_batch_info or {})


def _inputs(seed, batch=10, length=11):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 2.5 - 0.02
    rollout = (old + 0.4 * torch.randn(batch, length, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    log_prob = (old + 0.7 * torch.randn(batch, length, generator=gen)
                + 0.3 * torch.randn(batch, 1, generator=gen)).clamp(max=-1e-3)
    lengths = torch.randint(2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    adv = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    # Rare tokens whose probability quadruples (0.02 → 0.08): inside both trust regions, r = 4 > c.
    old[1:3, 0], log_prob[1:3, 0] = torch.tensor(0.02).log(), torch.tensor(0.08).log()
    return old, rollout, log_prob, mask, adv


def _run_verl(loss_type, old, log_prob, adv, mask, weights, mode, global_batch_info=None):
    lp = log_prob.clone().requires_grad_(True)
    fn = getattr(VERL_ALGOS, LOSSES[loss_type])
    loss, metrics = fn(old, lp, adv, mask, loss_agg_mode=mode, config=_actor_config(loss_type, mode, global_batch_info),
                       rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _run_ours(cfg, old, rollout, log_prob, adv, mask, mode, **kwargs):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp, old, adv, mask, config=cfg, rollout_log_prob=rollout,
        loss=PolicyLoss(clip=ClipRange(low=CLIP_LOW, high=CLIP_HIGH, dual=CLIP_C), aggregation=Aggregation(mode, **kwargs)))
    loss.backward()
    return loss.detach(), lp.grad, {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", list(LOSSES))
@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_matches_verl(loss_type, correction, mode):
    old, rollout, log_prob, mask, adv = _inputs(7)
    settings = CORRECTIONS[correction]
    cfg = RolloutCorrectionConfig.from_dict({**(settings or {}), "loss_type": loss_type})
    weights, verl_mask = None, mask
    if settings is not None:
        corr = compute_rollout_correction(old, rollout, mask, config=cfg)
        weights, verl_mask = corr.weights, corr.response_mask
        if settings.get("rollout_rs"):
            assert 0 < float(verl_mask.sum()) < float(mask.sum()), "the RS band must reject some rows"
    v_loss, v_grad, v_metrics = _run_verl(loss_type, old, log_prob, adv, verl_mask, weights, mode)
    o_loss, o_grad, o_metrics = _run_ours(cfg, old, rollout if settings else None, log_prob, adv, mask, mode)
    torch.testing.assert_close(o_loss, v_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o_grad, v_grad, rtol=1e-5, atol=1e-6)
    assert_metrics_match(v_metrics, o_metrics, rtol=1e-5, atol=1e-6, context=f"{loss_type} {correction} {mode}")
    assert o_grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_inputs_exercise_every_branch(loss_type):
    """The comparison means something: clipping / trust-region masking happens on some tokens, not all."""
    old, rollout, log_prob, mask, adv = _inputs(7)
    _, _, metrics = _run_ours(RolloutCorrectionConfig(loss_type=loss_type), old, None, log_prob, adv, mask,
                              "token-mean")
    assert 0.05 < metrics["actor/pg_clipfrac"] < 0.95
    if loss_type.startswith("dppo"):
        assert metrics["actor/pg_clipfrac_lower"] > 0  # some kept tokens have r > c: truncated


@pytest.mark.parametrize("loss_type", list(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_denominators_match_verl(loss_type, mode):
    """Global token / sequence counts and dp_size, as verl's trainer passes them in global_batch_info."""
    old, rollout, log_prob, mask, adv = _inputs(11)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, loss_type=loss_type)
    weights = compute_rollout_correction(old, rollout, mask, config=cfg).weights
    n_tok, n_seq = int(mask.sum()) * 3, int((mask.sum(-1) > 0).sum()) * 3
    info = dict(dp_size=3, batch_num_tokens=n_tok, global_batch_size=n_seq)
    v_loss, v_grad, _ = _run_verl(loss_type, old, log_prob, adv, mask, weights, mode, info)
    o_loss, o_grad, _ = _run_ours(cfg, old, rollout, log_prob, adv, mask, mode, global_num_tokens=n_tok,
                                  global_num_seqs=n_seq, dp_size=3)
    torch.testing.assert_close(o_loss, v_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o_grad, v_grad, rtol=1e-5, atol=1e-6)
