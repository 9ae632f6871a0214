"""verl adapter, tested beside verl 0.9.1's own code on the same tensors.

verl is loaded by ``tests/verl_reference.py``: the installed verl 0.9.1 files, unmodified, with a
stand-in only for ``ray`` (imported by ``verl.protocol`` for remote futures the numerics never
touch). Install: see ``verl_reference.INSTALL_HINT``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl_reference import _import, load_verl_core_algos, load_verl_rollout_corr_helper

from rollout_correction import RolloutCorrectionConfig
from rollout_correction.integrations import verl as rc_verl
from rollout_correction import Aggregation, ClipRange, PolicyLoss

torch.set_num_threads(1)

CORE = load_verl_core_algos()  # raises with the pip line when verl 0.9.1 is missing
HELPER = load_verl_rollout_corr_helper()
PROTOCOL = _import("verl.protocol")
rc_verl.register(CORE)


def _tensors(B=6, T=8, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 1.5 - 0.05
    old = (rollout + scale * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    log_prob = (old + 0.2 * torch.randn(B, T, generator=g)).clamp(max=0.0).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.ones(B, T)
    for i in range(B):
        mask[i, T - (i % 4) * 2:] = 0
    return log_prob, old, rollout, adv, mask


def _actor_config(global_batch_info=None, rollout_correction=None, **kw):
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
           "global_batch_info": global_batch_info or {}, "policy_loss": {"loss_mode": rc_verl.LOSS_NAME}}
    if rollout_correction is not None:
        cfg["policy_loss"]["rollout_correction"] = rollout_correction
    cfg.update(kw)
    return OmegaConf.create(cfg)


def _loss_and_grad(fn, log_prob, *args, **kwargs):
    lp = log_prob.detach().clone().requires_grad_(True)
    loss, metrics = fn(kwargs.pop("old"), lp, *args, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_registered_in_verls_registries():
    assert CORE.get_policy_loss_fn(rc_verl.LOSS_NAME) is rc_verl.policy_loss
    assert CORE.get_adv_estimator_fn(rc_verl.ADV_ESTIMATOR_NAME) is rc_verl.grpo_accepted_advantage
    rc_verl.register(CORE)  # idempotent
    assert CORE.get_policy_loss_fn(rc_verl.LOSS_NAME) is rc_verl.policy_loss


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("info", [{}, {"dp_size": 2, "batch_num_tokens": 61, "global_batch_size": 11,
                                       "loss_scale_factor": 16}])
def test_decoupled_loss_equals_verls_vanilla_with_weights(agg, info):
    log_prob, old, rollout, adv, mask = _tensors()
    weights = torch.exp(old - rollout).clamp(max=1.5) * mask
    cfg = _actor_config(info)
    theirs = _loss_and_grad(CORE.get_policy_loss_fn("vanilla"), log_prob, adv, mask, agg, cfg, weights, old=old)
    ours = _loss_and_grad(CORE.get_policy_loss_fn(rc_verl.LOSS_NAME), log_prob, adv, mask, agg, cfg, weights,
                          old=old)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-8)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[2][key] == pytest.approx(theirs[2][key], rel=1e-5, abs=1e-7), key
    # And verl's agg_loss over the weighted dual-clip PPO terms written out by hand.
    r = torch.exp(log_prob.detach() - old)
    clipped = torch.maximum(-adv * r, -adv * r.clamp(1 - 0.2, 1 + 0.28))
    per_token = torch.where(adv < 0, torch.minimum(clipped, -adv * 3.0), clipped) * weights
    torch.testing.assert_close(ours[0], CORE.agg_loss(per_token, mask, loss_agg_mode=agg, **info), rtol=1e-5, atol=1e-7)


def test_bypass_loss_refuses_the_segment_level():
    """verl's loss call carries no segment ids: a bypass block at segment level is refused by name."""
    log_prob, _, rollout, adv, mask = _tensors()
    cfg = _actor_config({}, rollout_correction={"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "segment",
                                                "rollout_is_threshold": 2.0})
    with pytest.raises(ValueError, match=r"rollout_is='segment'.*verl's policy-loss call"):
        _loss_and_grad(CORE.get_policy_loss_fn(rc_verl.LOSS_NAME), log_prob, adv, mask, "token-mean", cfg, old=rollout)


@pytest.mark.parametrize("rc", [
    {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02},
    {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
    {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
])
def test_bypass_loss_equals_verls_bypass_mode(rc):
    log_prob, _, rollout, adv, mask = _tensors(scale=0.0)
    cfg = _actor_config({}, rollout_correction=rc)
    # verl's trainer passes the rollout log-probs as old_log_prob in bypass mode.
    theirs = _loss_and_grad(CORE.get_policy_loss_fn("bypass_mode"), log_prob, adv, mask, "token-mean", cfg,
                            old=rollout)
    ours = _loss_and_grad(CORE.get_policy_loss_fn(rc_verl.LOSS_NAME), log_prob, adv, mask, "token-mean", cfg,
                          old=rollout)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-8)
    rs_key = "rollout_corr/rollout_rs_masked_fraction"
    if rs_key in theirs[2]:
        assert ours[2][rs_key] == pytest.approx(theirs[2][rs_key])
        assert 0 < ours[2][rs_key] < 1  # the rejection really acted


def _proto(old, rollout, mask):
    return PROTOCOL.DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                                 "response_mask": mask.clone()})


@pytest.mark.parametrize("block", [
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
     "rollout_rs_threshold": "0.5_2.0", "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25", "rollout_rs": None},
])
def test_add_to_batch_matches_verls_function_on_a_dataproto(block):
    _, old, rollout, _, mask = _tensors()
    verl_block = OmegaConf.create({**block, "bypass_mode": False, "loss_type": "ppo_clip"})
    theirs, m_theirs = HELPER.compute_rollout_correction_and_add_to_batch(_proto(old, rollout, mask), verl_block)
    ours, m_ours = rc_verl.compute_rollout_correction_and_add_to_batch(_proto(old, rollout, mask), verl_block)
    assert isinstance(ours, PROTOCOL.DataProto)
    torch.testing.assert_close(ours.batch["response_mask"], theirs.batch["response_mask"])
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"],
                               rtol=1e-5, atol=1e-7)
    assert not torch.equal(ours.batch["response_mask"], mask) or block["rollout_rs"] is None
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/kl", "rollout_corr/k3_kl",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/training_ppl"):
        if key in m_theirs:
            assert m_ours[key] == pytest.approx(float(m_theirs[key]), rel=1e-4, abs=1e-6), key
    assert all(isinstance(v, float) for v in m_ours.values())


def test_add_to_batch_needs_the_log_probs():
    _, old, rollout, _, mask = _tensors()
    data = PROTOCOL.DataProto.from_dict(tensors={"old_log_probs": old, "response_mask": mask})
    with pytest.raises(KeyError, match="rollout_log_probs"):
        rc_verl.compute_rollout_correction_and_add_to_batch(data, {"rollout_is": "token"})
    with pytest.raises(ValueError, match="unknown RolloutCorrectionConfig key"):
        rc_verl.compute_rollout_correction_and_add_to_batch(_proto(old, rollout, mask), {"rollout_iss": "token"})


def _grpo_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 5
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 4, (B,), generator=g).float()
    mask = torch.ones(B, T)
    index = np.array([f"p{i // 4}" for i in range(B)], dtype=object)
    return rewards, mask, index


def test_grpo_accepted_equals_verls_grpo_without_rejection():
    rewards, mask, index = _grpo_inputs()
    theirs, _ = CORE.compute_grpo_outcome_advantage(rewards, mask, index)
    fn = CORE.get_adv_estimator_fn(rc_verl.ADV_ESTIMATOR_NAME)
    ours, returns = fn(token_level_rewards=rewards, response_mask=mask, index=index,
                       config=OmegaConf.create({"norm_adv_by_std_in_grpo": True}))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours, returns)


def test_grpo_accepted_excludes_rejected_rows_from_the_baseline():
    rewards, mask, index = _grpo_inputs(seed=1)
    rejected = [1, 6]  # rejection sampling zeroed these rows' masks
    mask[rejected] = 0
    ours, _ = rc_verl.grpo_accepted_advantage(rewards, mask, index)
    theirs_all, _ = CORE.compute_grpo_outcome_advantage(rewards, mask, index)
    kept = [i for i in range(12) if i not in rejected]
    # Expected: verl's GRPO run on the accepted rows alone.
    theirs_kept, _ = CORE.compute_grpo_outcome_advantage(rewards[kept], mask[kept], index[kept])
    torch.testing.assert_close(ours[kept], theirs_kept, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[rejected], torch.zeros_like(ours[rejected]))
    # ... which verl itself does not give: its baselines still contain the rejected rows.
    assert not torch.allclose(theirs_all[kept], theirs_kept)


def _verl_trainer_yaml():
    import verl

    return OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))


def _worker_policy_loss_config(config):
    """The PolicyLossConfig dataclass a verl worker builds from its copy of the actor section."""
    section = config.actor_rollout_ref.actor.policy_loss
    module, name = section._target_.rsplit(".", 1)
    cls = getattr(_import(module), name)
    return _import("verl.utils.config").omega_conf_to_dataclass(section, dataclass_type=cls)


def test_wire_trainer_config_puts_bypass_into_the_worker_config():
    name = "compute_rollout_correction_and_add_to_batch"
    verls_step = getattr(HELPER, name)
    config = _verl_trainer_yaml()
    config.algorithm.adv_estimator = "grpo"
    config.algorithm.rollout_correction = OmegaConf.create(
        {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01,
         "bypass_mode": True, "loss_type": "ppo_clip", "rollout_is_batch_normalize": False})
    config.actor_rollout_ref.rollout.calculate_log_probs = False
    rc_verl.wire_trainer_config(config)
    assert config.algorithm.adv_estimator == rc_verl.ADV_ESTIMATOR_NAME
    assert config.actor_rollout_ref.rollout.calculate_log_probs
    # it changes the config only: verl's step is untouched, and the block gets no key verl lacks
    assert getattr(HELPER, name) is verls_step
    assert "backend" not in config.algorithm.rollout_correction
    # What a worker builds from its copy of the actor config (verl's own conversion):
    policy_loss = _worker_policy_loss_config(config)
    assert policy_loss.loss_mode == rc_verl.LOSS_NAME
    seen = rc_verl.config_from_verl(policy_loss.rollout_correction)
    assert seen == RolloutCorrectionConfig.bypass_ppo_clip_k3_rs(0.01)
    # Without the wiring, the worker's config says decoupled: verl's trap (#4912, #4930).
    plain = _worker_policy_loss_config(_verl_trainer_yaml())
    assert not plain.rollout_correction.bypass_mode


def test_wire_rejects_bad_keys_on_the_driver():
    config = _verl_trainer_yaml()
    config.algorithm.rollout_correction.rollout_rss = "token_k1"
    with pytest.raises(ValueError, match="rollout_rss"):
        rc_verl.wire_trainer_config(config)


def test_verl_imports_the_adapter_in_a_fresh_process_and_registers_it():
    """What a Ray worker does with VERL_USE_EXTERNAL_MODULES: a fresh interpreter imports verl,
    verl imports this adapter, and the loss and estimator are in verl's registries."""
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import sys, importlib.util\n"
        f"sys.path.insert(0, {tests_dir!r})\n"
        "import verl_reference\n"
        "verl_reference.ray_or_stand_in()\n"
        "import verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "print(core_algos.get_policy_loss_fn('rollout_correction').__module__,"
        " core_algos.get_adv_estimator_fn('grpo_accepted').__module__)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "rollout_correction.integrations.verl"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["rollout_correction.integrations.verl"] * 2


def test_loss_denominator_in_verls_loss_call():
    """Bypass: the loss computes the rejection and honours loss_denominator (here the local
    per-sequence counts of seq-mean-token-mean); decoupled: "valid" is refused by name, since the
    mask arrives rejected."""
    from rollout_correction import RolloutCorrectionConfig, compute_policy_loss

    log_prob, old, rollout, adv, mask = _tensors(scale=0.3)
    rc = {"bypass_mode": True, "loss_type": "ppo_clip", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"}
    fn = CORE.get_policy_loss_fn(rc_verl.LOSS_NAME)
    out = {}
    for denominator in ("kept", "valid"):
        cfg = _actor_config({}, rollout_correction={**rc, "loss_denominator": denominator})
        out[denominator] = _loss_and_grad(fn, log_prob, adv, mask, "seq-mean-token-mean", cfg, old=rollout)[0]
        direct, _ = compute_policy_loss(
            log_prob.detach(), None, adv, mask, rollout_log_prob=rollout,
            config=RolloutCorrectionConfig(**rc, loss_denominator=denominator),
            loss=PolicyLoss(clip=ClipRange(high=0.28), aggregation=Aggregation("seq-mean-token-mean")))
        torch.testing.assert_close(out[denominator], direct, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(out["kept"], out["valid"])
    cfg = _actor_config({}, rollout_correction={"rollout_is": "token", "rollout_is_threshold": 2.0,
                                                "loss_denominator": "valid"})
    with pytest.raises(ValueError, match="loss_denominator='valid' is not available in verl's decoupled mode"):
        _loss_and_grad(fn, log_prob, adv, mask, "token-mean", cfg, torch.ones_like(mask), old=old)


def test_expect_zero_and_the_floor_pass_through_verls_block():
    """``algorithm.rollout_correction.expect_zero_atol`` (verl#7688's zero-mismatch runs) reaches the
    correction step: weights 1, the mask unchanged, a MismatchError when the engines disagree."""
    from rollout_correction import MismatchError

    _, old, rollout, _, mask = _tensors()
    block = OmegaConf.create({"rollout_is": None, "rollout_rs": None, "expect_zero_atol": 1e-6,
                              "log_prob_floor": -500.0})
    assert rc_verl.config_from_verl(block).log_prob_floor == -500.0
    ours, metrics = rc_verl.compute_rollout_correction_and_add_to_batch(_proto(old, old.clone(), mask), block)
    torch.testing.assert_close(ours.batch["response_mask"], mask)
    assert metrics["rollout_corr/max_abs_log_ratio"] == 0.0
    with pytest.raises(MismatchError, match="row 0, column"):
        rc_verl.compute_rollout_correction_and_add_to_batch(_proto(old, rollout, mask), block)
