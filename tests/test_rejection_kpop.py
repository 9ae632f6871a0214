"""KPop's symmetric binary KL and NeMo-RL's sequence log-prob error as rejection options.

Probabilities (π_train(y_t), π_rollout(y_t)) = (q, p) per token, with KL(a‖b) the Bernoulli KL
a log(a/b) + (1 − a) log((1 − a)/(1 − b)) worked out by hand:
    row 0: KL(p‖q) 0.0201, 1.0326, 0.0074   KL(q‖p) 0.0204, 0.7942, 0.0070   kpop 0.0204, 1.0326, 0.0074
           (sum 1.0603, mean 0.3534, max 1.0326)
    row 1: KL(p‖q) 0.0, 0.0207              KL(q‖p) 0.0, 0.0167              kpop 0.0, 0.0207
    row 2: KL(p‖q) 0.7777                   KL(q‖p) 0.3091                   kpop 0.7777
The first token is where the two directions disagree on the larger one: at a bound of 0.0202 the
one-directional binary KL keeps it and KPop rejects it.
"""

import math

import pytest
import torch

from rollout_correction import ConfigError, RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction import Segments

P = "rollout_corr/"
PROBS = [[(0.5, 0.4), (0.9, 0.3), (0.2, 0.25)], [(0.6, 0.6), (0.05, 0.1)], [(0.99, 0.7)]]
T = 4


def _kl(a, b):
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def _kpop(q, p):
    return max(_kl(p, q), _kl(q, p))


def _batch(rows, swap=False):
    """(old, rollout, mask) from rows of (q, p); a fourth, all-padding row holds garbage."""
    old, roll, mask = torch.zeros(len(rows) + 1, T), torch.zeros(len(rows) + 1, T), torch.zeros(len(rows) + 1, T,
                                                                                               dtype=torch.bool)
    for i, row in enumerate(rows):
        for t, (q, p) in enumerate(row):
            old[i, t], roll[i, t], mask[i, t] = math.log(q), math.log(p), True
    old[-1], roll[-1] = 3.0, float("nan")
    return (roll, old, mask) if swap else (old, roll, mask)


def _token_mask(keep):
    out = torch.zeros(len(keep) + 1, T)
    for i, row in enumerate(keep):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def _run(name, thr, swap=False, rows=PROBS):
    cfg = RolloutCorrectionConfig(rollout_rs=name, rollout_rs_threshold=thr)
    return compute_rollout_correction(*_batch(rows, swap), config=cfg)


def test_the_hand_computed_values():
    kpop = [[_kpop(q, p) for q, p in row] for row in PROBS]
    assert [[round(x, 4) for x in row] for row in kpop] == [[0.0204, 1.0326, 0.0074], [0.0, 0.0207], [0.7777]]
    assert _kl(0.4, 0.5) < 0.0202 < _kl(0.5, 0.4)  # π_rollout 0.4, π_train 0.5: the directions disagree


def test_token_kpop_rejects_where_either_direction_exceeds_the_bound():
    out = _run("token_kpop", 0.0202)
    assert torch.equal(out.response_mask, _token_mask([[0, 0, 1], [1, 0], [0]]))
    one_way = _run("token_binary_kl", 0.0202)  # KL(π_rollout ‖ π_train) alone keeps the first token
    assert torch.equal(one_way.response_mask, _token_mask([[1, 0, 1], [1, 0], [0]]))
    m = out.metrics_as_floats()
    kpop = [_kpop(q, p) for row in PROBS for q, p in row]
    assert m[P + "rollout_rs_token_kpop_mean"] == pytest.approx(sum(kpop) / 6, rel=1e-5)
    assert m[P + "rollout_rs_token_kpop_max"] == pytest.approx(max(kpop), rel=1e-5)
    assert m[P + "rollout_rs_token_kpop_min"] == pytest.approx(0.0, abs=1e-6)
    assert m[P + "rollout_rs_token_kpop_masked_fraction"] == pytest.approx(4 / 6)
    assert m[P + "rollout_rs_token_kpop_seq_masked_fraction"] == pytest.approx(1.0)
    assert m[P + "rollout_rs_masked_fraction"] == pytest.approx(4 / 6)


@pytest.mark.parametrize("name,thr,keep", [("seq_sum_kpop", 1.0, [0, 1, 1]), ("seq_mean_kpop", 0.5, [1, 1, 0]),
                                           ("seq_max_kpop", 0.8, [0, 1, 1])])
def test_sequence_kpop(name, thr, keep):
    agg = name.split("_")[1]
    stat = [{"sum": sum, "mean": lambda v: sum(v) / len(v), "max": max}[agg]([_kpop(q, p) for q, p in row])
            for row in PROBS]
    assert [int(s <= thr) for s in stat] == keep
    out = _run(name, thr)
    assert torch.equal(out.response_mask, _token_mask([[k] * len(r) for k, r in zip(keep, PROBS)]))
    m = out.metrics_as_floats()
    assert m[P + f"rollout_rs_{name}_seq_mean"] == pytest.approx(sum(stat) / 3, rel=1e-5)
    assert m[P + f"rollout_rs_{name}_seq_masked_fraction"] == pytest.approx(keep.count(0) / 3)


@pytest.mark.parametrize("name,thr", [("token_kpop", 0.0202), ("seq_mean_kpop", 0.5), ("seq_max_kpop", 0.5)])
def test_kpop_is_symmetric_in_the_two_policies(name, thr):
    a, b = _run(name, thr), _run(name, thr, swap=True)
    assert torch.equal(a.response_mask, b.response_mask)
    ma, mb = a.metrics_as_floats(), b.metrics_as_floats()
    assert ma[P + f"rollout_rs_{name}_mean"] == pytest.approx(mb[P + f"rollout_rs_{name}_mean"], rel=1e-6)
    # the one-directional gate is not: row 2 reads 0.7777 one way and 0.3091 the other
    one, other = _run("seq_max_binary_kl", 0.5), _run("seq_max_binary_kl", 0.5, swap=True)
    assert one.response_mask[2].sum() == 0 and other.response_mask[2].sum() == 1


def test_segment_kpop():
    # row 0: segment 0 = PROBS row 0, segment 1 = PROBS row 1; row 1: PROBS row 2 (segment 0)
    rows = [PROBS[0] + PROBS[1], PROBS[2]]
    old, roll, mask = torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.bool)
    for i, row in enumerate(rows):
        for t, (q, p) in enumerate(row):
            old[i, t], roll[i, t], mask[i, t] = math.log(q), math.log(p), True
    ids = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    for name, thr, expected in (("segment_mean_kpop", 0.5, [[1, 1, 1, 1, 1, 0], [0] * 6]),   # 0.3534, 0.0103 | 0.7777
                                ("segment_max_kpop", 0.5, [[0, 0, 0, 1, 1, 0], [0] * 6])):   # 1.0326, 0.0207 | 0.7777
        out = compute_rollout_correction(
            old, roll, mask,
            config=RolloutCorrectionConfig(
            rollout_rs=name, rollout_rs_threshold=thr),
            segments=Segments(ids))
        assert out.response_mask.tolist() == expected
        m = out.metrics_as_floats()
        assert m[P + f"rollout_rs_{name}_seq_masked_fraction"] == pytest.approx((1 if "mean" in name else 2) / 3)


# ---------------------------------------------------------------------------- sequence log-prob error
# log ρ_t per row: mean exp(|log ρ_t|) by hand
#   row 0: 0.1, −0.5, 0.0  → (1.105171 + 1.648721 + 1)/3 = 1.251297
#   row 1: 0.7             → 2.013753
#   row 2: −0.05, 0.05     → 1.051271
LR = [[0.1, -0.5, 0.0], [0.7], [-0.05, 0.05]]
ERR = [1.251297, 2.013753, 1.051271]


def _lr_batch(rows):
    rollout = torch.full((len(rows) + 1, T), -1.5)
    old, mask = rollout.clone(), torch.zeros(len(rows) + 1, T, dtype=torch.bool)
    for i, row in enumerate(rows):
        for t, x in enumerate(row):
            old[i, t], mask[i, t] = rollout[i, t] + x, True
    old[-1] = 40.0  # padding far beyond any bound never counts
    return old, rollout, mask


@pytest.mark.parametrize("thr,keep", [(2.0, [1, 0, 1]), (1.25, [0, 0, 1]), (1.0, [0, 0, 0]), (2.1, [1, 1, 1])])
def test_seq_logprob_error(thr, keep):
    assert [sum(math.exp(abs(x)) for x in row) / len(row) for row in LR] == pytest.approx(ERR, abs=1e-6)
    out = compute_rollout_correction(*_lr_batch(LR), config=RolloutCorrectionConfig(
        rollout_rs="seq_logprob_error", rollout_rs_threshold=thr))
    assert torch.equal(out.response_mask, _token_mask([[k] * len(r) for k, r in zip(keep, LR)]))
    m = out.metrics_as_floats()
    q = P + "rollout_rs_seq_logprob_error_"
    assert m[q + "seq_masked_fraction"] == pytest.approx(keep.count(0) / 3)  # NeMo-RL's num_masked_seqs / rows
    assert m[q + "seq_mean"] == pytest.approx(sum(ERR) / 3, rel=1e-5)   # its mean_seq_mult_prob_error
    assert m[q + "seq_max"] == pytest.approx(max(ERR), rel=1e-5)        # max_seq_mult_prob_error
    assert m[q + "seq_min"] == pytest.approx(min(ERR), rel=1e-5)        # min_seq_mult_prob_error


def test_segment_logprob_error():
    old, rollout, mask = _lr_batch([LR[0] + LR[1]])
    ids = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])
    out = compute_rollout_correction(
        old, rollout, mask,
        config=RolloutCorrectionConfig(
        rollout_rs="segment_logprob_error", rollout_rs_threshold=2.0),
        segments=Segments(ids))
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    m = out.metrics_as_floats()
    assert m[P + "rollout_rs_segment_logprob_error_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m[P + "rollout_rs_segment_logprob_error_seq_max"] == pytest.approx(ERR[1], rel=1e-5)


def test_logprob_error_bound_below_one_is_refused():
    with pytest.raises(ConfigError, match="≥ 1"):
        RolloutCorrectionConfig(rollout_rs="seq_logprob_error", rollout_rs_threshold=0.9)
    with pytest.raises(ConfigError, match="single upper bound"):
        RolloutCorrectionConfig(rollout_rs="token_kpop", rollout_rs_threshold="0.1_0.2")


def _nemo_rl_keep(prev, gen, token_mask, threshold):
    """NeMo-RL's ``compute_and_apply_seq_logprob_error_masking`` (nemo_rl/algorithms/grpo.py), re-derived:
    per sequence Σ exp(|gen − prev|·m)·m / max(Σm, 1), kept iff ≤ threshold (empty rows read 0)."""
    m = token_mask.float()
    err = (torch.abs(gen - prev) * m).exp() * m
    denom = m.sum(-1)
    seq = torch.where(denom > 0, err.sum(-1) / denom.clamp(min=1), 0.0)
    return seq <= threshold, seq


@pytest.mark.parametrize("seed", range(5))
def test_seq_logprob_error_matches_nemo_rl_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = 16, 24
    gen = -torch.rand(B, L, generator=g) * 4
    prev = (gen + torch.randn(B, L, generator=g) * (0.3 + seed * 0.2)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, L, generator=g) < 0.8
    mask[0] = False  # an empty row
    mask[1, 1:] = False  # a one-token row
    for thr in (1.1, 1.5, 2.0):
        keep, seq = _nemo_rl_keep(prev, gen, mask, thr)
        out = compute_rollout_correction(prev, gen, mask, config=RolloutCorrectionConfig(
            rollout_rs="seq_logprob_error", rollout_rs_threshold=thr))
        assert torch.equal(out.response_mask > 0, mask & keep.unsqueeze(-1)), thr
        m = out.metrics_as_floats()
        valid = mask.any(-1)
        assert m[P + "rollout_rs_seq_logprob_error_seq_masked_fraction"] == pytest.approx(
            float((~keep & valid).sum() / valid.sum()))
        assert m[P + "rollout_rs_seq_logprob_error_seq_mean"] == pytest.approx(float(seq[valid].mean()), rel=1e-5)
