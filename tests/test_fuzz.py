"""Property-based fuzzing of the public API (hypothesis).

Random shapes (B = 0, T = 1, all-masked rows and batches), extreme and non-finite values at
valid and at masked positions, float16 / bfloat16 / float32 / float64 inputs, every preset and
random configuration dictionaries. The properties:

* no NaN / ±inf in weights, masks, metrics, losses or gradients;
* the only exceptions are ValueError / TypeError (ConfigError is a ValueError), and with
  ``on_nonfinite="raise"`` a non-finite value at a valid position always raises;
* values at masked positions, and rows dropped for non-finite input, never reach the loss:
  their gradient is exactly 0;
* rejection only removes tokens: the returned mask is a subset of the input mask, same dtype.

Two profiles: the default one (about 200 examples per property, derandomised, part of CI) and
``-m nightly`` (10,000 examples per property, random seeds).
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
import torch._dynamo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_correction import (LOSS_AGG_MODES, ConfigError, RolloutCorrectionConfig, compute_offpolicy_metrics,
                                compute_policy_loss, compute_rollout_correction, metrics_to_floats)
from rollout_correction.advantages import group_advantages
from rollout_correction.packed import compute_rollout_correction_packed
from rollout_correction_core._src.alignment import alignment_metrics, alignment_statistics
from rollout_correction.staleness import compute_staleness_policy_loss
from rollout_correction.supports import renormalized_log_probs
from rollout_correction import Aggregation, PolicyLoss, Segments

try:  # log-ratios of magnitude ≥ this are treated as non-finite by the core
    from rollout_correction_core._src.logratio import NONFINITE_SENTINEL
except ImportError:
    NONFINITE_SENTINEL = math.inf

torch.set_num_threads(1)

FAST = settings(max_examples=200, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Random seeds (the suite's profile derandomizes: conftest.py), no example database.
NIGHTLY = settings(max_examples=10_000, deadline=None, print_blob=True, derandomize=False, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PRESETS = RolloutCorrectionConfig.preset_names()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
MASK_DTYPES = [torch.bool, torch.int64, torch.int32, torch.float32]
NONFINITE = [math.nan, math.inf, -math.inf]
# Log-probabilities: the ordinary range, the edges of every float format, impossible positive
# values and huge magnitudes (they overflow when cast to float16 / bfloat16); engine sentinels (−9999,
# the default floor −1000) and a value just above the floor.
LOGP_SPECIAL = [0.0, -0.0, -1e-12, -1e-3, 1e-3, 3.0, -20.0, -20.5, -88.7, -103.9, -999.0, -1000.0, -9999.0,
                -1e4, -6.5e4, -1e30, 1e30, -3e38, 1e-45, -1e-45]
ADV_SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e6, -1e6, 1e-3, -1e-3]
WEIGHT_SPECIAL = [0.0, 1e-30, 1.0, 2.0, 4.85e8, 1e-9]


def _elements(special, lo, hi, nonfinite):
    options = [st.floats(lo, hi, allow_nan=False, allow_infinity=False), st.sampled_from(special)]
    if nonfinite:
        options.append(st.sampled_from(NONFINITE))
    return st.one_of(*options)


@st.composite
def batches(draw, nonfinite=True):
    """(B, T) old / rollout log-probs and a response mask, with the layout chosen at random."""
    B = draw(st.integers(0, 5))
    T = draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(DTYPES))
    # Valid-position values: finite or not; masked positions: anything at all.
    elem = _elements(LOGP_SPECIAL, -30.0, 0.0, nonfinite)
    garbage = _elements(LOGP_SPECIAL, -1e38, 1e38, True)
    old = draw(hnp.arrays(np.float64, (B, T), elements=elem))
    close = draw(st.booleans())
    if close and B * T:  # a realistic near-on-policy rollout
        noise = draw(hnp.arrays(np.float64, (B, T), elements=st.floats(-0.05, 0.05)))
        roll = np.where(np.isfinite(old), old + noise, old)
    else:
        roll = draw(hnp.arrays(np.float64, (B, T), elements=elem))
    layout = draw(st.sampled_from(["random", "prefix", "all", "none"]))
    if layout == "random":
        mask = draw(hnp.arrays(np.bool_, (B, T)))
    elif layout == "prefix":
        lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        mask = np.arange(T)[None, :] < np.array(lengths, dtype=np.int64).reshape(B, 1)
    else:
        mask = np.full((B, T), layout == "all")
    pad_old = draw(hnp.arrays(np.float64, (B, T), elements=garbage))
    pad_roll = draw(hnp.arrays(np.float64, (B, T), elements=garbage))
    old = np.where(mask, old, pad_old)
    roll = np.where(mask, roll, pad_roll)
    mask_dtype = draw(st.sampled_from(MASK_DTYPES))
    with np.errstate(over="ignore"):
        o = torch.from_numpy(old).to(dtype)
        r = torch.from_numpy(roll).to(dtype)
    return o, r, torch.from_numpy(mask).to(mask_dtype)


@st.composite
def configs(draw):
    name = draw(st.sampled_from(PRESETS))
    cfg = RolloutCorrectionConfig.from_preset(name)
    if draw(st.booleans()):
        cfg = cfg.replace(rollout_is_batch_normalize=True) if cfg.rollout_is else cfg
    return cfg.replace(on_nonfinite=draw(st.sampled_from(["reject", "reject", "raise"])),
                       log_prob_floor=draw(st.sampled_from([-1000.0, -1000.0, None, -50.0])),
                       log_prob_ceiling=draw(st.sampled_from([0.0, 0.0, None])))


def _finite(name, t):
    assert isinstance(t, torch.Tensor), f"{name} is {type(t).__name__}, not a tensor"
    assert bool(torch.isfinite(t).all()), f"{name} has non-finite values: {t}"


#: Effective sample sizes, as fractions of the sample: in [0, 1] whatever the layout (miles #3230 logged 1.25).
ESS_METRICS = ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_seq_raw_ess")


def _check_metrics(metrics):
    for k, v in metrics.items():
        _finite(f"metric {k}", v)
    for k, v in metrics_to_floats(metrics).items():
        assert math.isfinite(v), f"metric {k} = {v}"
        assert k not in ESS_METRICS or 0.0 <= v <= 1.0, f"{k} = {v!r} outside [0, 1]"


def _nonfinite(x):
    """NaN/±inf, or a log-ratio so large the core documents it as non-finite (|log ρ| ≥ 1e30)."""
    return ~torch.isfinite(x) | (x.abs() >= NONFINITE_SENTINEL)


def _sentinel(x, floor):
    """Log-probs at or below ``floor``: an engine's sentinel, handled like a non-finite value."""
    return torch.zeros(x.shape, dtype=torch.bool) if floor is None else x <= floor


def _bad_rows(old, roll, mask, floor=-1000.0, ceiling=0.0):
    """Rows with a non-finite input (or an overflowing difference), a sentinel, or a log-prob above the
    ceiling (no probability) at a valid position."""
    bad = _nonfinite(old.float() - roll.float()) | _sentinel(old, floor) | _sentinel(roll, floor)
    if ceiling is not None:  # compared in the input's dtype, as the floor is (3e-230 in float64 is above 0)
        bad |= (old > ceiling) | (roll > ceiling)
    return ((mask != 0) & bad).any(-1)


def _correct_or_raise(old, roll, mask, cfg):
    """The correction, or None after checking that ``on_nonfinite="raise"`` raised as it must."""
    if cfg.on_nonfinite == "raise" and bool(_bad_rows(old, roll, mask, cfg.log_prob_floor, cfg.log_prob_ceiling).any()):
        with pytest.raises(ValueError, match="non-finite"):
            compute_rollout_correction(old, roll, mask, config=cfg)
        return None
    return compute_rollout_correction(old, roll, mask, config=cfg)


def check_correction(data):
    old, roll, mask = data.draw(batches())
    cfg = data.draw(configs())
    bad = _bad_rows(old, roll, mask, cfg.log_prob_floor, cfg.log_prob_ceiling)
    out = _correct_or_raise(old, roll, mask, cfg)
    if out is None:
        return
    m = out.response_mask
    assert m.shape == mask.shape and m.dtype == mask.dtype
    assert not bool(((m != 0) & (mask == 0)).any()), "rejection added tokens"
    assert not bool((m[bad] != 0).any()), "a row with non-finite input was kept"
    if cfg.rollout_is is None:
        assert out.weights is None
    else:
        w = out.weights
        _finite("weights", w)
        assert w.shape == mask.shape and not w.requires_grad
        assert bool((w >= 0).all()), "negative IS weight"
        assert bool((w[mask == 0] == 0).all()), "weight on padding"
        assert bool((w[bad] == 0).all()), "weight on a row dropped for non-finite input"
    _check_metrics(out.metrics)


def check_offpolicy_metrics(data):
    old, roll, mask = data.draw(batches())
    _check_metrics(compute_offpolicy_metrics(old, roll, mask))


def check_policy_loss(data):
    old, roll, mask = data.draw(batches())
    cfg = data.draw(configs())
    B, T = mask.shape
    dtype = old.dtype
    lp_np = data.draw(hnp.arrays(np.float64, (B, T), elements=_elements(LOGP_SPECIAL, -30.0, 0.0, True)))
    adv_np = data.draw(hnp.arrays(np.float64, (B, T), elements=_elements(ADV_SPECIAL, -10.0, 10.0, True)))
    with np.errstate(over="ignore"):
        log_prob = torch.from_numpy(lp_np).to(dtype).requires_grad_(True)
        adv = torch.from_numpy(adv_np).to(dtype)
    use_rollout = data.draw(st.booleans()) or cfg.bypass_mode
    weights = None
    if not cfg.bypass_mode and data.draw(st.booleans()):
        w_np = data.draw(hnp.arrays(np.float64, (B, T), elements=_elements(WEIGHT_SPECIAL, 0.0, 10.0, True)))
        weights = torch.from_numpy(w_np).to(dtype)
    agg = data.draw(st.sampled_from(LOSS_AGG_MODES))
    valid = mask != 0
    train = log_prob.detach().float()
    prox = roll if cfg.bypass_mode else old
    bad = valid & ~(torch.isfinite(train) & torch.isfinite(adv.float()) & torch.isfinite(prox.float()))
    if weights is not None:
        bad |= valid & ~torch.isfinite(weights.float())
    if use_rollout:  # engine sentinels in π_prox or π_rollout drop the row
        bad |= valid & (_sentinel(prox, cfg.log_prob_floor) | _sentinel(roll, cfg.log_prob_floor))
    if cfg.bypass_mode:  # the correction compares π_θ with π_rollout
        bad |= valid & (_nonfinite(train - roll.float()) | _sentinel(log_prob.detach(), cfg.log_prob_floor))
    elif use_rollout and weights is None:  # the correction compares π_old with π_rollout
        bad |= valid & _nonfinite(old.float() - roll.float())
    if cfg.log_prob_ceiling is not None:  # a log-prob above the ceiling is no probability: it drops its row
        bad |= valid & ((train > cfg.log_prob_ceiling) | (prox.float() > cfg.log_prob_ceiling))
        bad |= valid & (roll.float() > cfg.log_prob_ceiling) if use_rollout else False
    bad_rows = bad.any(-1)
    kwargs = dict(rollout_log_prob=roll if use_rollout else None, rollout_is_weights=weights,
                  loss=PolicyLoss(aggregation=Aggregation(agg)))
    asks = cfg.rollout_is or cfg.rs_enabled or cfg.rollout_m2po_threshold is not None or \
        cfg.expect_zero_atol is not None or cfg.check_alignment or cfg.mismatch_metrics
    if not cfg.bypass_mode and not use_rollout and weights is None and asks:
        with pytest.raises(ConfigError, match="got neither rollout_log_prob nor rollout_is_weights"):
            compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
        return  # a correction without its inputs is refused, never plain PPO
    if cfg.on_nonfinite == "raise" and bool(bad_rows.any()):
        with pytest.raises(ValueError, match="non-finite"):
            compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
        return
    loss, metrics = compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
    _finite("loss", loss)
    assert loss.dim() == 0 and loss.requires_grad, "the loss must stay attached to the graph"
    _check_metrics(metrics)
    loss.backward()
    grad = log_prob.grad
    assert grad is not None, "no gradient reached log_prob"
    _finite("gradient", grad)
    assert bool((grad[~valid] == 0).all()), "gradient at a masked position"
    assert bool((grad[bad_rows] == 0).all()), "gradient on a row dropped for non-finite input"
    if not bool((valid & ~bad_rows.unsqueeze(-1)).any()):
        assert loss.item() == 0.0, "nothing to learn from, yet the loss is not 0"


RANDOM_CONFIG_VALUES = {
    "rollout_is": [None, "token", "sequence", "geometric", "segment", "prefix_min", "segments", "tokens", 3, ""],
    "rollout_is_threshold": [None, 2.0, 1.0, 0.5, 0.0, -1.0, 1e30, math.inf, math.nan, "0.5_5.0", "5.0_0.5",
                             "2.0", "abc", "0_2", True],
    "rollout_is_threshold_lower": [None, 0.5, 0.0, -1.0, 3.0, math.nan, "0.2"],
    "rollout_is_mode": [None, "truncate", "clip", "mask", "cap"],
    "rollout_is_batch_normalize": [False, True, "yes", 1],
    "rollout_rs": [None, "token_k1", "seq_sum_k1", "seq_mean_k3", "seq_max_k2", "token_k1,seq_max_k3",
                   "token", "sequence", "geometric", "token,sequence", "seq_max_k1", ",", 7,
                   "token_tv", "seq_max_binary_kl", "seq_mean_tv,token_k1", "token_binary_kl,seq_sum_k3", "seq_sum_tv",
                   "segment_sum_k1", "segment_mean_k3,token_k1", "segment_max_tv", "segment_max_k1", "segment_sum_tv",
                   "token_kpop", "seq_sum_kpop,token_k1", "seq_max_kpop", "segment_sum_kpop", "seq_logprob_error",
                   "seq_mean_kpop,seq_logprob_error", "token_logprob_error", "segment_logprob_error,segment_max_kpop"],
    "rollout_rs_threshold": [None, 2.0, 0.01, 1.5, 0.9, "0.5_2.0", "0.999_1.001", "2.0_0.5", 0.0, -1.0, math.inf,
                             math.nan, "0.5_2.0,0.01", "x"],
    "rollout_rs_threshold_lower": [None, 0.5, 0.0, 2.0, math.nan],
    "rollout_token_veto_threshold": [None, 1e-4, 0.0, -1.0, math.nan, math.inf, "1e-4"],
    "rollout_token_veto_threshold_high": [None, 100.0, 1.5, 0.0, -1.0, math.nan, math.inf, "50"],
    "bypass_mode": [False, True, "false"],
    "loss_type": ["ppo_clip", "reinforce", "pg"],
    "on_nonfinite": ["reject", "raise", "ignore"],
    "log_prob_floor": [-1000.0, None, -1.0, 0.0, 5.0, math.nan, "x"],
    "expect_zero_atol": [None, 1e-6, 0.0, 10.0, -1.0, math.nan],
}
# ROLL's criteria: the mean-per-segment level and the signed Δp bands (whose bounds may be negative).
RANDOM_CONFIG_VALUES["rollout_is"] += ["segment_geometric"]
RANDOM_CONFIG_VALUES["rollout_rs"] += ["token_dp", "seq_mean_dp,segment_sum_dp", "segment_mean_dp,token_k1", "seq_max_dp"]
RANDOM_CONFIG_VALUES["rollout_rs_threshold"] += ["-0.2_0.2", "0.2_-0.2", "-0.1_0.3,0.5_2.0", -0.2, "-inf_0"]


def check_random_config(data):
    d = {k: data.draw(st.sampled_from(v)) for k, v in RANDOM_CONFIG_VALUES.items() if data.draw(st.booleans())}
    try:
        cfg = RolloutCorrectionConfig.from_dict(d)
    except (ValueError, TypeError) as exc:
        assert str(exc), "an error without a message"
        return
    assert RolloutCorrectionConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    if cfg.expect_zero_atol is not None:  # a random batch exceeds any tolerance: warn, do not raise
        cfg = cfg.replace(expect_zero_action="warn")
    old, roll, mask = data.draw(batches(nonfinite=False))  # huge values can still overflow
    out = _correct_or_raise(old, roll, mask, cfg)
    if out is None:
        return
    if out.weights is not None:
        _finite("weights", out.weights)
    _check_metrics(out.metrics)


def check_group_advantages(data):
    old, _, mask = data.draw(batches())
    B = mask.shape[0]
    scores = torch.from_numpy(data.draw(hnp.arrays(np.float64, (B,), elements=_elements(
        [0.0, 1.0, -1.0, 1e30, -1e30, 3e38], -5.0, 5.0, True)))).to(old.dtype)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B)), dtype=torch.long)
    out = group_advantages(scores, ids, estimator=data.draw(st.sampled_from(["grpo", "rloo"])),
                           response_mask=mask, norm_by_std=data.draw(st.booleans()))
    _finite("advantages", out.advantages)
    _finite("token advantages", out.token_advantages)
    assert bool((out.advantages[~out.accepted] == 0).all())
    _check_metrics(out.metrics)


def check_alignment_statistics(data):
    old, roll, mask = data.draw(batches())
    _check_metrics(alignment_metrics(alignment_statistics(old, roll, mask)))


def check_staleness_loss(data):
    old, roll, mask = data.draw(batches())
    B, T = mask.shape
    cfg = data.draw(configs())
    if cfg.bypass_mode:
        cfg = cfg.replace(bypass_mode=False, loss_type="ppo_clip")
    per_token = data.draw(st.booleans())
    shape = (B, T) if per_token else (B,)
    versions = torch.from_numpy(data.draw(hnp.arrays(np.int64, shape, elements=st.integers(0, 6))))
    log_prob = old.clone().requires_grad_(True)
    adv = torch.from_numpy(data.draw(hnp.arrays(np.float64, (B, T), elements=st.floats(-5, 5)))).to(old.dtype)
    kwargs = dict(proximal_method=data.draw(st.sampled_from(["loglinear", "linear", "behaviour"])),
                  max_staleness=data.draw(st.sampled_from([None, 0, 2])))
    try:
        loss, metrics = compute_staleness_policy_loss(log_prob, roll, adv, mask, versions, 6, cfg, **kwargs)
    except ValueError as exc:
        assert cfg.on_nonfinite == "raise" and "non-finite" in str(exc), exc
        return
    _finite("loss", loss)
    _check_metrics(metrics)
    loss.backward()
    _finite("gradient", log_prob.grad)
    assert bool((log_prob.grad[mask == 0] == 0).all()), "gradient at a masked position"


def check_supports(data):
    B, T, V = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9))
    dtype = data.draw(st.sampled_from(DTYPES))
    logit = st.one_of(st.floats(-20, 20), st.sampled_from([0.0, -1e4, 1e4, -math.inf, math.inf, math.nan]))
    with np.errstate(over="ignore"):
        logits = torch.from_numpy(data.draw(hnp.arrays(np.float64, (B, T, V), elements=logit))).to(dtype)
    tokens = torch.from_numpy(data.draw(hnp.arrays(np.int64, (B, T), elements=st.integers(0, V - 1))))
    mask = torch.from_numpy(data.draw(hnp.arrays(np.bool_, (B, T))))
    settings_ = dict(temperature=data.draw(st.sampled_from([1.0, 0.7, 1e-3, 5.0])),
                     top_k=data.draw(st.sampled_from([None, -1, 1, 2, 5, 100])),
                     top_p=data.draw(st.sampled_from([None, 1.0, 0.9, 0.5, 1e-6])),
                     min_p=data.draw(st.sampled_from([None, 0.0, 0.05, 0.5, 1.0])),
                     order=data.draw(st.sampled_from(["vllm", "hf", "sglang"])))
    if data.draw(st.booleans()):
        kept = torch.from_numpy(data.draw(hnp.arrays(np.bool_, (B, T, V))))
        settings_ = dict(kept_mask=kept, temperature=settings_["temperature"])
    out = renormalized_log_probs(logits, tokens, response_mask=mask, **settings_)
    z = logits.float()
    broken = (torch.isnan(z) | (z == math.inf)).any(-1) | (z == -math.inf).all(-1)
    y_logit = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    impossible = ~broken & (y_logit == -math.inf)
    fine = mask & ~broken & ~impossible
    for name, x in (("log_prob", out.log_prob), ("full_log_prob", out.full_log_prob)):
        _finite(name, x[fine])
        assert bool((x[fine] <= 1e-5).all()), f"{name} above 0"
        assert bool((x[mask & impossible] == -math.inf).all())
        assert bool(torch.isnan(x[mask & broken]).all())
        assert bool((x[~mask] == 0).all())
    assert bool((out.log_prob[fine] >= out.full_log_prob[fine] - 1e-5).all()), "renormalising lowered a log-prob"
    kept_mass = out.kept_log_mass[fine]
    assert bool((kept_mass <= 1e-5).all()) and not bool(torch.isnan(kept_mass).any())


SEGMENT_CONFIGS = [
    dict(rollout_is="segment", rollout_is_threshold=2.0),
    dict(rollout_is="segment", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
    dict(rollout_is="segment", rollout_is_threshold=3.0, rollout_is_mode="clip", rollout_is_threshold_lower=0.3),
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="segment_sum_k1,segment_max_k3",
         rollout_rs_threshold=("0.5_2.0", 0.1)),
    dict(rollout_is="segment", rollout_is_threshold=2.0, rollout_rs="segment_mean_tv,seq_max_k2,token_k3",
         rollout_rs_threshold=(0.2, 0.5, 1.0), bypass_mode=True, loss_type="reinforce"),
    dict(rollout_rs="segment_mean_binary_kl,segment_mean_k1", rollout_rs_threshold=(0.05, "0.9_1.1")),
    dict(rollout_rs="segment_max_kpop,segment_logprob_error,seq_mean_kpop", rollout_rs_threshold=(0.1, 1.5, 0.5)),
]
SEGMENT_CONFIGS += [
    dict(rollout_is="segment_geometric", rollout_is_threshold=1.5, rollout_rs="segment_mean_dp,token_dp,seq_sum_dp",
         rollout_rs_threshold="-0.2_0.2,-0.5_0.5,-1_1", bypass_mode=True, loss_type="reinforce"),
    dict(rollout_is="segment_geometric", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
         rollout_rs="segment_sum_dp,seq_mean_dp", rollout_rs_threshold="-0.3_0.1,-0.05_0.05"),
]


def check_segments(data):
    """Segment IS and segment options on random batches and segment ids (anything at masked
    positions): the core guarantees, or a clear error for an id outside [0, S) at a valid position."""
    old, roll, mask = data.draw(batches())
    B, T = mask.shape
    S = data.draw(st.sampled_from([None, 1, 2, 5]))
    top = T if S is None else S
    ids = torch.from_numpy(data.draw(hnp.arrays(np.int64, (B, T), elements=st.integers(0, top - 1))))
    garbage = torch.from_numpy(data.draw(hnp.arrays(np.int64, (B, T), elements=st.integers(-2**62, 2**62))))
    ids = torch.where(mask != 0, ids, garbage).to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.int16])))
    if ids.dtype != torch.int64:
        ids = torch.where(mask != 0, ids, 0)  # (the garbage does not fit a narrower type)
    cfg = RolloutCorrectionConfig.from_dict(data.draw(st.sampled_from(SEGMENT_CONFIGS)))
    cfg = cfg.replace(on_nonfinite=data.draw(st.sampled_from(["reject", "raise"])))
    kw = dict(segments=Segments(ids, count=S))
    if B * T and (mask != 0).any() and data.draw(st.booleans()):  # one bad id at a valid position
        b, t = (mask != 0).nonzero()[data.draw(st.integers(0, int((mask != 0).sum()) - 1))].tolist()
        bad_ids = ids.clone()
        bad_ids[b, t] = data.draw(st.sampled_from([-1, top, top + 7]))
        with pytest.raises(ValueError, match="segment id"):
            compute_rollout_correction(old, roll, mask, config=cfg, segments=Segments(bad_ids, count=S))
    bad = _bad_rows(old, roll, mask, cfg.log_prob_floor, cfg.log_prob_ceiling)
    if cfg.on_nonfinite == "raise" and bool(bad.any()):
        with pytest.raises(ValueError, match="non-finite"):
            compute_rollout_correction(old, roll, mask, config=cfg, **kw)
        return
    out = compute_rollout_correction(old, roll, mask, config=cfg, **kw)
    m = out.response_mask
    assert m.shape == mask.shape and m.dtype == mask.dtype
    assert not bool(((m != 0) & (mask == 0)).any()), "rejection added tokens"
    assert not bool((m[bad] != 0).any()), "a row with non-finite input was kept"
    if out.weights is not None:
        _finite("weights", out.weights)
        assert bool((out.weights >= 0).all()) and bool((out.weights[mask == 0] == 0).all())
        assert bool((out.weights[bad] == 0).all())
    _check_metrics(out.metrics)
    if not cfg.bypass_mode:
        return
    log_prob = roll.clone().float().nan_to_num(0.0).requires_grad_(True)
    adv = torch.ones(B, T)
    bad_loss = _bad_rows(log_prob.detach(), roll, mask, cfg.log_prob_floor, cfg.log_prob_ceiling)
    if cfg.on_nonfinite == "raise" and bool(bad_loss.any()):
        return
    loss, metrics = compute_policy_loss(log_prob, None, adv, mask, config=cfg, rollout_log_prob=roll, **kw)
    _finite("loss", loss)
    _check_metrics(metrics)
    loss.backward()
    _finite("gradient", log_prob.grad)
    assert bool((log_prob.grad[mask == 0] == 0).all()), "gradient at a masked position"
    assert bool((log_prob.grad[bad_loss] == 0).all()), "gradient on a row dropped for non-finite input"


def check_packed(data):
    """Packed rows (flat tokens with per-sequence lengths, empty sequences included): the core
    guarantees, an ESS in [0, 1], and the metrics of the same rows padded."""
    old, roll, mask = data.draw(batches(nonfinite=False))
    B, T = mask.shape
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)), dtype=torch.int64)
    keep = torch.arange(T)[None, :] < lengths[:, None]
    cfg = data.draw(configs()).replace(on_nonfinite="reject")
    flat_mask = (mask != 0)[keep]
    out = compute_rollout_correction_packed(old[keep], roll[keep], config=cfg, lengths=lengths, response_mask=flat_mask)
    _check_metrics(out.metrics)
    padded = compute_rollout_correction(old, roll, (mask != 0) & keep, config=cfg)
    got, want = metrics_to_floats(out.metrics), metrics_to_floats(padded.metrics)
    assert got.keys() == want.keys()
    for k in ESS_METRICS:
        assert k not in got or got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k


PROPERTIES = {
    "packed": check_packed,
    "correction": check_correction,
    "offpolicy_metrics": check_offpolicy_metrics,
    "policy_loss": check_policy_loss,
    "random_config": check_random_config,
    "group_advantages": check_group_advantages,
    "alignment_statistics": check_alignment_statistics,
    "staleness_loss": check_staleness_loss,
    "supports": check_supports,
    "segments": check_segments,
}


def _fast(fn):
    return FAST(given(data=st.data())(fn))


def _nightly(fn):
    return pytest.mark.nightly(NIGHTLY(given(data=st.data())(fn)))


for _name, _check in PROPERTIES.items():  # test_fuzz_<name> (CI) and test_fuzz_<name>_nightly
    globals()[f"test_fuzz_{_name}"] = _fast(_check)
    globals()[f"test_fuzz_{_name}_nightly"] = _nightly(_check)


#: One configuration through every part of the compiled pass (token and sequence statistics, a
#: chain of three rejection options, the veto, batch normalisation, every metric family).
COMPILED = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                                   rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.2_5.0,0.05,2.0",
                                   rollout_token_veto_threshold=1e-3, metrics="all")


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=batches())
def test_compiled_pass_gives_the_eager_results_on_fuzzed_batches(batch):
    """compile=True on the fuzz suite's batches: the same mask, the weights within 1e-6 relative and
    the metrics within 1e-5 relative (1e-6 absolute), the compiled loops summing in another order.
    Every batch is padded to the strategy's largest shape (5, 7) with NaN at masked positions, its
    mask made bool and float16 / float64 read as float32, so that two graphs serve every example
    (float32 and bfloat16) instead of one per shape and dtype; both paths get the padded batch."""
    old, roll, mask = batch
    dtype = old.dtype if old.dtype in (torch.float32, torch.bfloat16) else torch.float32
    B, T = mask.shape
    pad = [torch.full((5, 7), math.nan, dtype=dtype) for _ in range(2)]
    full_mask = torch.zeros(5, 7, dtype=torch.bool)
    for x, y in zip(pad, (old, roll)):
        x[:B, :T] = y.to(dtype)
    full_mask[:B, :T] = mask != 0
    with torch._dynamo.config.patch(recompile_limit=64):  # never past the limit to the eager pass
        fast = compute_rollout_correction(*pad, full_mask, config=COMPILED, compile=True)
    eager = compute_rollout_correction(*pad, full_mask, config=COMPILED)
    assert torch.equal(fast.response_mask, eager.response_mask)
    torch.testing.assert_close(fast.weights, eager.weights, rtol=1e-6, atol=1e-7)
    assert fast.metrics_as_floats() == pytest.approx(eager.metrics_as_floats(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_on_degenerate_batches(name):
    """B = 0, T = 1, an all-masked batch and NaN padding, for every preset, end to end with backward."""
    cfg = RolloutCorrectionConfig.from_preset(name)
    cases = [torch.zeros(0, 4), torch.full((3, 1), -0.5), torch.full((2, 5), float("nan"))]
    masks = [torch.zeros(0, 4), torch.ones(3, 1), torch.zeros(2, 5)]
    for x, mask in zip(cases, masks):
        out = compute_rollout_correction(x, x.clone(), mask, config=cfg)
        _check_metrics(out.metrics)
        if out.weights is not None:
            _finite("weights", out.weights)
        lp = x.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(lp, x, torch.ones_like(x), mask, config=cfg, rollout_log_prob=x.clone())
        _finite("loss", loss)
        _check_metrics(metrics)
        loss.backward()
        _finite("gradient", lp.grad)
        if not bool(mask.any()):
            assert loss.item() == 0.0 and bool((lp.grad == 0).all())


# --- minimal inputs of failures the fuzz found (see docs/reliability.md) ---------------------------

def test_regression_sequence_is_min_is_safety_bounded():
    """Sequence-level ``rollout_is_min`` must be bounded like ``rollout_is_max`` (e^±20), never inf."""
    cfg = RolloutCorrectionConfig.from_preset("pure_is").replace(log_prob_floor=None)  # taken as log-probs
    mask = torch.tensor([[True]])
    for old in (0.0, -9979.0):  # log ρ = 10000 (exp overflows) and 21 (just past the bound)
        m = compute_rollout_correction(torch.tensor([[old]]), torch.tensor([[-10000.0]]), mask, config=cfg).metrics
        _check_metrics(m)
        assert m["rollout_corr/rollout_is_min"] <= m["rollout_corr/rollout_is_max"]


def test_regression_raise_on_huge_finite_log_ratio_is_a_value_error():
    cfg = RolloutCorrectionConfig.from_dict({"on_nonfinite": "raise", "rollout_is": "token"})
    old, roll, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[-0.1, -1e30]]), torch.tensor([[True, True]])
    if NONFINITE_SENTINEL > 1e30:  # the core treats 1e30 as finite: then no error at all
        _check_metrics(compute_rollout_correction(old, roll, mask, config=cfg).metrics)
    else:
        with pytest.raises(ValueError, match=r"row 0, column 1"):
            compute_rollout_correction(old, roll, mask, config=cfg)
