"""The engines' recent bugs as regression tests: each case fails on the bug it is named after.

* TRL AsyncGRPO (PR #7120 review): sequence truncation as clamp(ρ)/ρ of the product gives
  0.8/0.7³⁰⁰ = inf; here the sequence weight over 300 and 3,000 tokens is the clamped product
  computed in log space, finite.
* The same review: a sequence mask at 3 rejects whole stale batches (0.005 × 300 tokens gives
  ∏ρ = 4.48): ``expected_response_length`` warns at construction, naming the length from which
  a sequence-level bound is crossed.
* NeMo-RL #4154: −inf engine log-probs (top-k / top-p) at masked positions reached a metric
  before the mask (inf·0 = NaN); here −inf and vLLM's −9999 there leave no NaN in any weight,
  mask, metric, loss or gradient, for every preset and loss type.
* miles #3230: an ESS ratio of 1.25; here it is at most 1 (also a property of the random-layout
  and fuzz suites, tests/test_distributed_properties.py and tests/test_fuzz.py).
* Megatron-LM #7015: aligning engine log-probs of another length truncated silently; here every
  adapter that takes them raises, naming both lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from typing import get_args

import pytest
import torch

from rollout_correction import (Aggregation, PolicyLoss, RolloutCorrectionConfig, compute_offpolicy_metrics,
                                compute_policy_loss, compute_rollout_correction, metrics_to_floats)
from rollout_correction_core import ConfigError
from rollout_correction_core.primitives import LossType

P = "rollout_corr/"


# ---------------------------------------------------------------------------------------- TRL #7120

def _constant_gap(length: int, log_ratio: float, rows: int = 2):
    rollout = torch.full((rows, length), -1.2)
    return rollout + log_ratio, rollout, torch.ones(rows, length, dtype=torch.bool)


def _clamped_product(old, rollout):
    """exp(clamp(Σ log ρ_t, ±20)) per row from the float32 log-ratios the call sees, summed in float64."""
    return (old - rollout).double().sum(-1).clamp(-20.0, 20.0).exp()


@pytest.mark.parametrize("length", [300, 3000])
@pytest.mark.parametrize("log_ratio", [0.005, -0.005, -0.7])
def test_sequence_truncation_is_the_clamped_product_in_log_space(length, log_ratio):
    old, rollout, mask = _constant_gap(length, log_ratio)
    product = _clamped_product(old, rollout)
    from rollout_correction.integrations.trl import config_from_trl_args

    settings = {"decoupled_seq_is (C = 2)": (RolloutCorrectionConfig.decoupled_seq_is(), lambda w: w.clamp(max=2.0)),
                "TRL sequence_truncate (C = 3)": (config_from_trl_args("sequence_truncate", None, 3.0),
                                                  lambda w: w.clamp(max=3.0)),
                "TRL sequence_mask [0, 3]": (config_from_trl_args("sequence_mask", None, 3.0),
                                             lambda w: torch.where(w <= 3.0, w, 0.0))}
    for name, (cfg, bound) in settings.items():
        out = compute_rollout_correction(old, rollout, mask, config=cfg)
        assert torch.isfinite(out.weights).all(), name
        expected = bound(product).float().unsqueeze(-1).expand_as(out.weights)
        torch.testing.assert_close(out.weights, expected, rtol=2e-4, atol=0, msg=name)
        assert all(math.isfinite(v) for v in out.metrics_as_floats().values()), name
    if log_ratio == -0.7:  # 0.7^300: the product is below every float, its clamp is exp(−20)
        assert float(product[0]) == pytest.approx(math.exp(-20.0))


# ------------------------------------------------------------------------ expected_response_length

def _warnings(**settings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = RolloutCorrectionConfig(**settings)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_sequence_mask_at_3_warns_from_220_tokens():
    # TRL's default sequence_mask, clip_max 3: 0.005·L > log 3 from L = 220 (log 3 / 0.005 = 219.7)
    seq_mask = dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_mode="mask",
                    rollout_is_threshold_lower=0.0)
    cfg, msgs = _warnings(**seq_mask, expected_response_length=300)
    assert len(msgs) == 1 and "from 220 tokens" in msgs[0] and "rejects whole batches" in msgs[0]
    assert "expected_response_length=300" in msgs[0]
    assert cfg.length_limits() == [(cfg.length_limits()[0][0], 220, cfg.length_limits()[0][2])]
    assert _warnings(**seq_mask, expected_response_length=219)[1] == []
    assert _warnings(**seq_mask)[1] == []  # no length, no warning


def test_length_limits_of_the_sequence_level_settings():
    ln2 = math.log(2.0)
    limits = RolloutCorrectionConfig.decoupled_seq_is_rs().length_limits()  # seq TIS at 2, ∏ρ band [0.5, 2]
    assert [(lim[1], lim[2].split()[0]) for lim in limits] == [(math.floor(ln2 / 0.005) + 1, "bounds"),
                                                               (math.floor(ln2 / 0.005) + 1, "rejects")]
    k3 = RolloutCorrectionConfig(rollout_rs="seq_sum_k3", rollout_rs_threshold=0.01)
    assert k3.length_limits() == [("rollout_rs option 'seq_sum_k3'",
                                   math.floor(0.01 / (math.exp(0.005) - 1 - 0.005)) + 1, "rejects whole batches")]
    assert k3.length_limits(drift=0.05)[0][1] == math.floor(0.01 / (math.exp(0.05) - 1 - 0.05)) + 1
    # length-normalised and token levels do not grow with the length
    for name in ("decoupled_geo_rs", "decoupled_geo_is", "decoupled_token_is", "decoupled_k3_rs", "prime_rl_ipo"):
        assert RolloutCorrectionConfig.from_preset(name).length_limits() == [], name
    _, msgs = _warnings(**{**RolloutCorrectionConfig.decoupled_geo_rs().to_dict(), "expected_response_length": 10 ** 5})
    assert msgs == []


def test_expected_response_length_bad_values():
    for bad in (0, -3, 2.5, "300", True):
        with pytest.raises(ConfigError, match="expected_response_length.*positive integer"):
            RolloutCorrectionConfig(expected_response_length=bad)
    with pytest.raises(ValueError, match="drift"):
        RolloutCorrectionConfig.decoupled_seq_is().length_limits(drift=0.0)


def test_diagnose_names_the_length_where_sequence_bounds_are_crossed(tmp_path):
    """Without a configured length, diagnose reads it off the dump: at 300 tokens a mean log-ratio of
    0.005 (the dump's own |kl| is smaller) crosses the sequence-level bounds of the ∏ρ presets from 139
    tokens on; at 64 it does not."""
    from rollout_correction.diagnose import diagnose_tensors, summary_dict, write_report

    gen = torch.Generator().manual_seed(0)
    for length, noted in ((300, True), (64, False)):
        rollout = -torch.rand(32, length, generator=gen) * 2 - 0.1
        old = (rollout - 0.004 + 0.01 * torch.randn(32, length, generator=gen)).clamp(max=0.0)  # |kl| ≈ 0.004 < 0.005
        diag = diagnose_tensors(old, rollout, torch.ones(32, length), presets=[])
        notes = summary_dict(diag)["recommendation"]["notes"]
        if not noted:
            assert notes == []
            continue
        assert len(notes) == 1 and "from 139 tokens on" in notes[0] and "average 300 tokens" in notes[0]
        assert "decoupled_seq_is_rs" in notes[0] and "decoupled_geo_is" not in notes[0]
        write_report(diag, str(tmp_path))
        assert "**Response length.**" in (tmp_path / "report.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------- NeMo-RL #4154

def _masked_garbage(value: float):
    """Rows whose masked positions hold ``value`` in the engine's (and the trainer's) log-probs."""
    gen = torch.Generator().manual_seed(3)
    rollout = -torch.rand(3, 7, generator=gen) * 2 - 0.05
    old = (rollout + 0.2 * torch.randn(3, 7, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    rollout = torch.where(mask, rollout, value)
    old = torch.where(mask, old, value if value != -9999.0 else -math.inf)
    return old, rollout, mask


CONFIGS = [(name, RolloutCorrectionConfig.from_preset(name)) for name in RolloutCorrectionConfig.preset_names()]
CONFIGS += [(f"{t}/{'bypass' if b else 'decoupled'}", RolloutCorrectionConfig(
    loss_type=t, bypass_mode=b, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_tv,seq_mean_k3",
    rollout_rs_threshold=(0.5, 0.5))) for t in get_args(LossType) for b in (False, True)
    if b or t not in ("reinforce", "topr", "rollout_is")]


@pytest.mark.parametrize("value", [-math.inf, -9999.0])
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_nonfinite_log_probs_at_masked_positions_reach_nothing(name, cfg, value):
    old, rollout, mask = _masked_garbage(value)
    cfg = cfg.replace(mismatch_metrics=True)
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    assert out.weights is None or torch.isfinite(out.weights).all()
    assert not (out.response_mask & ~mask).any()
    floats = out.metrics_as_floats()
    assert all(math.isfinite(v) for v in floats.values())
    assert floats[P + "nonfinite_seq_fraction"] == 0.0  # the garbage at masked positions dropped no row
    lp = torch.where(mask, old + 0.05, value).requires_grad_(True)
    adv = torch.where(mask, torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 7), value)
    loss, metrics = compute_policy_loss(lp, old, adv, mask, config=cfg, rollout_log_prob=rollout,
                                        loss=PolicyLoss(aggregation=Aggregation("seq-mean-token-mean")))
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in metrics_to_floats(metrics).values())
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
    assert all(math.isfinite(v) for v in metrics_to_floats(
        compute_offpolicy_metrics(old, rollout, mask, mismatch_metrics=True)).values())


# ---------------------------------------------------------------------------------------- miles #3230

def test_ess_of_equal_weights_is_one_not_more():
    old = torch.full((3, 4), -1.0)
    for name in ("decoupled_token_is", "decoupled_seq_is", "decoupled_geo_is", "prime_rl_icepop"):
        cfg = RolloutCorrectionConfig.from_preset(name)
        m = compute_rollout_correction(old, old, torch.ones(3, 4, dtype=torch.bool), config=cfg).metrics_as_floats()
        for k in ("rollout_is_eff_sample_size", "rollout_is_seq_raw_ess"):
            assert P + k not in m or m[P + k] == 1.0, (name, k, m.get(P + k))  # was 1 + 2e-8 (the 1e-8 term)


# ---------------------------------------------------------------------------------------- Megatron-LM #7015

def _core(old, rollout, mask):
    compute_rollout_correction(old, rollout, mask)


def _core_loss(old, rollout, mask):
    compute_policy_loss(old.clone().requires_grad_(True), old, torch.ones_like(old), mask,
                        config=RolloutCorrectionConfig.decoupled_token_is(), rollout_log_prob=rollout)


def _verl(old, rollout, mask):
    from rollout_correction.compat.verl import compute_rollout_correction_and_rejection_mask

    compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="token")


def _skyrl(old, rollout, mask):
    from rollout_correction.compat.skyrl import compute_off_policy_correction

    cfg = argparse.Namespace(tis_ratio_type="token", token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=2.0,
                             sequence_mask_metric=None, geo_mask_high=1.01, geo_mask_low=0.99,
                             product_mask_high=2.0, product_mask_low=0.5, outlier_token_is_threshold_low=None,
                             outlier_token_is_threshold_high=None, token_mask_is_threshold_low=None,
                             token_mask_is_threshold_high=None)
    compute_off_policy_correction(old, rollout, mask, cfg)


def _areal(old, rollout, mask):
    from rollout_correction.compat.areal import apply_rejection_sampling

    cfg = argparse.Namespace(level="token", action="mask", metric="ratio", agg="mean", upper=2.0, lower=None)
    apply_rejection_sampling(old.reshape(-1), rollout.reshape(-1), mask.reshape(-1), None, cfg)


def _packed(old, rollout, mask):
    from rollout_correction.packed import compute_rollout_correction_packed

    compute_rollout_correction_packed(old.reshape(-1), rollout.reshape(-1), lengths=torch.tensor([old.shape[1]] * 2))


def _slime(old, rollout, mask):
    from rollout_correction.integrations.slime import tis_function

    args = argparse.Namespace(use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None,
                              tis_upper_bound=2.0, tis_batch_normalize=False, use_rs=False, rs_level="token",
                              rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None)
    tis_function(args, pg_loss=torch.zeros(2 * old.shape[1]), train_log_probs=list(old), rollout_log_probs=list(rollout),
                 loss_masks=[torch.ones(old.shape[1]), torch.ones(old.shape[1])])


def _dump(old, rollout, mask):
    from rollout_correction.integrations.dump import StepDump

    StepDump("/nonexistent").add(list(old), list(rollout), [torch.ones(old.shape[1])] * 2)


ADAPTERS = {"compute_rollout_correction": _core, "compute_policy_loss": _core_loss, "verl drop-in": _verl,
            "SkyRL drop-in": _skyrl, "AReaL drop-in": _areal, "packed": _packed, "slime TIS hook": _slime,
            "StepDump": _dump}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("rollout_len", [4, 6])
def test_engine_log_probs_of_another_length_are_refused(adapter, rollout_len):
    """Trainer log-probs of 5 tokens per row, engine log-probs of 4 or 6: a clear error naming both
    lengths, never a truncation to the shorter or a padding of the longer."""
    old = torch.full((2, 5), -1.0)
    rollout = torch.full((2, rollout_len), -1.1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError) as info:
        ADAPTERS[adapter](old, rollout, mask)
    message = str(info.value)
    lengths = {"AReaL drop-in": ("10", str(2 * rollout_len)), "packed": ("10", str(2 * rollout_len))}.get(
        adapter, ("5", str(rollout_len)))
    assert all(n in message for n in lengths), message


def test_diagnose_reader_names_both_lengths(tmp_path):
    from rollout_correction.diagnose import iter_chunks

    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps({"rollout_log_probs": [-1.0] * 4, "old_log_probs": [-1.0] * 5}) + "\n")
    with pytest.raises(ValueError, match="row 0: 'old_log_probs' has 5 values but 'rollout_log_probs' has 4"):
        list(iter_chunks(str(path)))
