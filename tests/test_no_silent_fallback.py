"""No silent fallbacks: every (loss type, mode, IS level, rejection option) either runs as named or
is refused at construction with a ConfigError that names the fix.

"Runs as named" is checked against the method written out from its public pieces: the correction
of π_train vs π_rollout (π_train = π_old in decoupled mode, π_θ in bypass mode) gives the IS
weights w and the kept tokens; the per-token loss of ``loss_type`` (``ppo_clip_loss``,
``gspo_loss``, …; REINFORCE −A·log π_θ) is taken against π_prox = π_old (decoupled) or π_rollout
(bypass), multiplied by w in decoupled mode and for REINFORCE (in bypass mode the ratio to
π_rollout of the other losses is their correction, and w is a diagnostic), and averaged over the
kept tokens (token-mean). ``compute_policy_loss`` must give that value for every combination it
accepts.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from rollout_correction_core import (Aggregation, ClipRange, ConfigError, PolicyLoss, RolloutCorrectionConfig,
                                     Segments, agg_loss, compute_policy_loss, compute_rollout_correction, ppo_clip_loss)
from rollout_correction_core.primitives import (RS_OPTIONS, IsLevel, LossType, cispo_loss, dppo_loss, gspo_loss,
                                                ratio_pg_loss, rollout_is_loss, topr_loss)
from rollout_correction_core.vocabulary import LEGACY_RS

LOSS_TYPES = get_args(LossType)
IS_LEVELS = (None,) + get_args(IsLevel)
RS_CHOICES = (None,) + tuple(sorted(RS_OPTIONS)) + tuple(sorted(LEGACY_RS))
#: The losses defined on π_θ/π_rollout alone: bypass mode only (README, docs/methods.md).
BYPASS_ONLY = {"reinforce", "topr", "rollout_is"}
#: A threshold each estimator reads (k1: a ratio band; dp: a band on Δp; logprob_error: ≥ 1).
THRESHOLD = {"k1": "0.5_2.0", "k2": 0.05, "k3": 0.05, "tv": 0.2, "binary_kl": 0.05, "kpop": 0.05,
             "logprob_error": 1.3, "dp": "-0.2_0.2"}
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
#: The same range (dual clip c = 3) as the loss's settings.
LOSS = PolicyLoss(clip=ClipRange(low=0.2, high=0.28, dual=3.0))


def _settings(loss_type: str, bypass: bool, level, rs) -> dict:
    out = {"loss_type": loss_type, "bypass_mode": bypass}
    if level is not None:
        out.update(rollout_is=level, rollout_is_threshold=2.0)
    if rs is not None:
        out.update(rollout_rs=rs, rollout_rs_threshold=2.0 if rs in LEGACY_RS else THRESHOLD[RS_OPTIONS[rs][1]])
    return out


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(39)
    B, T = 6, 10
    rollout = -torch.rand(B, T, generator=gen) * 2 - 0.05
    old = (rollout + 0.25 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    log_prob = (old + 0.2 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(B, 1, generator=gen).expand(B, T).contiguous()
    lengths = torch.tensor([10, 7, 4, 9, 1, 6])
    mask = torch.arange(T) < lengths[:, None]
    segment_ids = (torch.arange(T) >= 3).long().expand(B, T).contiguous()  # two turns per row
    return log_prob, old, rollout, adv, mask, segment_ids


def _per_token(loss_type, lp, prox, adv, keep):
    if loss_type == "reinforce":
        return -adv * lp
    if loss_type == "ppo_clip":
        return ppo_clip_loss(lp, prox, adv, LOSS.clip)[0]
    if loss_type == "gspo":
        return gspo_loss(lp, prox, adv, keep, **CLIP)[0]
    if loss_type == "cispo":
        return cispo_loss(lp, prox, adv, **CLIP)[0]
    if loss_type in ("dppo_tv", "dppo_kl"):
        return dppo_loss(lp, prox, adv, loss_type[5:], **CLIP, clip_ratio_c=3.0)[0]
    if loss_type == "topr":
        return topr_loss(lp, prox, adv, keep)[0]
    if loss_type == "ratio_pg":
        return ratio_pg_loss(lp, prox, adv)
    assert loss_type == "rollout_is"
    return rollout_is_loss(lp, prox, adv, **CLIP)[0]


def _named_method(cfg, batch, corrections):
    """The loss of the method ``cfg`` names, from its public pieces (module docstring)."""
    log_prob, old, rollout, adv, mask, segment_ids = batch
    bypass = cfg.bypass_mode
    key = (bypass, cfg.rollout_is, cfg.rollout_rs)
    if key not in corrections:
        corrections[key] = compute_rollout_correction(log_prob if bypass else old, rollout, mask, config=cfg,
                                                      segments=Segments(segment_ids))
    corr = corrections[key]
    keep = corr.response_mask.bool()
    pg = _per_token(cfg.loss_type, log_prob, rollout if bypass else old, adv, keep)
    if corr.weights is not None and (not bypass or cfg.loss_type == "reinforce"):
        pg = pg * corr.weights
    return agg_loss(pg, keep, Aggregation("token-mean"))


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_combination_runs_as_named_or_is_refused(batch, loss_type, mode):
    log_prob, old, rollout, adv, mask, segment_ids = batch
    bypass = mode == "bypass"
    corrections: dict = {}
    ran, wrong, refused = 0, [], []
    for level in IS_LEVELS:
        for rs in RS_CHOICES:
            settings = _settings(loss_type, bypass, level, rs)
            try:
                cfg = RolloutCorrectionConfig(**settings)
            except ConfigError as exc:
                refused.append((level, rs))
                assert "bypass_mode=True" in str(exc), f"{settings}: the error names no fix: {exc}"
                continue
            loss, _ = compute_policy_loss(log_prob, old, adv, mask, config=cfg, rollout_log_prob=rollout,
                                          segments=Segments(segment_ids), loss=LOSS)
            expected = _named_method(cfg, batch, corrections)
            ran += 1
            if not torch.allclose(loss, expected, rtol=1e-5, atol=1e-6):
                wrong.append(f"{settings}: {loss.item():.7g} vs {expected.item():.7g}")
    assert not wrong, f"{len(wrong)} combinations do not run as named:\n" + "\n".join(wrong[:20])
    if loss_type in BYPASS_ONLY and not bypass:  # refused whatever the weights and the rejection
        assert ran == 0 and len(refused) == len(IS_LEVELS) * len(RS_CHOICES)
    else:
        assert not refused and ran == len(IS_LEVELS) * len(RS_CHOICES)


def test_reinforce_without_bypass_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"loss_type='reinforce'.*set bypass_mode=True, or use ppo_clip"):
        RolloutCorrectionConfig(loss_type="reinforce")
    with pytest.raises(ConfigError, match=r"loss_type='reinforce'"):
        RolloutCorrectionConfig.from_dict({"rollout_is": "token", "loss_type": "reinforce"})
    assert RolloutCorrectionConfig(loss_type="reinforce", bypass_mode=True).uses_pure_is


@pytest.mark.parametrize("settings, key", [
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
    ({"rollout_is_threshold_lower": 0.5}, "rollout_is_threshold_lower"),
    ({"rollout_rs_threshold_lower": 0.5, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1},
     "rollout_rs_threshold_lower"),
])
def test_a_weight_setting_without_weights_is_refused(settings, key):
    """A setting that would silently do nothing is an error naming it and the fix."""
    with pytest.raises(ConfigError, match=rf"{key}=.*(set rollout_is|take their bounds)"):
        RolloutCorrectionConfig(**settings)


def test_every_preset_is_valid():
    for name in RolloutCorrectionConfig.preset_names():
        cfg = RolloutCorrectionConfig.from_preset(name)
        assert cfg.loss_type not in BYPASS_ONLY or cfg.bypass_mode, name


# ------------------------------------------------- every entry point's optional inputs, walked
ASKS = {  # a config asking for something that needs the rollout log-probs, one per kind of request
    "IS": dict(rollout_is="token", rollout_is_threshold=2.0),
    "RS": dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05),
    "veto": dict(rollout_token_veto_threshold=1e-4),
    "M2PO": dict(rollout_m2po_threshold=0.04),
    "expect-zero": dict(expect_zero_atol=1e-6, expect_zero_action="warn"),
    "alignment": dict(check_alignment=True),
    "mismatch metrics": dict(mismatch_metrics=True),
}


@pytest.mark.parametrize("ask", sorted(ASKS))
@pytest.mark.parametrize("given", ["rollout", "weights", "both", "neither"])
def test_the_loss_runs_what_its_inputs_allow_or_refuses(batch, ask, given):
    """Decoupled ``compute_policy_loss`` with each kind of request and each combination of its optional
    inputs: with ``rollout_log_prob`` the correction is computed here (its metrics are returned); with
    ``rollout_is_weights`` alone they weight the loss as given (the mask passed is the corrected one);
    with neither, a request that needs the rollout log-probs is a ConfigError naming both inputs,
    never plain PPO."""
    log_prob, old, rollout, adv, mask, _ = batch
    cfg = RolloutCorrectionConfig(**ASKS[ask])
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    kwargs = {"rollout_log_prob": rollout if given in ("rollout", "both") else None,
              "rollout_is_weights": weights if given in ("weights", "both") else None}
    if given == "neither":
        with pytest.raises(ConfigError, match="neither rollout_log_prob nor rollout_is_weights.*" + list(
                ASKS[ask])[0]):
            compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
        return
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, config=cfg, loss=LOSS, **kwargs)
    assert torch.isfinite(loss)
    corrected_here = kwargs["rollout_is_weights"] is None
    assert any(k.startswith("rollout_corr/") for k in metrics) == corrected_here, sorted(metrics)
    if not corrected_here:  # the weights as given, on the mask as given
        expected = agg_loss(ppo_clip_loss(log_prob, old, adv, LOSS.clip)[0] * weights, mask, Aggregation("token-mean"))
        torch.testing.assert_close(loss, expected)


def test_a_plain_config_without_rollout_inputs_is_plain_ppo(batch):
    """A config that asks for no correction and no diagnostic needs no rollout input: plain PPO."""
    log_prob, old, _, adv, mask, _ = batch
    loss, _ = compute_policy_loss(log_prob, old, adv, mask, config=RolloutCorrectionConfig(), loss=LOSS)
    expected = agg_loss(ppo_clip_loss(log_prob, old, adv, LOSS.clip)[0], mask, Aggregation("token-mean"))
    torch.testing.assert_close(loss, expected)
