"""OPSM, GSPO, CISPO, DPPO and TOPR from the ``algorithm.rollout_correction`` block inside verl 0.9.1's own machinery.

As in tests/test_integration_verl_worker.py (whose helpers this reuses): Hydra composes verl's
``ppo_trainer.yaml`` with the documented override lines plus the method's key, ``OmegaConf.resolve``
as verl's TaskRunner does, ``omega_conf_to_dataclass`` builds the actor config the worker holds,
the correction step is the method of the V1 trainer subclass this library's entry point runs, and the loss is verl's
``verl.workers.utils.losses.ppo_loss`` over verl's micro-batches. Each loss and its gradient (taken
through the nested model output, as verl's backward does) is compared with a hand-written formula;
GSPO, CISPO, DPPO-TV and DPPO-KL with verl's own ``loss_mode`` of that name on the same worker
data and the same IS weights. Each key that cannot act on a route is refused, naming it.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_reference import require_verl

require_verl()

import rollout_correction.integrations.verl as rc_verl  # noqa: E402
from rollout_correction.integrations.verl import main_ppo  # noqa: E402
from test_integration_verl_worker import (SIZES, Rollout, _compose, _compose_verl, _correction_step,  # noqa: E402
                                          _doc_lines, _k3_seq_mean, _ppo_clip, _worker_actor_config,
                                          _worker_update)

ACTOR_LINE = "+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}"
NAME = "compute_rollout_correction_and_add_to_batch"


def _decoupled_lines() -> list[str]:
    return _doc_lines("actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction", "algorithm.adv_estimator=grpo_accepted")


def _bypass_lines() -> list[str]:
    return _doc_lines("bypass_mode=true")


def _total(results, dp: int = 1) -> torch.Tensor:
    return sum(loss for loss, _ in results) / dp


def _check_loss_and_grad(results, expected: torch.Tensor, r: Rollout) -> None:
    total = _total(results)
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(total, r.log_prob, retain_graph=True)
    (grad_hand,) = torch.autograd.grad(expected, r.log_prob, retain_graph=True)
    torch.testing.assert_close(grad, grad_hand.to(grad.dtype), rtol=1e-5, atol=1e-7)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.double()
    return (x.double() * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def _decoupled_step(config, r: Rollout):
    batch, metrics = _correction_step(r.proto(), config)
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0
    block = config.algorithm.rollout_correction
    log_ratio = r.old - r.rollout
    accepted = (_k3_seq_mean(log_ratio, r.mask) <= float(block.rollout_rs_threshold)) & (r.mask.sum(-1) > 0)
    keep = r.mask.bool() & accepted.unsqueeze(-1)
    assert torch.equal(batch.batch["response_mask"].bool(), keep)
    weights = log_ratio.double().exp().clamp(max=float(block.rollout_is_threshold))  # token TIS, π_old/π_rollout
    torch.testing.assert_close(batch.batch["rollout_is_weights"].double(), weights * r.mask)  # zero on padding only
    return batch, keep, weights


# ----------------------------------------------------------------------------- OPSM


@pytest.mark.parametrize("delta", [0.0, 0.02])
def test_opsm_decoupled_drops_negative_advantage_sequences_far_from_pi_theta_in_verls_worker(delta):
    config = _compose(_decoupled_lines() + SIZES + [f"+algorithm.rollout_correction.rollout_opsm_delta={delta}",
                                                    ACTOR_LINE])
    actor = _worker_actor_config(config)
    assert actor.policy_loss.rollout_correction["rollout_opsm_delta"] == delta
    r = Rollout(seed=21, grad=True, noise=0.02)
    batch, keep, weights = _decoupled_step(config, r)
    results, data = _worker_update(batch, config, actor, r)
    assert data["batch_num_tokens"] == int(keep.sum())

    # Hand: verl's loss call passes no rollout log-probs, so D(y) = mean_t log(π_old/π_θ) over the kept
    # tokens (the library's compute_policy_loss without rollout_log_prob); drop A(y) < 0 and D(y) > δ.
    d = _seq_mean(r.old - r.log_prob.detach(), keep)
    a = _seq_mean(r.advantages, keep)
    opsm_keep = (a >= 0) | (d <= delta)
    dropped = keep.any(-1) & ~opsm_keep
    assert 0 < int(dropped.sum()) < int(keep.any(-1).sum())
    kept = keep & opsm_keep.unsqueeze(-1)
    # OPSM acts in the loss, after verl counted the accepted tokens: dropped tokens stay in that count
    expected = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * kept).sum() / keep.sum()
    _check_loss_and_grad(results, expected, r)
    (grad,) = torch.autograd.grad(_total(results), r.log_prob)
    assert torch.all(grad[dropped] == 0)
    without = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * keep).sum() / keep.sum()
    assert not torch.isclose(expected, without)  # the key changes the loss (it used to be ignored here)
    assert all("rollout_corr/opsm_seq_masked_fraction" in m for _, m in results)  # logged by verl as actor/...


def test_opsm_bypass_compares_the_rollout_policy_with_pi_theta_in_verls_worker():
    delta = 0.02
    config = _compose(_bypass_lines() + SIZES + [f"+algorithm.rollout_correction.rollout_opsm_delta={delta}"])
    actor = _worker_actor_config(config)
    r = Rollout(seed=22, grad=True, noise=0.02)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # verl's bypass set-up (V1 and legacy)
    results, data = _worker_update(batch, config, actor, r)
    block = config.algorithm.rollout_correction
    rs_keep = _k3_seq_mean(r.log_prob.detach() - r.rollout, r.mask) <= float(block.rollout_rs_threshold)
    keep = r.mask.bool() & rs_keep.unsqueeze(-1)
    d = _seq_mean(r.rollout - r.log_prob.detach(), keep)  # D(y) = mean_t log(π_rollout/π_θ)
    a = _seq_mean(r.advantages, keep)
    opsm_keep = (a >= 0) | (d <= delta)
    dropped = keep.any(-1) & ~opsm_keep
    assert 0 < int(dropped.sum()) < int(keep.any(-1).sum())
    kept = keep & opsm_keep.unsqueeze(-1)
    assert data["batch_num_tokens"] == int(r.mask.sum())
    expected = (_ppo_clip(r.log_prob, r.rollout, r.advantages) * kept).sum() / r.mask.sum()
    _check_loss_and_grad(results, expected, r)
    without = (_ppo_clip(r.log_prob, r.rollout, r.advantages) * keep).sum() / r.mask.sum()
    assert not torch.isclose(expected, without)


# ----------------------------------------------------------------------------- GSPO


def _gspo_by_hand(log_prob, prox, adv, mask, low=0.2, high=0.2):
    """GSPO (Zheng et al. 2025): s = exp(mean_t log π_θ/π_prox) per sequence, s_t = sg(s)·π_θ/sg(π_θ)."""
    lp = log_prob.double()
    s = _seq_mean(lp.detach() - prox.double(), mask).unsqueeze(-1)
    s_t = torch.exp(s + lp - lp.detach())
    adv = adv.double()
    return torch.maximum(-adv * s_t, -adv * s_t.clamp(1 - low, 1 + high))


def test_gspo_decoupled_block_equals_verls_own_gspo_on_the_same_weights_and_the_hand_formula():
    lines = _decoupled_lines() + SIZES
    ours = _compose(lines + ["algorithm.rollout_correction.loss_type=gspo", ACTOR_LINE])
    r = Rollout(seed=23, grad=True)
    batch, keep, weights = _decoupled_step(ours, r)
    mine, data = _worker_update(_copy(batch), ours, _worker_actor_config(ours), r)
    expected = (_gspo_by_hand(r.log_prob, r.old, r.advantages, keep) * weights * keep).sum() / keep.sum()
    _check_loss_and_grad(mine, expected, r)
    ppo = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * keep).sum() / keep.sum()
    assert not torch.isclose(expected, ppo)

    # verl's own GSPO (loss_mode=gspo) on the same worker data, with this library's IS weights
    theirs = _compose([x for x in lines if "loss_mode" not in x]
                      + ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    actor = _worker_actor_config(theirs)
    verls, _ = _worker_update(batch, theirs, actor, r)
    for (a, m_a), (b, m_b) in zip(mine, verls):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    (g_ours,) = torch.autograd.grad(_total(mine), r.log_prob)
    (g_verl,) = torch.autograd.grad(_total(verls), r.log_prob)
    torch.testing.assert_close(g_ours, g_verl, rtol=1e-5, atol=1e-7)


def _copy(batch):
    from test_integration_verl_worker import _copy as copy

    return copy(batch)


# ----------------------------------------------------------------------------- TOPR


@pytest.mark.parametrize("with_rs", [False, True])
def test_bypass_topr_block_in_verls_worker(with_rs):
    extra = ["algorithm.rollout_correction.loss_type=topr"]
    if not with_rs:  # the bypass_topr preset's keys exactly: bypass_mode + loss_type, nothing else
        extra += ["algorithm.rollout_correction.rollout_rs=null", "algorithm.rollout_correction.rollout_rs_threshold=null"]
    config = _compose(_bypass_lines() + SIZES + extra)
    actor = _worker_actor_config(config)
    assert actor.policy_loss.rollout_correction["loss_type"] == "topr"
    r = Rollout(seed=77 if with_rs else 24, grad=True, noise=0.02 if with_rs else 0.3)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    results, data = _worker_update(batch, config, actor, r)
    keep = r.mask.bool()
    if with_rs:
        block = config.algorithm.rollout_correction
        accepted = _k3_seq_mean(r.log_prob.detach() - r.rollout, r.mask) <= float(block.rollout_rs_threshold)
        keep = keep & accepted.unsqueeze(-1)
        assert 0 < int(accepted.sum()) < len(accepted)
    # Hand (TOPR, Le Roux et al. 2025): w = 1 for A(y) ≥ 0, min(∏_t π_θ/π_rollout, 1) for A(y) < 0;
    # ℓ = −sg(w)·A·log π_θ; the denominator is verl's count, fixed before the loss ran.
    log_ratio_sum = ((r.log_prob.detach().double() - r.rollout.double()) * keep).sum(-1)
    a = _seq_mean(r.advantages, keep)
    w = torch.where(a >= 0, torch.ones_like(a), log_ratio_sum.exp().clamp(max=1.0)).unsqueeze(-1)
    assert bool(((w < 1).squeeze(-1) & keep.any(-1)).any()) and bool((w == 1).any())
    expected = (-w * r.advantages.double() * r.log_prob.double() * keep).sum() / r.mask.sum()
    _check_loss_and_grad(results, expected, r)


# ----------------------------------------------------------------------------- keys that cannot act


def _launch(lines):
    """The entry point on ``lines``: Hydra-composed, then its checks (``task_runner_class``)."""
    config = main_ppo.compose(lines)
    main_ppo.task_runner_class(config)
    return config


@pytest.mark.parametrize("key", ["+algorithm.rollout_correction.rollout_opsm_delta=0.05",
                                 "algorithm.rollout_correction.loss_type=gspo"])
def test_a_loss_key_the_loss_cannot_see_is_refused_by_the_entry_point_and_the_step(key):
    name = key.split("=")[0].lstrip("+").split(".")[-1]
    r = Rollout(seed=25)
    # loss_mode=rollout_correction, but the actor has no block: the loss would never see the key
    lines = _decoupled_lines() + SIZES + [key]
    with pytest.raises(ValueError, match=f"{name}.*policy_loss.rollout_correction"):
        _launch(lines)  # on the driver, before any worker starts
    with pytest.raises(ValueError, match=f"{name}.*policy_loss.rollout_correction"):
        _correction_step(r.proto(), _compose_verl(lines))  # the trainer subclass's step checks it too
    # verl's own loss (here its gspo) would ignore the key too
    other = [x for x in _decoupled_lines() if "loss_mode" not in x] + SIZES + [
        key, ACTOR_LINE, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]
    with pytest.raises(ValueError, match=f"{name}.*loss_mode='gspo'"):
        _launch(other)
    # with the documented line the step runs
    _, metrics = _correction_step(r.proto(), _compose(_decoupled_lines() + SIZES + [key, ACTOR_LINE]))
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0


def test_verls_own_gspo_loss_mode_with_this_librarys_correction_step_runs_verls_gspo():
    """No loss key in the block: verl's loss_mode decides (verl's GSPO on this library's weights)."""
    config = _compose([x for x in _decoupled_lines() if "loss_mode" not in x] + SIZES
                      + ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    r = Rollout(seed=26)
    _, metrics = _correction_step(r.proto(), config)
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0


def test_wire_trainer_config_refuses_to_replace_verls_gspo_loss_mode(monkeypatch):
    config = _compose_verl(SIZES + ["algorithm.rollout_correction.rollout_is=token",
                                    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    with pytest.raises(ValueError, match="loss_mode='gspo'.*loss_type: gspo"):
        rc_verl.wire_trainer_config(config)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"  # untouched
    # the same GSPO as a loss_type of the block: wired, and the actor's block carries it
    config = _compose_verl(SIZES + ["algorithm.rollout_correction.rollout_is=token",
                                    "algorithm.rollout_correction.loss_type=gspo",
                               "+algorithm.rollout_correction.rollout_opsm_delta=0.05"])
    rc_verl.wire_trainer_config(config)
    actor = _worker_actor_config(config)
    assert actor.policy_loss.loss_mode == rc_verl.LOSS_NAME
    assert actor.policy_loss.rollout_correction["loss_type"] == "gspo"
    assert actor.policy_loss.rollout_correction["rollout_opsm_delta"] == 0.05


def test_decoupled_actor_block_asking_for_is_weights_verl_did_not_deliver_is_refused():
    config = _compose(_decoupled_lines() + SIZES + [ACTOR_LINE])
    r = Rollout(seed=27)
    with pytest.raises(ValueError, match="rollout_is='token'.*correction step"):
        _worker_update(r.proto(), config, _worker_actor_config(config), r)  # no correction step ran


def test_the_decoupled_block_without_loss_keys_still_equals_plain_ppo_on_the_drivers_weights():
    config = _compose(_decoupled_lines() + SIZES + [ACTOR_LINE])
    r = Rollout(seed=28, grad=True)
    batch, keep, weights = _decoupled_step(config, r)
    results, _ = _worker_update(batch, config, _worker_actor_config(config), r)
    expected = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * keep).sum() / keep.sum()
    _check_loss_and_grad(results, expected, r)
    assert math.isfinite(float(expected.detach()))


@pytest.mark.parametrize("key", ["+algorithm.rollout_correction.rollout_m2po_threshold=0.04",
                                 "+algorithm.rollout_correction.rollout_token_veto_threshold=0.0001"])
def test_verls_own_correction_step_refuses_a_key_only_this_librarys_step_reads(key):
    """With backend=verl the entry point keeps verl's own step, which reads five keys and would
    ignore this one: refused on the driver, naming it; by default this library's step runs it."""
    name = key.split("=")[0].split(".")[-1]
    lines = _decoupled_lines() + SIZES + [key]
    with pytest.raises(ValueError, match=f"{name}.*verl's own correction step ignores it"):
        _launch(lines + ["algorithm.rollout_correction.backend=verl"])
    _, metrics = _correction_step(Rollout(seed=29).proto(), _compose(lines))
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0


@pytest.mark.parametrize("loss", ["cispo", "dppo_tv", "dppo_kl"])
def test_cispo_and_dppo_blocks_equal_verls_own_loss_mode_on_the_same_worker_data_and_weights(loss):
    lines = _decoupled_lines() + SIZES
    ours = _compose(lines + [f"algorithm.rollout_correction.loss_type={loss}", ACTOR_LINE])
    r = Rollout(seed=30, grad=True)
    batch, keep, weights = _decoupled_step(ours, r)
    mine, _ = _worker_update(_copy(batch), ours, _worker_actor_config(ours), r)
    theirs = _compose([x for x in lines if "loss_mode" not in x] + [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}"])
    verls, _ = _worker_update(batch, theirs, _worker_actor_config(theirs), r)
    for (a, _), (b, _) in zip(mine, verls):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    (g_ours,) = torch.autograd.grad(_total(mine), r.log_prob)
    (g_verl,) = torch.autograd.grad(_total(verls), r.log_prob)
    torch.testing.assert_close(g_ours, g_verl, rtol=1e-5, atol=1e-7)
    assert torch.all(g_ours[~keep] == 0) and torch.any(g_ours[keep] != 0)
    ppo = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * keep).sum() / keep.sum()
    assert not torch.isclose(_total(mine).double(), ppo)


# ----------------------------------------------------------------------------- metric families


def test_the_metric_families_pass_through_verls_config():
    """``+algorithm.rollout_correction.metrics=[...]``, composed by Hydra into verl's ppo_trainer.yaml:
    the entry point's correction step (decoupled) logs those families, and in bypass mode the actor's
    block carries them to the loss on verl's worker, whose metrics verl logs as actor/..."""
    r = Rollout(seed=31)
    config = _compose(_decoupled_lines() + SIZES + ["+algorithm.rollout_correction.metrics=[default,raw]"])
    assert rc_verl.config_from_verl(config.algorithm.rollout_correction).metrics == ("default", "raw")
    _, metrics = _correction_step(r.proto(), config)
    assert "rollout_corr/rollout_is_raw_mean" in metrics and "rollout_corr/rollout_is_mean" in metrics
    assert "rollout_corr/chi2_token_sn" not in metrics
    config = _compose(_bypass_lines() + SIZES + ["+algorithm.rollout_correction.metrics=[chi2]"])
    r = Rollout(seed=32, grad=True)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # verl's bypass set-up (V1 and legacy)
    results, _ = _worker_update(batch, config, _worker_actor_config(config), r)
    for _, m in results:
        assert {k for k in m if k.startswith("rollout_corr/") and not k.startswith("rollout_corr/backend")} == {
            "rollout_corr/chi2_token_sn", "rollout_corr/chi2_seq_sn", "rollout_corr/nonfinite_seq_fraction"}
