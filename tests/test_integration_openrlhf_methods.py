"""OPSM and the policy losses GSPO / CISPO / DPPO-TV / DPPO-KL on OpenRLHF, through its own call site.

Every key of the config the OpenRLHF adapter accepts is honoured or refused at construction. The
recipe's actor (OpenRLHF's CLI parser, this library's subclass of the unedited ``ppo_actor.py``'s
``PolicyModelActor``, its replay buffer, ``ppo_train`` and loss call; stand-ins as in
tests/openrlhf_reference.py and tests/test_integration_openrlhf_actor.py) trains with a config of
this library (what the launcher's ``--rollout_correction.config`` gives it); each optimizer step's gradient
is compared with a loss written here from the formulas, over the accepted tokens, with OpenRLHF's
denominators (the accepted tokens, or accepted sequences for ``gspo``, of the optimizer step).
"""

from __future__ import annotations

import pytest
import torch

import openrlhf_reference as ref
import test_integration_openrlhf_actor as actor
from rollout_correction import RolloutCorrectionConfig, as_config
from rollout_correction.integrations.openrlhf import RolloutCorrectionPolicyLoss, config_from_openrlhf
from rollout_correction.integrations.openrlhf import train_ppo_ray as launcher

torch.set_num_threads(1)

A = actor.A
TIS = {"rollout_is": "token", "rollout_is_mode": "clip", "rollout_is_threshold": 2.0,
       "rollout_is_threshold_lower": 0.5}
TOKEN_RS = actor.TOKEN_RS  # token TIS [0.5, 2] + token_k1 rejection outside [0.5, 2]
DELTA = 0.05


@pytest.fixture(params=range(len(actor.ROOTS)), ids=actor.ROOT_IDS)
def root(request):
    return actor.ROOTS[request.param]


def _with(config):
    """The recipe's actor with ``config`` (``--rollout_correction.config``)."""
    return actor._recipe(config)


def _negated_batch():
    """tests/test_integration_openrlhf_actor.py's batch with the advantages negated: rows 0, 1, 3, 5
    have A < 0, and rows 3 and 5 have mean log(π_rollout/π_θ) > δ (OPSM drops them)."""
    seq, attn, mask, old, rollout, adv = actor._batch()
    return seq, attn, mask, old, rollout, -adv


def _correction(batch, config):
    """Independently: (accepted tokens, IS weights) of token TIS [0.5, 2] with or without the
    token_k1 rejection outside [0.5, 2]."""
    _, _, mask, old, rollout, _ = batch
    rho = torch.exp(old - rollout)
    keep = mask & (rho >= 0.5) & (rho <= 2.0) if "rollout_rs" in config else mask.clone()
    return keep, rho.clamp(0.5, 2.0) * mask


def _opsm_rows(batch, keep, delta=DELTA):
    """Independently: OPSM keeps a row iff A ≥ 0 or mean over its accepted tokens of
    (log π_rollout − log π_θ) ≤ δ; π_θ is the policy (the learning rate is 0, so it is the initial one)."""
    seq, _, _, _, rollout, adv = batch
    with torch.no_grad():
        logp = actor.TinyPolicy().token_log_probs(seq, A)
    k = keep.float()
    div = ((rollout - logp) * k).sum(-1) / k.sum(-1).clamp(min=1)
    a = (adv * k).sum(-1) / k.sum(-1).clamp(min=1)
    return (a >= 0) | (div <= delta)


def _per_token(loss_type, logp, old, a, k, eps=(0.2, 0.2), dual_clip=None, c=3.0):
    """The per-token losses written from their papers' formulas (k: accepted tokens, for GSPO's mean)."""
    lo, hi = eps
    if loss_type == "ppo":
        r = torch.exp(logp - old)
        loss = -torch.min(r * a, r.clamp(1 - lo, 1 + hi) * a)
        if dual_clip is not None:
            loss = torch.where(a < 0, torch.min(loss, -dual_clip * a), loss)
        return loss
    if loss_type == "gspo":
        # s = exp(mean over the sequence's tokens of log r), carried to each token as
        # s_t = sg(s)·π_θ(y_t)/sg(π_θ(y_t)) (GSPO-token: value s, gradient s·∇log π_θ(y_t))
        kf = k.float()
        mean = ((logp - old) * kf).sum(-1, keepdim=True) / kf.sum(-1, keepdim=True).clamp(min=1)
        s = torch.exp(mean.detach() + logp - logp.detach())
        return -torch.min(s * a, s.clamp(1 - lo, 1 + hi) * a)
    r = torch.exp(logp - old).detach()
    if loss_type == "cispo":
        return -r.clamp(1 - lo, 1 + hi) * a * logp
    p, q = logp.exp().detach(), old.exp()
    if loss_type == "dppo_tv":
        inside = torch.where(a > 0, p - q <= hi, p - q >= -lo)
    else:  # dppo_kl: the binary KL of the token event, KL(π_old ‖ π_θ)
        kl = q * torch.log(q / p) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        inside = torch.where(a > 0, (kl <= hi) | (p <= q), (kl <= lo) | (p >= q))
    return -a * torch.clamp(r, max=c) * logp * inside


def _expected_grads(batch, windows, counted, in_loss, weight, loss_type, **kw):
    """∇ per optimizer step of Σ_{in_loss} w·ℓ / (tokens of ``counted``), or for gspo the sum over
    sequences of their mean w·ℓ over ``in_loss`` tokens / (sequences with a ``counted`` token)."""
    seq, _, _, old, _, adv = batch
    grads = []
    for rows in windows:
        rows = torch.tensor(rows)
        policy = actor.TinyPolicy()
        logp = policy.token_log_probs(seq[rows], A)
        k, c = in_loss[rows], counted[rows]
        ell = weight[rows] * _per_token(loss_type, logp, old[rows], adv[rows], k, **kw)
        ell = torch.where(k, ell, torch.zeros(()))
        if loss_type == "gspo":
            n = k.sum(-1)
            loss = (ell.sum(-1) / n.clamp(min=1)).sum() / c.any(-1).sum()
        else:
            loss = ell.sum() / c.sum()
        loss.backward()
        grads.append(policy.W.grad)
    return grads


def _check(grads, expected):
    assert len(grads) == len(expected) == 2
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert any(want.abs().sum() > 0 for want in expected)


@pytest.mark.parametrize("base", ["tis", "token_rs"])
@pytest.mark.parametrize("loss_type,extra", [("ppo", []), ("ppo", ["--actor.dual_clip", "3.0"]), ("gspo", [])])
def test_opsm_through_openrlhf_loss_call(root, base, loss_type, extra, monkeypatch):
    """OPSM (``rollout_opsm_delta``) drops rows 3 and 5 (A < 0, divergence > δ; with the token
    rejection rows 0 and 3) and keeps other rows with A < 0 (divergence ≤ δ). The dropped rows'
    tokens leave the loss but stay in OpenRLHF's denominators (DeepSeek-V3.2's M_i,t multiplies the
    term inside the normalisation; OPSM depends on π_θ, which changes during the step, so it cannot
    be decided at experience time)."""
    config = {**(TIS if base == "tis" else TOKEN_RS), "rollout_opsm_delta": DELTA,
              **({"loss_type": "gspo"} if loss_type == "gspo" else {})}
    args = ref.parse_cli(actor.CLI + ["--actor.policy_loss_type", loss_type] + extra + ref.enable_flags(root), root)
    batch = _negated_batch()
    keep, weight = _correction(batch, config)
    rows = _opsm_rows(batch, keep)
    negative = (batch[5] * keep).sum(-1) < 0
    dropped = {"tis": [3, 5], "token_rs": [0, 3]}[base]  # token_rs: (0, 1) rejected, row 5 fully
    assert (~rows).nonzero().flatten().tolist() == dropped
    assert bool((negative & rows).any())  # and some A < 0 rows are kept
    trainer, status, grads, windows = actor._train(root, _with(config), args, batch, monkeypatch)
    dual = {"dual_clip": 3.0} if extra else {}
    _check(grads, _expected_grads(batch, windows, keep, keep & rows.unsqueeze(-1), weight, loss_type, **dual))
    # Without OPSM the same steps give other gradients: the option acts.
    without = _expected_grads(batch, windows, keep, keep, weight, loss_type, **dual)
    assert any(not torch.allclose(g, w, rtol=1e-4, atol=1e-6) for g, w in zip(grads, without))
    metrics = trainer.actor_loss_fn.last_metrics
    assert "rollout_corr/opsm_seq_masked_fraction" in metrics and "actor/pg_clipfrac" in metrics


@pytest.mark.parametrize("loss_type", ["gspo", "cispo", "dppo_tv", "dppo_kl"])
def test_loss_types_through_openrlhf_loss_call(root, loss_type, monkeypatch):
    """``loss_type`` of the config: the core's loss × the token TIS weights, over the tokens the
    token_k1 rejection accepted (three single tokens and rows 2 and 5 rejected), with OpenRLHF's clip
    range (asymmetric here) as ε_lo / ε_hi (DPPO: the trust-region bounds δ_lo / δ_hi)."""
    config = {**TOKEN_RS, "loss_type": loss_type}
    eps = (0.1, 0.15) if loss_type.startswith("dppo") else (0.2, 0.28)
    policy = ["--actor.policy_loss_type", "gspo"] if loss_type == "gspo" else []
    args = ref.parse_cli(actor.CLI + policy + ["--actor.eps_clip_low_high", *map(str, eps)] + ref.enable_flags(root),
                         root)
    batch = actor._batch()
    keep, weight = _correction(batch, config)
    trainer, status, grads, windows = actor._train(root, _with(config), args, batch, monkeypatch)
    _check(grads, _expected_grads(batch, windows, keep, keep, weight, loss_type, eps=eps))
    if loss_type != "gspo":  # not the PPO loss OpenRLHF would have computed with the same weights
        ppo = _expected_grads(batch, windows, keep, keep, weight, "ppo", eps=eps)
        assert any(not torch.allclose(g, w, rtol=1e-4, atol=1e-6) for g, w in zip(grads, ppo))
    # The loss's clip fraction (GSPO / CISPO: ratio clipped; DPPO: token outside the trust region)
    # is what OpenRLHF logs as ppo_clip_ratio.
    assert 0.0 <= status["ppo_clip_ratio"] <= 1.0 and abs(status["ppo_kl"]) < 1.0
    assert "actor/pg_clipfrac" in trainer.actor_loss_fn.last_metrics


def test_openrlhf_gspo_flag_with_mapped_correction(root, monkeypatch):
    """``--actor.policy_loss_type gspo`` with OpenRLHF's own correction flags (no config): from_args
    sets ``loss_type='gspo'``; GSPO (ratio π_θ/π_old) × seq-mask-tis, one GSPO, averaged over the
    accepted sequences."""
    args = ref.parse_cli(actor.CLI + ["--actor.policy_loss_type", "gspo"] + actor.flags(root), root)
    ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=ref.policy_loss_class(root))
    assert ours.config == RolloutCorrectionConfig.from_dict(
        {**config_from_openrlhf("seq-mask-tis", [0.5, 5.0]).to_dict(), "loss_type": "gspo"})
    assert ours.uses_core_loss
    batch = actor._batch()
    keep, weight = actor._seq_mask_tis(batch)
    _, _, grads, windows = actor._train(root, actor.RECIPE, args, batch, monkeypatch)
    _check(grads, _expected_grads(batch, windows, keep, keep, weight, "gspo"))


def _build(root, argv, config):
    args = ref.parse_cli(actor.CLI + argv + ref.enable_flags(root), root)
    return RolloutCorrectionPolicyLoss.from_args(args, config, policy_loss_cls=ref.policy_loss_class(root))


@pytest.mark.parametrize("config,argv,names", [
    ({**TIS, "rollout_m2po_threshold": 0.04}, [], ["rollout_m2po_threshold", "compute_rollout_correction"]),
    ({**TIS, "rollout_is_batch_normalize": True}, [], ["rollout_is_batch_normalize", "compute_rollout_correction"]),
    ({**TIS, "bypass_mode": True}, [], ["bypass_mode", "compute_policy_loss"]),
    ({"bypass_mode": True, "loss_type": "reinforce"}, [], ["bypass_mode", "'reinforce'"]),
    ({"bypass_mode": True, "loss_type": "topr"}, [], ["bypass_mode", "'topr'"]),
    ("bypass_topr", [], ["bypass_mode", "'topr'"]),
    ("decoupled_token_is_m2po", [], ["rollout_m2po_threshold"]),
    (TIS, ["--actor.policy_loss_type", "gspo"], ["--actor.policy_loss_type gspo", "loss_type='ppo_clip'"]),
    ({**TIS, "loss_type": "gspo"}, [], ["loss_type='gspo'", "--actor.policy_loss_type gspo"]),
    ({**TIS, "loss_type": "cispo"}, ["--actor.dual_clip", "3.0"], ["--actor.dual_clip", "'cispo'"]),
    ({**TIS, "loss_type": "gspo"}, ["--actor.policy_loss_type", "gspo", "--actor.dual_clip", "3.0"],
     ["--actor.dual_clip", "'gspo'"]),
])
def test_unhonoured_keys_are_refused_by_name(root, config, argv, names):
    with pytest.raises(ValueError) as err:
        _build(root, argv, config)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("config", ["decoupled_token_is_opsm", "decoupled_cispo_token_is", "decoupled_dppo_tv_token_is",
                                    "decoupled_dppo_kl_token_is", "decoupled_token_is", "decoupled_geo_rs_token_tis"])
def test_presets_accepted_on_ppo(root, config):
    loss = _build(root, [], config)
    assert loss.uses_core_loss == (config != "decoupled_token_is" and config != "decoupled_geo_rs_token_tis")


def test_gspo_preset_needs_the_gspo_flag(root):
    assert _build(root, ["--actor.policy_loss_type", "gspo"], "decoupled_gspo_geo_is").config.loss_type == "gspo"
    with pytest.raises(ValueError, match="--actor.policy_loss_type gspo"):
        _build(root, [], "decoupled_gspo_geo_is")


def test_documented_method_table(root):
    """Every ``--rollout_correction.config X`` and preset of docs/integrations.md's OpenRLHF step 5 builds
    on the args of OpenRLHF's CLI (GSPO ones with ``--actor.policy_loss_type gspo``), and the
    methods the table marks as refused are refused."""
    import re

    text = actor.DOCS.read_text()
    section = text[text.index("**5. Other methods**"):text.index("**What changes, and why at experience time.**")]
    configs = [launcher.parse_config_option([launcher.CONFIG_OPTION, m.strip("'")])[0]
               for m in re.findall(r"`--rollout_correction\.config ('\{.+?\}'|[a-z0-9_]+)`", section)]
    assert any(isinstance(c, dict) for c in configs) and any(isinstance(c, str) for c in configs)
    configs += re.findall(r'`"((?:decoupled|bypass)_[a-z0-9_]+)"`', section)
    assert {"decoupled_token_is_opsm", "decoupled_cispo_token_is", "decoupled_dppo_tv_token_is",
            "decoupled_dppo_kl_token_is", "decoupled_gspo_geo_is"} <= {c for c in configs if isinstance(c, str)}
    for config in configs:
        gspo = as_config(config).loss_type == "gspo"
        loss = _build(root, ["--actor.policy_loss_type", "gspo"] if gspo else [], config)
        assert loss.uses_core_loss == (loss.config.loss_type != "ppo_clip" or loss.config.rollout_opsm_delta is not None)
    for row, key in (("M2PO", "rollout_m2po_threshold"), ("`rollout_is_batch_normalize`", "rollout_is_batch_normalize"),
                     ("bypass mode", "bypass_mode")):
        assert re.search(rf"\| {re.escape(row)}[^|]*\| no: refused", section), row
