"""``rollout_correction.compat.skyrl`` side by side with SkyRL 0.4.0's own code (``tests/skyrl_reference.py``).

* The five correction functions on random batches and configs: equal masks, TIS ratios within float
  tolerance on the tokens they weight, SkyRL's metric values.
* SkyRL's own losses (``ppo_utils``: regular, dual clip, GSPO, SAPO, rollout_is) calling the drop-in
  through their ``apply_off_policy_correction`` give the losses they give with SkyRL's module.
* The policy loss: SkyRL's ``PolicyLossRegistry`` resolves the name a user writes in
  ``trainer.algorithm.policy_loss_type`` after the docs' registration line; called as SkyRL's worker
  calls a loss, it equals SkyRL's own ``dual_clip`` loss with SkyRL's correction where the two
  judge alike (rejected tokens stay in SkyRL's denominator), and an independent computation.
* SkyRL's call site: its ``PolicyWorkerBase``, built from the docs' config lines, resolves the loss and
  calls it in ``forward_backward`` (``tests/skyrl_worker_call.py``, a child process); the training
  step's loss, gradients and ``rollout_corr/…`` metrics equal an independent computation.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rollout_correction.compat.skyrl as ours
from rollout_correction import ConfigError, RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.compat.skyrl import from_skyrl
from rollout_correction.vocabulary import Band
import skyrl_reference as ref

THEIRS = ref.correction_module()


def _batch(rng: random.Random, gen: torch.Generator):
    B, T = rng.randint(1, 6), rng.randint(1, 10)
    scale = rng.choice([0.005, 0.05, 0.3, 1.5])
    rollout = -torch.rand(B, T, generator=gen) * 3
    old = (rollout + torch.randn(B, T, generator=gen) * scale).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(B, T, generator=gen) > rng.choice([0.0, 0.3])).float()
    if B > 1 and rng.random() < 0.3:
        mask[rng.randrange(B)] = 0.0  # a row without valid tokens
    return old, rollout, mask


def _config(rng: random.Random):
    cfg = ref.algorithm_config(["trainer.algorithm.policy_loss_type=regular"]).off_policy_correction
    cfg.tis_ratio_type = rng.choice([None, "token", "sequence"])
    cfg.token_tis_ratio_clip_high = rng.choice([1.2, 2.0])
    cfg.sequence_tis_ratio_clip_high = rng.choice([1.5, 5.0])
    cfg.sequence_mask_metric = rng.choice([None, "geometric", "product"])
    cfg.geo_mask_low, cfg.geo_mask_high = rng.choice([(0.99, 1.01), (0.9, 1.1), (0.0, 1.05)])
    cfg.product_mask_low, cfg.product_mask_high = rng.choice([(0.5, 2.0), (0.8, 1.3)])
    cfg.outlier_token_is_threshold_low = rng.choice([None, 0.3])
    cfg.outlier_token_is_threshold_high = rng.choice([None, 3.0])
    if rng.random() < 0.5:
        cfg.token_mask_is_threshold_low, cfg.token_mask_is_threshold_high = rng.choice([(0.5, 2.0), (0.8, 1.25)])
    return cfg


def _same_metrics(mine: dict, theirs: dict) -> None:
    assert set(theirs) <= set(mine), set(theirs) - set(mine)
    assert all(k.startswith("rollout_corr/") for k in set(mine) - set(theirs)), set(mine) - set(theirs)
    for k, v in theirs.items():
        assert mine[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, mine[k], v)


@pytest.mark.parametrize("seed", range(40))
def test_the_five_functions_equal_skyrls_on_random_batches(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    old, rollout, mask = _batch(rng, gen)
    cfg = _config(rng)
    for level in ("token", "sequence"):
        (w, m), (w_ref, m_ref) = (f.compute_tis_ratio(old, rollout, mask, level, cfg) for f in (ours, THEIRS))
        assert w.shape == w_ref.shape and w.dtype == w_ref.dtype
        where = mask > 0 if level == "token" else mask.sum(-1, keepdim=True) > 0
        torch.testing.assert_close(w[where], w_ref[where], rtol=1e-6, atol=0)
        _same_metrics(m, m_ref)
    for metric in ("geometric", "product"):
        (s, m), (s_ref, m_ref) = (f.compute_sequence_mask(old, rollout, mask, metric, cfg) for f in (ours, THEIRS))
        assert torch.equal(s, s_ref)
        _same_metrics(m, m_ref)
    if cfg.outlier_token_is_threshold_low is not None or cfg.outlier_token_is_threshold_high is not None:
        (o, m), (o_ref, m_ref) = (f.compute_outlier_token_mask(old, rollout, mask, cfg) for f in (ours, THEIRS))
        assert torch.equal(o, o_ref)
        _same_metrics(m, m_ref)
    if cfg.token_mask_is_threshold_low is not None:
        (t, m), (t_ref, m_ref) = (f.compute_token_mask(old, rollout, mask, cfg) for f in (ours, THEIRS))
        assert torch.equal(t, t_ref)
        _same_metrics(m, m_ref)
    (w, m, lm), (w_ref, m_ref, lm_ref) = (f.compute_off_policy_correction(old, rollout, mask, cfg) for f in (ours, THEIRS))
    assert torch.equal(lm, lm_ref)
    assert (w is None) == (w_ref is None)
    if w is not None:
        where = lm > 0 if cfg.tis_ratio_type == "token" else lm.sum(-1, keepdim=True) > 0
        torch.testing.assert_close(w[where], w_ref[where], rtol=1e-6, atol=0)
    _same_metrics(m, m_ref)


def test_no_correction_returns_skyrls_early_result():
    x = torch.zeros(2, 3)
    cfg = ref.algorithm_config(["trainer.algorithm.policy_loss_type=regular"]).off_policy_correction
    assert ours.compute_off_policy_correction(x, x, torch.ones(2, 3), cfg)[:2] == (None, {})
    assert ours.off_policy_correction_enabled(cfg) is THEIRS.off_policy_correction_enabled(cfg) is False
    with pytest.raises(ValueError, match="Unknown tis_ratio_type"):
        ours.compute_tis_ratio(x, x, x, "segment", cfg)
    with pytest.raises(ValueError, match="Unknown sequence_mask_metric"):
        ours.compute_sequence_mask(x, x, x, "mean", cfg)


def _loss_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    rollout = -torch.rand(B, T, generator=gen) * 2
    old = (rollout + torch.randn(B, T, generator=gen) * 0.4).clamp(max=0.0)  # log-probs are ≤ 0
    log_probs = (old + torch.randn(B, T, generator=gen) * 0.2).clamp(max=0.0).requires_grad_()
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    advantages = torch.randn(B, 1, generator=gen).expand(B, T).clone()
    return log_probs, old, rollout, mask, advantages


def _docs_block(language: str) -> str:
    """The first ``language`` code block of docs/integrations.md's SkyRL section."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    section = text.split("## SkyRL (0.4.0)", 1)[1].split("\n## ", 1)[0]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


LOSS_LINES = _docs_block("text").split()  # the page's config lines


@pytest.mark.parametrize("loss_type", ["regular", "dual_clip", "gspo", "sapo", "rollout_is"])
def test_skyrls_own_losses_call_the_drop_in_and_give_their_losses(loss_type):
    theirs, mine = ref.ppo_utils(THEIRS, name="skyrl_reference_ppo_utils_theirs"), \
        ref.ppo_utils(ours, name="skyrl_reference_ppo_utils_ours")
    assert mine.apply_off_policy_correction is ours.apply_off_policy_correction
    cfg = ref.algorithm_config([f"trainer.algorithm.policy_loss_type={loss_type}", *LOSS_LINES[1:],
                                "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
                                "trainer.algorithm.off_policy_correction.geo_mask_low=0.8",
                                "trainer.algorithm.off_policy_correction.geo_mask_high=1.25"])
    for seed in range(5):
        lp, old, rollout, mask, adv = _loss_inputs(seed)
        results = []
        for module in (theirs, mine):
            loss, metrics = module.PolicyLossRegistry.get(loss_type)(lp, old, adv, config=cfg, loss_mask=mask,
                                                                     rollout_logprobs=rollout)
            grad, = torch.autograd.grad(loss, lp)
            results.append((loss, grad, metrics))
        (loss_t, grad_t, m_t), (loss_o, grad_o, m_o) = results
        torch.testing.assert_close(loss_o, loss_t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_o, grad_t, rtol=1e-5, atol=1e-6)
        _same_metrics(m_o, m_t)


@pytest.fixture(scope="module")
def registry():
    module = ref.ppo_utils(THEIRS)  # SkyRL's ppo_utils under its own name, with SkyRL's correction
    exec(_docs_block("python"), {})  # the page's lines in the entry script
    return module


def _independent(lp, old, rollout, mask, adv_normalized, eps=0.2, c=3.0, cap=2.0, low=0.5, high=2.5):
    """Σ over accepted tokens of min(ρ, cap) · dual-clip PPO, written out with plain torch."""
    rho = torch.exp(old - rollout)
    valid = mask > 0
    row_ok = ~(((rho < low) | (rho > high)) & valid).any(-1, keepdim=True)
    r = torch.exp(lp - old)
    a = adv_normalized
    clip1 = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps))
    per_token = torch.where(a < 0, torch.minimum(clip1, -a * c), clip1)
    return (per_token * rho.clamp(max=cap) * (valid & row_ok)).sum()


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_the_registered_loss_resolves_and_equals_skyrls_dual_clip(registry, reduction):
    cfg = ref.algorithm_config([*LOSS_LINES, f"trainer.algorithm.loss_reduction={reduction}"])
    loss_fn = registry.PolicyLossRegistry.get(cfg.policy_loss_type)
    assert loss_fn is ours.policy_loss and cfg.policy_loss_type == ours.POLICY_LOSS_NAME
    skyrl_cfg = ref.algorithm_config([*LOSS_LINES[1:], "trainer.algorithm.policy_loss_type=dual_clip",
                                      f"trainer.algorithm.loss_reduction={reduction}"])
    for seed in range(6):
        lp, old, rollout, mask, adv = _loss_inputs(seed)
        # SkyRL scales the advantages by the counts of the original mask before the loss
        adv = registry.apply_loss_reduction_to_advantages_minibatch(adv, mask, reduction, 4, 7)
        loss, metrics = loss_fn(lp, old, adv, config=cfg, loss_mask=mask, rollout_logprobs=rollout)  # the worker's call
        skyrl_loss, _ = registry.PolicyLossRegistry.get("dual_clip")(lp, old, adv, config=skyrl_cfg, loss_mask=mask,
                                                                     rollout_logprobs=rollout)
        expected = _independent(lp, old, rollout, mask, adv)
        for other in (skyrl_loss, expected):
            torch.testing.assert_close(loss, other, rtol=1e-5, atol=1e-7)
            g, g_other = torch.autograd.grad(loss, lp, retain_graph=True)[0], torch.autograd.grad(other, lp)[0]
            torch.testing.assert_close(g, g_other, rtol=1e-5, atol=1e-7)
        assert isinstance(metrics["clip_ratio"], float) and "rollout_corr/rollout_is_mean" in metrics


def test_the_registered_loss_keeps_rejected_tokens_in_skyrls_denominator(registry):
    cfg = ref.algorithm_config(LOSS_LINES)
    lp, old, rollout, mask, _ = _loss_inputs(0)
    old = rollout.clone()
    old[0, 0] = rollout[0, 0] + 3.0  # row 0 vetoed: ρ = e³ > 2.5
    mask[0, 0] = 1.0
    adv = registry.apply_loss_reduction_to_advantages_minibatch(torch.ones_like(mask), mask, "token_mean", 4, 7)
    loss, _ = ours.policy_loss(lp.detach().copy_(old), old, adv, cfg, mask, rollout)  # r = 1, ρ = 1 off row 0
    kept = mask[1:].sum()
    assert float(loss) == pytest.approx(-float(kept / mask.sum()), rel=1e-6)  # Σ_kept −1/N, N over all rows
    assert math.isclose(registry.PolicyLossRegistry.get("rollout_correction")(
        lp.detach().copy_(old), old, adv, config=cfg, loss_mask=mask, rollout_logprobs=rollout)[0].item(),
        float(loss), rel_tol=1e-7)


def test_registering_twice_is_a_no_op_and_another_function_is_refused(registry):
    assert ours.register_policy_loss() == "rollout_correction"
    with pytest.raises(ValueError, match="already registered"):
        registry.PolicyLossRegistry.register("rollout_correction", lambda *a, **k: None)


def test_skyrls_policy_worker_calls_the_registered_loss_in_its_training_step(tmp_path):
    """SkyRL's ``PolicyWorkerBase`` (constructed from the docs' config lines, after the docs' registration
    lines) runs ``forward_backward`` on a batch of four sequences in a child process
    (``tests/skyrl_worker_call.py``, which names its stand-ins); the loss, KL term, gradients and metrics
    it returns equal an independent computation from the model's saved parameters."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(ours.__file__).resolve().parents[2]), str(here), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "step.pt"
    child = subprocess.run([sys.executable, str(here / "skyrl_worker_call.py"), str(out),
                            _docs_block("python"), " ".join(LOSS_LINES)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    step = torch.load(out)
    algo, metrics, batch, params = step["algorithm"], step["metrics"], step["batch"], step["params"]
    assert step["resolved_to_ours"] and algo["policy_loss_type"] == ours.POLICY_LOSS_NAME
    defaults = (algo["loss_reduction"], algo["use_kl_loss"], algo["kl_estimator_type"],
                algo["use_entropy_loss"], step["micro_train_batch_size_per_gpu"])
    assert defaults == ("token_mean", True, "k3", False, 1)  # SkyRL's, untouched by the docs' lines

    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    seq, old, rollout, mask = batch["sequences"], batch["old"], batch["rollout"], batch["loss_mask"]
    T = mask.shape[1]
    logits = params["embed.weight"][seq] @ params["head.weight"].T + params["head.bias"]
    lp = logits.log_softmax(-1)[:, :-1].gather(-1, seq[:, 1:, None]).squeeze(-1)[:, -T:] / algo["temperature"]
    policy = _independent(lp, old, rollout, mask, batch["raw_advantages"] / mask.sum(),
                          eps=algo["eps_clip_low"], c=algo["clip_ratio_c"])
    log_ratio = (batch["base"] - lp).clamp(-20, 20)
    kl = ((log_ratio.exp() - log_ratio - 1) * mask).sum(-1) / mask.sum(-1)  # k3, mean over each row
    total = policy + algo["kl_loss_coef"] * kl.mean()  # one row per micro-batch, each weighted 1/4
    total.backward()
    policy, total, kl = policy.detach(), total.detach(), kl.detach()

    assert metrics["policy_loss"] == pytest.approx(float(policy), rel=1e-5, abs=1e-7)
    assert metrics["final_loss"] == pytest.approx(float(total), rel=1e-5, abs=1e-7)
    assert metrics["policy_kl"] == pytest.approx(float(kl.mean()), rel=1e-5, abs=1e-7)
    for name, grad in step["grads"].items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-5, atol=1e-7)
    rho = torch.exp(old - rollout)
    vetoed = (((rho < 0.5) | (rho > 2.5)) & (mask > 0)).any(-1)
    assert vetoed.tolist() == [True, False, False, False]
    # our metrics, reduced by SkyRL over its four one-row micro-batches (mean; min for ``_min``)
    assert metrics["loss_metrics/rollout_corr/rollout_is_veto_high_fraction"] == pytest.approx(0.25)
    is_min = metrics["loss_metrics/rollout_corr/rollout_is_min"]
    assert is_min == pytest.approx(float(rho[mask > 0].min()), rel=1e-6)


def test_skyrl_off_policy_correction_block_is_read_with_its_defaults():
    """SkyRL's trainer.algorithm.off_policy_correction block (OffPolicyCorrectionConfig's keys and
    defaults) translated by from_skyrl, and the masks it gives on a hand-made batch."""
    skyrl = {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
             "sequence_mask_metric": "geometric", "geo_mask_high": 1.01, "geo_mask_low": 0.99,
             "product_mask_high": 2.0, "product_mask_low": 0.5, "outlier_token_is_threshold_low": 1e-4,
             "outlier_token_is_threshold_high": 100.0, "token_mask_is_threshold_low": None,
             "token_mask_is_threshold_high": None}
    cfg = RolloutCorrectionConfig.from_dict(from_skyrl(skyrl))
    assert (cfg.rollout_is, cfg.rollout_is_threshold, cfg.is_spec.mode) == ("token", 2.0, "truncate")
    assert cfg.rollout_rs == "seq_mean_k1" and cfg.rollout_rs_threshold == Band(0.99, 1.01)
    assert (cfg.rollout_token_veto_threshold, cfg.rollout_token_veto_threshold_high) == (1e-4, 100.0)
    # Only the keys that differ from SkyRL's defaults: product mask, per-token mask, the high veto.
    cfg = RolloutCorrectionConfig.from_dict(from_skyrl({"sequence_mask_metric": "product",
                                                        "token_mask_is_threshold_low": 0.5,
                                                        "token_mask_is_threshold_high": 2,
                                                        "outlier_token_is_threshold_high": 4.0}))
    assert cfg.rollout_is is None and cfg.rollout_rs == "token_k1,seq_sum_k1"
    assert cfg.rollout_rs_threshold == (Band(0.5, 2.0), Band(0.5, 2.0))
    # Row 0: one token at ρ = 5 > 4 (vetoed); row 1: ρ = 3 > 2 masks that token, and ∏ρ = 3·0.8 > 2
    # drops the row; row 2: ρ = 1.5 and 1 kept (∏ρ = 1.5).
    lr = torch.log(torch.tensor([[5.0, 1.0], [3.0, 0.8], [1.5, 1.0]]))
    out = compute_rollout_correction(lr - 3.0, torch.full((3, 2), -3.0), torch.ones(3, 2), config=cfg)
    assert out.response_mask.tolist() == [[0, 0], [0, 0], [1, 1]]
    with pytest.raises(ConfigError, match="sequence_mask_metric='harmonic'"):
        from_skyrl({"sequence_mask_metric": "harmonic"})
