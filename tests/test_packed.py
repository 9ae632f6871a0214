"""Packed (flat, variable-length) inputs give exactly the padded-form results."""

import math

import pytest
import torch

from rollout_correction_core import RolloutCorrectionConfig, Segments, compute_rollout_correction
from rollout_correction.packed import compute_rollout_correction_packed

LENGTHS = [3, 0, 2, 4]  # includes an empty sequence


def _flat(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    rollout = -torch.rand(n, generator=g) * 3
    old = (rollout + torch.randn(n, generator=g) * 0.4).clamp(max=0.0)  # log-probs are ≤ 0
    valid = torch.ones(n, dtype=torch.bool)
    valid[4] = False  # one invalid token inside the third sequence
    return old, rollout, valid


def _padded(flat, fill=0.0):
    """Scatter by hand: row i holds its LENGTHS[i] tokens left-aligned."""
    out = torch.full((len(LENGTHS), max(LENGTHS)), fill, dtype=flat.dtype)
    start = 0
    for i, n in enumerate(LENGTHS):
        out[i, :n] = flat[start:start + n]
        start += n
    return out


CONFIGS = [
    RolloutCorrectionConfig.decoupled_token_is(),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                            rollout_rs="seq_mean_k1,token_k2", rollout_rs_threshold="0.7_1.4,0.3"),
    RolloutCorrectionConfig.geo_mis(rs_threshold=1.1, veto_threshold=0.5),
    RolloutCorrectionConfig.decoupled_token_icepop(threshold=1.5, threshold_lower=0.8),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("how", ["lengths", "cu_seqlens"])
def test_packed_equals_padded(cfg, how):
    old, rollout, valid = _flat()
    lengths = torch.tensor(LENGTHS)
    kw = {"lengths": lengths} if how == "lengths" else {"cu_seqlens": torch.tensor([0, 3, 3, 5, 9])}
    packed = compute_rollout_correction_packed(old, rollout, config=cfg, response_mask=valid, **kw)
    padded = compute_rollout_correction(_padded(old), _padded(rollout), _padded(valid, False), config=cfg)
    pad_mask = _padded(valid, False) | _padded(~valid, False)  # every real (non-padding) position
    if cfg.is_enabled:
        torch.testing.assert_close(packed.weights, padded.weights[pad_mask], rtol=0, atol=0)
    assert torch.equal(packed.response_mask, padded.response_mask[pad_mask])
    assert packed.response_mask.dtype == torch.bool
    assert packed.metrics_as_floats() == padded.metrics_as_floats()


def test_packed_without_mask_treats_every_token_as_valid():
    old, rollout, _ = _flat(1)
    cfg = RolloutCorrectionConfig.decoupled_seq_is_rs(rs_threshold="0.5_2.0")
    packed = compute_rollout_correction_packed(old, rollout, config=cfg, lengths=torch.tensor(LENGTHS))
    all_valid = _padded(torch.ones(9, dtype=torch.bool), False)
    padded = compute_rollout_correction(_padded(old), _padded(rollout), all_valid, config=cfg)
    assert packed.metrics_as_floats() == padded.metrics_as_floats()
    assert packed.weights.shape == (9,)


def test_packed_input_errors():
    old, rollout, valid = _flat()
    with pytest.raises(ValueError, match="exactly one of lengths= or cu_seqlens="):
        compute_rollout_correction_packed(old, rollout, lengths=torch.tensor(LENGTHS),
                                          cu_seqlens=torch.tensor([0, 3, 3, 5, 9]))
    with pytest.raises(ValueError, match="must start at 0, never decrease and end at the 9 tokens"):
        compute_rollout_correction_packed(old, rollout, lengths=torch.tensor([3, 1, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease"):
        compute_rollout_correction_packed(old, rollout, cu_seqlens=torch.tensor([0, 5, 3, 9]))
    with pytest.raises(ValueError, match="1-D"):
        compute_rollout_correction_packed(old.view(3, 3), rollout.view(3, 3), lengths=torch.tensor([3, 3, 3]))
    with pytest.raises(ValueError, match="response_mask has shape \\(8,\\); the packed inputs hold 9 tokens"):
        compute_rollout_correction_packed(old, rollout, lengths=torch.tensor(LENGTHS),
                                          response_mask=valid[:8])


def test_packed_inputs_equal_the_padded_form():
    gen = torch.Generator().manual_seed(13)
    lengths = torch.tensor([5, 0, 8, 3])
    N = int(lengths.sum())
    old = -torch.rand(N, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(N, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    ids = torch.randint(0, 3, (N,), generator=gen)
    cfg = RolloutCorrectionConfig(rollout_is="segment", rollout_is_threshold=1.4, rollout_rs="segment_mean_k3",
                                  rollout_rs_threshold=0.02)
    packed = compute_rollout_correction_packed(
        old, rollout, config=cfg, lengths=lengths, segments=Segments(ids))
    T = int(lengths.max())
    cols = torch.arange(T)
    mask = cols[None, :] < lengths[:, None]
    pad = lambda x: torch.zeros((4, T), dtype=x.dtype).masked_scatter(mask, x)  # noqa: E731
    padded = compute_rollout_correction(pad(old), pad(rollout), mask, config=cfg, segments=Segments(pad(ids)))
    torch.testing.assert_close(packed.weights, padded.weights[mask])
    assert torch.equal(packed.response_mask, padded.response_mask[mask])
    assert 0 < int(packed.response_mask.sum()) < N  # the option acts
    with pytest.raises(ValueError, match=r"Segments.ids has shape \(15,\); the packed inputs hold 16 tokens"):
        compute_rollout_correction_packed(
            old, rollout, config=cfg, lengths=lengths, segments=Segments(ids[:-1]))


# --------------------------------------------------------------- packed batches in the core, property
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rollout_correction_core import Aggregation, PolicyLoss, compute_policy_loss, metrics_to_floats  # noqa: E402

PRESETS = ["decoupled_token_is", "decoupled_seq_is_rs", "geo_mis", "decoupled_k3_rs_token_tis", "seq_is_rs",
           "decoupled_token_icepop", "ppo_is_bypass", "pure_is"]


def _scatter(flat, lengths, T, fill=0):
    """The padded (B, T) form of a packed (N,) tensor, written row by row."""
    out = torch.full((len(lengths), T), fill, dtype=flat.dtype)
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = flat[start:start + n]
        start += n
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       preset=st.sampled_from(PRESETS), mode=st.sampled_from(["token-mean", "seq-mean-token-mean",
                                                             "seq-mean-token-sum-norm"]),
       give_max=st.booleans())
def test_packed_batches_equal_their_padded_form(lengths, seed, preset, mode, give_max):
    """Weights, mask, every metric, the loss and its gradient of a packed batch are those of its padded
    form, for random lengths (empty sequences included), with and without ``max_seqlen``."""
    g = torch.Generator().manual_seed(seed)
    N, T = sum(lengths), max(lengths) + (2 if give_max else 0)
    rollout = -torch.rand(N, generator=g) * 3 - 0.01
    old = (rollout + 0.3 * torch.randn(N, generator=g)).clamp(max=0.0)
    lp = (old + 0.2 * torch.randn(N, generator=g)).clamp(max=0.0)
    adv = torch.randn(N, generator=g)
    mask = torch.rand(N, generator=g) > 0.15
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    seg = Segments(cu_seqlens=cu, max_seqlen=T if give_max else None)
    cfg = RolloutCorrectionConfig.from_preset(preset)
    packed = compute_rollout_correction(old, rollout, mask, config=cfg, segments=seg)
    padded = compute_rollout_correction(_scatter(old, lengths, T), _scatter(rollout, lengths, T),
                                        _scatter(mask, lengths, T, False), config=cfg)
    if padded.weights is None:
        assert packed.weights is None
    else:
        assert torch.equal(_scatter(packed.weights, lengths, T), padded.weights)
    assert torch.equal(_scatter(packed.response_mask, lengths, T, False), padded.response_mask)
    assert packed.metrics_as_floats() == padded.metrics_as_floats()
    loss = PolicyLoss(aggregation=Aggregation(mode))
    x = lp.clone().unsqueeze(0).requires_grad_(True)
    ours, m1 = compute_policy_loss(x, old.unsqueeze(0), adv.unsqueeze(0), mask.unsqueeze(0), config=cfg,
                                   rollout_log_prob=rollout.unsqueeze(0), loss=loss, segments=seg)
    y = _scatter(lp, lengths, T).requires_grad_(True)
    theirs, m2 = compute_policy_loss(y, _scatter(old, lengths, T), _scatter(adv, lengths, T),
                                     _scatter(mask, lengths, T, False), config=cfg,
                                     rollout_log_prob=_scatter(rollout, lengths, T), loss=loss)
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    assert torch.equal(_scatter(x.grad[0], lengths, T), y.grad)
    assert metrics_to_floats(m1) == metrics_to_floats(m2)


def test_a_packed_sequence_level_weight_is_per_sequence():
    """A sequence-level weight of a packed batch is one per packed sequence, never one for the pack."""
    old = torch.tensor([-1.0, -1.0, -2.0, -2.0, -2.0])
    rollout = torch.tensor([-1.5, -1.5, -2.0, -2.0, -2.0])  # sequence 0: ∏ρ = e^1; sequence 1: 1
    seg = Segments(cu_seqlens=torch.tensor([0, 2, 5]))
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=10.0)
    w = compute_rollout_correction(old, rollout, torch.ones(5, dtype=torch.bool), config=cfg, segments=seg).weights
    torch.testing.assert_close(w, torch.tensor([math.e, math.e, 1.0, 1.0, 1.0]))
    rs = RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    keep = compute_rollout_correction(old, rollout, torch.ones(5), config=rs, segments=seg).response_mask
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]  # e^1 > 2 rejects sequence 0 only


def test_packed_layout_errors_name_the_problem():
    old = -torch.rand(5)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, never decrease and end at the 5 tokens"):
        compute_rollout_correction(old, old, torch.ones(5), segments=Segments(cu_seqlens=torch.tensor([0, 2, 4])))
    with pytest.raises(ValueError, match=r"max_seqlen=2 is shorter than the longest sequence \(3 tokens\)"):
        compute_rollout_correction(old, old, torch.ones(5),
                                   segments=Segments(cu_seqlens=torch.tensor([0, 3, 5]), max_seqlen=2))
    with pytest.raises(ValueError, match=r"must be \(1, N\) or \(N,\), got \(5, 1\)"):
        compute_rollout_correction(old[:, None], old[:, None], torch.ones(5, 1),
                                   segments=Segments(cu_seqlens=torch.tensor([0, 5])))
    with pytest.raises(ValueError, match="1-D integer tensor of B \\+ 1 offsets"):
        compute_rollout_correction(old, old, torch.ones(5), segments=Segments(cu_seqlens=torch.tensor([0.0, 5.0])))
