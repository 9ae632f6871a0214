"""Packed (flat, variable-length) inputs give exactly the padded-form results."""

import pytest
import torch

from rollout_correction_core import RolloutCorrectionConfig, Segments, compute_rollout_correction
from rollout_correction.packed import compute_rollout_correction_packed

LENGTHS = [3, 0, 2, 4]  # includes an empty sequence


def _flat(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    rollout = -torch.rand(n, generator=g) * 3
    old = rollout + torch.randn(n, generator=g) * 0.4
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
