"""Side-by-side agreement with verl 0.9.1's real rollout-correction helper and policy losses.

verl's own files run unmodified (see tests/verl_reference.py); ours run through the public
API. For every verl 0.9.1 preset and a set of extra option combinations, on random batches
of several shapes (every row has at least one valid token; log-ratios both realistic and
large enough to hit the ±20 safety bound), weights, masks and every metric verl reports must
agree to float tolerance.

The documented differences (docs/verl-differences.md) are tested separately:
(a) k1 bounds: verl compares ratio bounds against −log ρ, which inverts asymmetric bounds;
    our "lo_hi" is compared with verl given "(1/hi)_(1/lo)", and we check that we keep
    exactly the rows with lo ≤ ρ_agg ≤ hi;
(b) rows without valid tokens: verl counts them in sequence statistics, we exclude them;
(c) ``k3_kl`` / ``ppl_ratio``: we clamp the log-ratio to ±20 before exp, verl does not.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_reference import (
    assert_metrics_match,
    load_verl_algorithm_config,
    load_verl_core_algos,
    load_verl_rollout_corr_helper,
    require_verl,
    verl_equivalent_rs_threshold,
)

require_verl()

import rollout_correction as rc  # noqa: E402
from rollout_correction import (  # noqa: E402
    RolloutCorrectionConfig,
    compute_offpolicy_metrics,
    compute_policy_loss,
    compute_rollout_correction,
)
from rollout_correction import Aggregation, ClipRange, PolicyLoss


VERL = load_verl_rollout_corr_helper()
VERL_ALGOS = load_verl_core_algos()
VerlConfig = load_verl_algorithm_config().RolloutCorrectionConfig

PREFIX = "rollout_corr/"

VERL_PRESETS = [
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis",
    "bypass_ppo_clip",
    "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
    "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
    "disabled",
]

# (batch, length, per-token log-ratio scale). 0.05 is a realistic bf16-vs-fp32 gap; 0.6 on
# 300 tokens pushes sequence sums far past ±20; 4.0 pushes single tokens past it.
SHAPES = [(1, 1, 0.05), (5, 7, 0.05), (16, 64, 0.05), (8, 300, 0.6), (12, 40, 4.0)]

RTOL = 2e-5
ATOL = 1e-6

RS_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


# ----------------------------------------------------------------------------- inputs


def make_batch(batch: int, length: int, scale: float, seed: int, left_pad: bool = False):
    """Random (B, T) log-probs; every row keeps ≥ 1 valid token; fp32."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 4.0 - 0.01
    rollout = (old + scale * torch.randn(batch, length, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    pos = torch.arange(length)[None, :]
    if left_pad:
        mask = pos >= (length - lengths)[:, None]
    else:
        mask = pos < lengths[:, None]
    # Garbage at padding must never matter.
    old = torch.where(mask, old, torch.full_like(old, -7.5))
    return old, rollout, mask.to(torch.float32)


def batches():
    for i, (b, t, scale) in enumerate(SHAPES):
        yield pytest.param(b, t, scale, i, id=f"{b}x{t}-s{scale}")


# ----------------------------------------------------------------------------- comparison


def run_verl(old, rollout, mask, settings: dict):
    """verl's helper on float64 copies of the inputs (its numerics then carry no fp32 rounding)."""
    old, rollout = old.double(), rollout.double()
    kwargs = dict(settings)
    kwargs["rollout_rs_threshold"] = verl_equivalent_rs_threshold(kwargs.get("rollout_rs"), kwargs.get("rollout_rs_threshold"))
    holder, new_mask, metrics = VERL.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)
    weights = None if holder is None else holder.batch["rollout_is_weights"]
    return weights, new_mask, metrics


def run_ours(old, rollout, mask, cfg):
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    return out.weights, out.response_mask, out.metrics_as_floats()


def assert_same_correction(verl_result, our_result, context=""):
    v_w, v_mask, v_metrics = verl_result
    o_w, o_mask, o_metrics = our_result
    assert (v_w is None) == (o_w is None), f"{context}: weights present in one implementation only"
    if v_w is not None:
        torch.testing.assert_close(o_w.float(), v_w.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{context}: {m}")
    assert torch.equal(o_mask.float(), v_mask.float()), f"{context}: rejection masks differ"
    assert_metrics_match(v_metrics, o_metrics, context=context)


def verl_preset_settings(name: str) -> dict:
    cfg = getattr(VerlConfig, name)()
    return {key: getattr(cfg, key) for key in RS_KEYS}


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_preset_settings_match_verl(preset):
    """Our preset of the same name asks for the same correction as verl's."""
    ours = RolloutCorrectionConfig.from_preset(preset)
    theirs = getattr(VerlConfig, preset)()
    for key in RS_KEYS:  # bands in verl's "lo_hi" form
        assert ours.to_dict()[key] == getattr(theirs, key), f"{preset}.{key}"
    assert bool(getattr(ours, "bypass_mode")) == bool(theirs.bypass_mode), f"{preset}.bypass_mode"
    if theirs.bypass_mode:
        assert getattr(ours, "loss_type") == theirs.loss_type, f"{preset}.loss_type"


@pytest.mark.parametrize("preset", VERL_PRESETS)
@pytest.mark.parametrize("batch,length,scale,seed", list(batches()))
def test_preset_matches_verl(preset, batch, length, scale, seed):
    old, rollout, mask = make_batch(batch, length, scale, seed)
    settings = verl_preset_settings(preset)
    ours = run_ours(old, rollout, mask, RolloutCorrectionConfig.from_preset(preset))
    theirs = run_verl(old, rollout, mask, settings)
    assert_same_correction(theirs, ours, context=f"{preset} {batch}x{length}")


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_preset_on_bf16_inputs_matches_verl(preset):
    """bf16 log-probs: we compute in fp32; verl (given the same values) agrees."""
    old, rollout, mask = make_batch(9, 33, 0.05, 77)
    old, rollout = old.bfloat16(), rollout.bfloat16()
    ours = run_ours(old, rollout, mask, RolloutCorrectionConfig.from_preset(preset))
    theirs = run_verl(old, rollout, mask, verl_preset_settings(preset))
    assert_same_correction(theirs, ours, context=f"{preset} bf16")


@pytest.mark.parametrize("preset", VERL_PRESETS)
def test_we_are_at_least_as_close_to_exact_as_verl_fp32(preset):
    """Where ours and verl-in-fp32 differ, it is verl's fp32 rounding (e.g. its E[x²]−E[x]² std)."""
    old, rollout, mask = make_batch(12, 40, 4.0, 3)
    settings = verl_preset_settings(preset)
    settings["rollout_rs_threshold"] = verl_equivalent_rs_threshold(settings["rollout_rs"], settings["rollout_rs_threshold"])
    _, _, exact = VERL.compute_rollout_correction_and_rejection_mask(old.double(), rollout.double(), mask, **settings)
    _, _, fp32 = VERL.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
    ours = run_ours(old, rollout, mask, RolloutCorrectionConfig.from_preset(preset))[2]
    worse = [f"{k}: exact={exact[k]!r} ours={ours[k]!r} verl_fp32={fp32[k]!r}" for k in exact
             if abs(ours[k] - exact[k]) > abs(fp32[k] - exact[k]) + ATOL + RTOL * abs(exact[k])]
    assert not worse, "\n".join(worse)


# ----------------------------------------------------------------------------- extra combinations

EXTRA = {
    "metrics_only": dict(rollout_is=None),
    "token_tis_batch_norm": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True),
    "seq_tis_batch_norm": dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True),
    "token_icepop_batch_norm": dict(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True),
    "seq_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.2_8.0"),
    "token_tis_string_threshold": dict(rollout_is="token", rollout_is_threshold="1.5"),
    "token_k1_single_bound": dict(rollout_rs="token_k1", rollout_rs_threshold=2.0),
    "token_k2": dict(rollout_rs="token_k2", rollout_rs_threshold=0.02),
    "token_k3": dict(rollout_rs="token_k3", rollout_rs_threshold=0.02),
    "seq_sum_k1_asym": dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_1.5"),
    "seq_sum_k2": dict(rollout_rs="seq_sum_k2", rollout_rs_threshold=0.5),
    "seq_sum_k3": dict(rollout_rs="seq_sum_k3", rollout_rs_threshold=0.5),
    "seq_mean_k2": dict(rollout_rs="seq_mean_k2", rollout_rs_threshold=0.002),
    "seq_max_k2": dict(rollout_rs="seq_max_k2", rollout_rs_threshold=0.01),
    "seq_max_k3": dict(rollout_rs="seq_max_k3", rollout_rs_threshold=0.01),
    "token_k2_seq_max_k3": dict(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.02,0.05"),
    "chain_three_with_token_is": dict(
        rollout_is="token",
        rollout_is_threshold=3.0,
        rollout_rs="token_k1,seq_mean_k3,seq_max_k2",
        rollout_rs_threshold="0.4_2.0,0.01,0.05",
    ),
    "chain_all_sequence_k1_shared": dict(rollout_rs="seq_sum_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.5"),
    "seq_is_k3_chain_batch_norm": dict(
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k3,token_k1",
        rollout_rs_threshold="0.01,0.2_3.0",
    ),
}


@pytest.mark.parametrize("name", sorted(EXTRA))
@pytest.mark.parametrize("batch,length,scale,seed", list(batches()))
def test_extra_combination_matches_verl(name, batch, length, scale, seed):
    settings = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                "rollout_rs": None, "rollout_rs_threshold": None}
    settings.update(EXTRA[name])
    old, rollout, mask = make_batch(batch, length, scale, seed + 100, left_pad=seed % 2 == 1)
    ours = run_ours(old, rollout, mask, RolloutCorrectionConfig.from_dict(settings))
    if ours[0] is not None and not ours[0].any():
        # Difference (d): IcePop zeroed every weight; verl divides by zero computing the ESS.
        with pytest.raises(ZeroDivisionError):
            run_verl(old, rollout, mask, settings)
        assert ours[2][PREFIX + "rollout_is_eff_sample_size"] == 0.0
        return
    theirs = run_verl(old, rollout, mask, settings)
    assert_same_correction(theirs, ours, context=f"{name} {batch}x{length}")


def test_boolean_and_integer_masks_match_verl():
    old, rollout, mask = make_batch(6, 20, 0.3, 7)
    settings = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                    rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)
    theirs = run_verl(old, rollout, mask, settings)
    for m in (mask.bool(), mask.long()):
        w, new_mask, metrics = run_ours(old, rollout, m, RolloutCorrectionConfig.from_dict(settings))
        assert new_mask.dtype == m.dtype
        assert_same_correction(theirs, (w, new_mask, metrics), context=str(m.dtype))


# ----------------------------------------------------------------------------- off-policy metrics


@pytest.mark.parametrize("batch,length,scale,seed", list(batches()))
def test_offpolicy_metrics_match_verl(batch, length, scale, seed):
    old, rollout, mask = make_batch(batch, length, scale, seed + 200)
    theirs = VERL.compute_offpolicy_metrics(old, rollout, mask)
    ours = {k[len(PREFIX):]: float(v) for k, v in compute_offpolicy_metrics(old, rollout, mask).items()}
    assert_metrics_match(theirs, ours, context="offpolicy")


# ----------------------------------------------------------------------------- difference (a): k1 bounds


@pytest.mark.parametrize(
    "option,agg,lo,hi",  # asymmetric bands: 1/hi ≠ lo
    [("seq_sum_k1", "sum", 0.6, 3.0), ("seq_mean_k1", "mean", 0.9, 1.4), ("token_k1", "token", 0.6, 3.0)],
)
def test_asymmetric_k1_bounds_keep_rows_inside_ratio_band(option, agg, lo, hi):
    old, rollout, mask = make_batch(64, 12, 0.5, 11)
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": None, "rollout_rs": option, "rollout_rs_threshold": f"{lo}_{hi}"})
    out = compute_rollout_correction(old, rollout, mask, config=cfg)

    lr = (old.double() - rollout.double()) * mask.double()
    n = mask.double().sum(-1)
    if agg == "token":
        rho = lr.exp()
        expect = ((rho >= lo) & (rho <= hi)) & mask.bool()
    else:
        agg_lr = lr.sum(-1) if agg == "sum" else lr.sum(-1) / n
        keep = (agg_lr.exp() >= lo) & (agg_lr.exp() <= hi)
        expect = keep[:, None] & mask.bool()
    assert 0 < int(expect.sum()) < int(mask.sum()), "test data must hit both sides of the band"
    assert torch.equal(out.response_mask.bool(), expect)

    # verl, given the same "lo_hi", keeps the reciprocal band 1/hi ≤ ρ ≤ 1/lo instead.
    _, verl_mask, _ = VERL.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=None, rollout_rs=option, rollout_rs_threshold=f"{lo}_{hi}")
    if agg == "token":
        verl_expect = ((rho >= 1 / hi) & (rho <= 1 / lo)) & mask.bool()
    else:
        verl_expect = ((agg_lr.exp() >= 1 / hi) & (agg_lr.exp() <= 1 / lo))[:, None] & mask.bool()
    assert torch.equal(verl_mask.bool(), verl_expect)
    assert not torch.equal(verl_mask.bool(), out.response_mask.bool())


def test_reciprocal_k1_bounds_agree_with_verl_unchanged():
    old, rollout, mask = make_batch(64, 12, 0.5, 12)
    settings = dict(rollout_is=None, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    _, verl_mask, _ = VERL.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
    out = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.from_dict(settings))
    assert torch.equal(out.response_mask.float(), verl_mask.float())


# ----------------------------------------------------------------------------- difference (b): empty rows


def _insert_empty_rows(old, rollout, mask, rows):
    """Return the batch with all-padding rows inserted at the given indices."""
    b, t = mask.shape
    full = b + len(rows)
    keep = [i for i in range(full) if i not in rows]
    o = torch.full((full, t), -3.0)
    r = torch.full((full, t), -1.0)
    m = torch.zeros(full, t)
    o[keep], r[keep], m[keep] = old, rollout, mask
    return o, r, m


@pytest.mark.parametrize(
    "settings",
    [
        dict(rollout_is="token", rollout_is_threshold=2.0),
        dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
        dict(rollout_is="token", rollout_is_threshold="0.5_4.0", rollout_is_batch_normalize=True),
        dict(rollout_rs="seq_mean_k3,token_k1,seq_sum_k1", rollout_rs_threshold="0.02,0.5_2.0,0.2_5.0"),
        dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_max_k2,seq_sum_k3",
             rollout_rs_threshold="0.05,0.3"),
    ],
    ids=["token_tis", "seq_tis_bn", "icepop_bn", "rs_chain", "seq_tis_rs"],
)
def test_empty_rows_are_excluded_from_sequence_statistics(settings):
    """With empty rows present, we report what verl reports on the batch without them."""
    base = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
            "rollout_rs": None, "rollout_rs_threshold": None}
    base.update(settings)
    old, rollout, mask = make_batch(10, 16, 0.3, 21)
    empty = [0, 4, 11]
    o, r, m = _insert_empty_rows(old, rollout, mask, empty)
    w, new_mask, metrics = run_ours(o, r, m, RolloutCorrectionConfig.from_dict(base))
    v_w, v_mask, v_metrics = run_verl(old, rollout, mask, base)
    keep = [i for i in range(m.shape[0]) if i not in empty]
    assert_metrics_match(v_metrics, metrics, context="empty rows")
    assert torch.equal(new_mask[keep].float(), v_mask.float())
    assert not new_mask[empty].any()
    if v_w is not None:
        torch.testing.assert_close(w[keep], v_w.float(), rtol=RTOL, atol=ATOL)
        assert not w[empty].any()


def test_empty_row_hand_computed():
    """Three rows, one empty; PPL, sequence means and χ²_seq over the two non-empty rows."""
    old = torch.tensor([[-1.0, -2.0, 0.0], [0.0, 0.0, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": "sequence", "rollout_is_threshold": 10.0})
    m = compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats()

    # row 0: log ρ = [0.5, -1.0] → Σ = -0.5, mean log π_old = -1.5, mean log π_rollout = -1.25
    # row 2: log ρ = [0.5]       → Σ =  0.5, mean log π_old = -0.5, mean log π_rollout = -1.0
    training_ppl = (math.exp(1.5) + math.exp(0.5)) / 2
    rollout_ppl = (math.exp(1.25) + math.exp(1.0)) / 2
    log_ppl_diff = ((-1.25 + 1.5) + (-1.0 + 0.5)) / 2
    chi2_seq = (math.exp(-1.0) + math.exp(1.0)) / 2 - 1
    seq_w = [math.exp(-0.5), math.exp(0.5)]
    seq_mean = sum(seq_w) / 2
    seq_std = abs(seq_w[0] - seq_w[1]) / math.sqrt(2)  # unbiased std of two values
    expected = {
        "training_ppl": training_ppl,
        "training_log_ppl": (1.5 + 0.5) / 2,
        "rollout_ppl": rollout_ppl,
        "rollout_log_ppl": (1.25 + 1.0) / 2,
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": (0.25 + 0.5) / 2,
        "log_ppl_diff_max": 0.25,
        "log_ppl_diff_min": -0.5,
        "ppl_ratio": (math.exp(0.25) + math.exp(-0.5)) / 2,
        "chi2_seq": chi2_seq,
        "chi2_token": (math.exp(1.0) + math.exp(-2.0) + math.exp(1.0)) / 3 - 1,
        "kl": ((-1.5 + 1.0) + (-1.0 + 2.0) + (-1.0 + 0.5)) / 3,
        "rollout_is_seq_mean": seq_mean,
        "rollout_is_seq_std": seq_std,
        "rollout_is_seq_max": seq_w[1],
        "rollout_is_seq_min": seq_w[0],
        "rollout_is_seq_max_deviation": max(abs(seq_w[0] - 1), abs(seq_w[1] - 1)),
        "rollout_is_mean": (2 * seq_w[0] + seq_w[1]) / 3,
        "rollout_is_max": seq_w[1],
        "rollout_is_min": seq_w[0],
    }
    got = {k[len(PREFIX):]: v for k, v in m.items()}
    assert_metrics_match(expected, got, rtol=1e-6, atol=1e-7, context="hand-computed")


# ----------------------------------------------------------------------------- difference (c): clamped k3 / PPL ratio


def _unprefixed(metrics):
    return {k[len(PREFIX):]: float(v) for k, v in metrics.items()}


def test_extreme_log_ratio_k3_and_ppl_ratio_stay_finite():
    """One token with log ρ = ±200: verl (fp32, as it runs in training) overflows, we clamp."""
    mask = torch.ones(2, 2)
    k3 = lambda x: math.expm1(x) - x  # noqa: E731

    old = torch.tensor([[-0.1, -0.2], [-1.0, -1.0]])
    rollout = torch.tensor([[-200.1, -0.2], [-1.0, -1.0]])  # log ρ = +200 at (0, 0)
    verl_metrics = VERL.compute_offpolicy_metrics(old, rollout, mask)
    assert math.isinf(verl_metrics["k3_kl"])
    ours = _unprefixed(compute_offpolicy_metrics(old, rollout, mask))
    assert ours["k3_kl"] == pytest.approx(k3(20.0) / 4, rel=1e-6)
    # per-row log-PPL difference d = mean log π_rollout − mean log π_old = [−100, 0]
    assert ours["ppl_ratio"] == pytest.approx((math.exp(-20.0) + 1.0) / 2, rel=1e-6)

    old, rollout = rollout, old  # log ρ = −200, d = [+100, 0]
    verl_metrics = VERL.compute_offpolicy_metrics(old, rollout, mask)
    assert math.isinf(verl_metrics["ppl_ratio"]) and math.isinf(verl_metrics["training_ppl"])
    ours = _unprefixed(compute_offpolicy_metrics(old, rollout, mask))
    assert ours["ppl_ratio"] == pytest.approx((math.exp(20.0) + 1.0) / 2, rel=1e-6)
    assert ours["k3_kl"] == pytest.approx(k3(-20.0) / 4, rel=1e-6)  # verl: k3(−200)/4 = 49.75
    assert verl_metrics["k3_kl"] == pytest.approx(k3(-200.0) / 4, rel=1e-6)
    # Training PPL: exp(100.1 + 0.2)/2 … accumulated in float64 instead of overflowing fp32.
    assert ours["training_ppl"] == pytest.approx((math.exp((200.1 + 0.2) / 2) + math.exp(1.0)) / 2, rel=1e-5)

    # Away from the clamp, verl's unclamped values and ours agree.
    old = torch.tensor([[-0.1, -0.2], [-1.0, -1.0]])
    rollout = torch.tensor([[-3.1, -0.2], [-1.0, -1.0]])  # log ρ = 3
    v = VERL.compute_offpolicy_metrics(old.double(), rollout.double(), mask)
    assert_metrics_match(v, _unprefixed(compute_offpolicy_metrics(old, rollout, mask)), context="moderate")


# ----------------------------------------------------------------------------- losses


def _actor_config(loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.28, clip_c=3.0, rc_config=None,
                  global_batch_info=None):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode="bypass_mode" if rc_config is not None else "vanilla",
                                   rollout_correction=rc_config if rc_config is not None else VerlConfig())
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                       clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                       loss_agg_mode=loss_agg_mode, policy_loss=policy_loss,
                       global_batch_info=global_batch_info or {})


AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _loss_inputs(seed, batch=6, length=9):
    old, rollout, mask = make_batch(batch, length, 0.3, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    log_prob = (old + 0.4 * torch.randn(batch, length, generator=gen)).clamp(max=-1e-3)
    adv = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    adv[0] = -adv[0].abs() - 1.0  # negative advantages with large ratios exercise the dual clip
    log_prob[0, :3] = (old[0, :3] + 2.0).clamp(max=-1e-3)  # large ratios, log-probs still ≤ 0
    return old, rollout, mask, log_prob, adv


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("use_global,dp_size", [(False, 1), (True, 1), (True, 4)])
def test_agg_loss_matches_verl(mode, use_global, dp_size):
    gen = torch.Generator().manual_seed(5)
    loss_mat = torch.randn(7, 11, generator=gen)
    _, _, mask = make_batch(7, 11, 0.1, 5)
    mask[3] = 0  # a fully rejected row
    kwargs = {}
    ours_kwargs = {}
    if use_global:
        kwargs = dict(dp_size=dp_size, batch_num_tokens=int(mask.sum()) * 3, global_batch_size=6 * 3)
        ours_kwargs = dict(global_num_tokens=int(mask.sum()) * 3, global_num_seqs=6 * 3, dp_size=dp_size)
    expected = VERL_ALGOS.agg_loss(loss_mat, mask, loss_agg_mode=mode, **kwargs)
    got = rc.agg_loss(loss_mat, mask, Aggregation(mode, **ours_kwargs))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_decoupled_ppo_loss_matches_verl_vanilla(mode, with_weights):
    old, rollout, mask, log_prob, adv = _loss_inputs(31)
    weights = None
    if with_weights:
        weights = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.decoupled_token_is()).weights

    lp_v = log_prob.clone().requires_grad_(True)
    v_loss, v_metrics = VERL_ALGOS.compute_policy_loss_vanilla(
        old, lp_v, adv, mask, loss_agg_mode=mode, config=_actor_config(mode), rollout_is_weights=weights)
    v_loss.backward()

    lp_o = log_prob.clone().requires_grad_(True)
    cfg = RolloutCorrectionConfig.decoupled_token_is() if with_weights else RolloutCorrectionConfig.disabled()
    o_loss, o_metrics = compute_policy_loss(
        lp_o, old, adv, mask, config=cfg, rollout_is_weights=weights,
        loss=PolicyLoss(clip=ClipRange(low=0.2, high=0.28, dual=3.0), aggregation=Aggregation(mode)))
    o_loss.backward()
    torch.testing.assert_close(o_loss.detach(), v_loss.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp_o.grad, lp_v.grad, rtol=1e-6, atol=1e-7)
    o_floats = {k: float(v) for k, v in o_metrics.items()}
    assert_metrics_match(v_metrics, o_floats, rtol=1e-6, atol=1e-7, context="ppo loss metrics")


BYPASS_PRESETS = [p for p in VERL_PRESETS if p.startswith("bypass_")]


def _bypass_inputs(seed, length=12):
    """Rows whose π_θ sits very close to π_rollout (accepted by the tight geometric band) and
    rows far from it (rejected; large ratios exercise clipping and the dual clip)."""
    scales = torch.tensor([3e-4, 0.5, 1e-3, 0.3, 5e-4, 0.2, 2e-3, 1.0])
    _, rollout, mask = make_batch(len(scales), length, 0.0, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    log_prob = (rollout + scales[:, None] * torch.randn(len(scales), length, generator=gen)).clamp(max=0.0)
    adv = torch.randn(len(scales), 1, generator=gen).expand(len(scales), length).contiguous()
    adv[1] = -adv[1].abs() - 1.0
    return rollout, mask, log_prob, adv


def _verl_bypass_config(preset):
    verl_cfg = getattr(VerlConfig, preset)()
    if verl_cfg.rollout_rs is None:
        return verl_cfg
    # k1 bounds spelled for verl's sign convention (difference (a)).
    fields = {f: getattr(verl_cfg, f) for f in RS_KEYS + ("bypass_mode", "loss_type")}
    fields["rollout_rs_threshold"] = verl_equivalent_rs_threshold(verl_cfg.rollout_rs, verl_cfg.rollout_rs_threshold)
    return VerlConfig(**fields)


@pytest.mark.parametrize("preset", BYPASS_PRESETS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_bypass_loss_matches_verl(preset, mode):
    rollout, mask, log_prob, adv = _bypass_inputs(41)
    lp_v = log_prob.double().requires_grad_(True)
    v_loss, v_metrics = VERL_ALGOS.compute_policy_loss_bypass_mode(
        rollout.double(), lp_v, adv.double(), mask, loss_agg_mode=mode,
        config=_actor_config(mode, rc_config=_verl_bypass_config(preset)))
    v_loss.backward()

    lp_o = log_prob.clone().requires_grad_(True)
    o_loss, o_metrics = compute_policy_loss(
        lp_o, rollout, adv, mask, config=RolloutCorrectionConfig.from_preset(preset),
        rollout_log_prob=rollout,
        loss=PolicyLoss(clip=ClipRange(low=0.2, high=0.28, dual=3.0), aggregation=Aggregation(mode)))
    o_loss.backward()
    assert 0 < float(mask.sum()), "inputs must keep some tokens"
    torch.testing.assert_close(o_loss.detach().double(), v_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_o.grad.double(), lp_v.grad, rtol=1e-5, atol=1e-6)
    o_floats = {k: float(v) for k, v in o_metrics.items()}
    assert_metrics_match(v_metrics, o_floats, context=f"bypass {preset}")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_bypass_loss_when_every_sequence_is_rejected(mode):
    """verl's loss is 0/0 = NaN when RS rejects everything; ours is exactly 0, zero gradient."""
    rollout, mask, log_prob, adv = _bypass_inputs(43)
    log_prob = log_prob + 0.5  # every row leaves the geometric band
    preset = "bypass_pg_geo_rs"
    lp_v = log_prob.clone().requires_grad_(True)
    v_loss, _ = VERL_ALGOS.compute_policy_loss_bypass_mode(
        rollout, lp_v, adv, mask, loss_agg_mode=mode, config=_actor_config(mode, rc_config=_verl_bypass_config(preset)))
    assert math.isnan(float(v_loss.detach()))
    lp_o = log_prob.clone().requires_grad_(True)
    o_loss, o_metrics = compute_policy_loss(
        lp_o, rollout, adv, mask, config=RolloutCorrectionConfig.from_preset(preset),
        rollout_log_prob=rollout, loss=PolicyLoss(aggregation=Aggregation(mode)))
    o_loss.backward()
    assert float(o_loss.detach()) == 0.0 and o_loss.requires_grad
    assert torch.equal(lp_o.grad, torch.zeros_like(lp_o))
    assert float(o_metrics[PREFIX + "rollout_rs_masked_fraction"]) == 1.0
