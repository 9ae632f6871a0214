"""On the CPU the eager pass reads facts about each block where a read costs nothing (the least and
largest log-prob of either side; the largest |log ρ|) and skips the work whose result they fix: counting
sentinels, sanitising, dropping rows, clamping to ±20. On a device and under
torch.compile it never reads a value and does that work arithmetically. Both must give the same
bits, whatever the input holds and where; and the blocks' statistics, joined and reduced once, must
give the bits of one block."""

import math

import pytest
import torch

import rollout_correction_core._src.correction as correction
import rollout_correction_core._src.logratio as logratio
from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

PRESET_NAMES = ["disabled", "decoupled_token_is", "decoupled_seq_is_rs", "decoupled_token_icepop", "geo_mis",
                "decoupled_k3_rs_token_tis", "seq_is_rs"]
ODD_VALUES = [math.nan, math.inf, -math.inf, -5000.0, -1000.0, -999.5, 1e31, -1e31, 3.0, -30.0, 1e-7]


def _batch(seed: int, dtype: torch.dtype):
    """A random batch with odd values (NaN, ±inf, sentinels at and below the floor, |x| ≥ 1e30, a
    positive log-prob) sprinkled over valid and masked positions of either input, empty rows, and
    rows without any odd value."""
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    old = -torch.rand(B, T, generator=g) * 3
    roll = (old + 0.2 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[int(torch.randint(0, B, (1,), generator=g))] = False
    for x in (old, roll):
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            b, t = int(torch.randint(0, B, (1,), generator=g)), int(torch.randint(0, T, (1,), generator=g))
            x[b, t] = ODD_VALUES[int(torch.randint(0, len(ODD_VALUES), (1,), generator=g))]
    return old.to(dtype), roll.to(dtype), mask


def _same_bits(got, expected) -> None:
    assert torch.equal(got.response_mask, expected.response_mask)
    if expected.weights is None:
        assert got.weights is None
    else:
        assert torch.equal(got.weights, expected.weights)
    a, b = expected.metrics_as_floats(), got.metrics_as_floats()
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == a[k] or (math.isnan(a[k]) and math.isnan(b[k])), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_shortcuts_give_the_bits_of_the_arithmetic_path(monkeypatch, name, dtype):
    cfg = RolloutCorrectionConfig.from_preset(name).replace(metrics="all")
    reads, extremes = [], []  # the largest |log ρ|; the (least, largest) log-prob of either side
    real = logratio._host_value

    def spy(x, read):
        value = real(x, read)  # (min, max) of log ρ, old, rollout
        if any(math.isnan(v) for v in value[:2]):
            reads.append(math.nan)
        else:
            reads.append(max(-value[0], value[1]))
        if not any(math.isnan(v) for v in value[2:]):
            extremes.append((min(value[2], value[4]), max(value[3], value[5])))
        return value

    for seed in range(40):
        old, roll, mask = _batch(seed, dtype)
        monkeypatch.setattr(logratio, "_host_value", spy)
        fast = compute_rollout_correction(old, roll, mask, config=cfg)
        monkeypatch.setattr(logratio, "_host_value", lambda x, read: None)  # as on a device
        arithmetic = compute_rollout_correction(old, roll, mask, config=cfg)
        _same_bits(fast, arithmetic)
    # both outcomes of every shortcut were exercised: a block with a sentinel and one without (the
    # smallest log-prob read), with a log-prob > 0 and without (the largest), and a largest |log ρ|
    # within ±20 (no clamp), beyond it, and NaN
    assert any(lo <= -1000 for lo, _ in extremes) and any(-1000 < lo < 0 for lo, _ in extremes)
    assert any(hi > 0 for _, hi in extremes) and any(hi <= 0 for _, hi in extremes)
    assert any(0 <= v <= 20 for v in reads) and any(20 < v < 1e30 for v in reads)
    assert any(math.isnan(v) for v in reads)


@pytest.mark.parametrize("odd", [math.nan, -math.inf])
def test_a_nonfinite_value_does_not_hide_a_sentinel(odd):
    """The sentinel shortcut reads the block's minima: a NaN (whose minimum is NaN) or a −inf
    (non-finite, not a sentinel) in one input must not hide a sentinel in the other."""
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.0, -5000.0, -1.0], [-1.0, -1.0, -1.0]])
    old[1, 0] = odd
    m = compute_rollout_correction(old, roll, torch.ones(2, 3), config={"metrics": "all"}).metrics_as_floats()
    assert m["rollout_corr/sentinel_token_fraction"] == pytest.approx(1 / 6)
    assert m["rollout_corr/nonfinite_seq_fraction"] == 1.0  # row 0 (sentinel) and row 1 (odd) dropped


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("block_tokens", [1, 14, 20, 33])
def test_blocks_give_the_bits_of_one_block(monkeypatch, name, block_tokens):
    cfg = RolloutCorrectionConfig.from_preset(name).replace(metrics="all")
    for seed in range(5):
        old, roll, mask = _batch(100 + seed, torch.float32)
        whole = compute_rollout_correction(old, roll, mask, config=cfg)
        monkeypatch.setattr(correction, "BLOCK_TOKENS", block_tokens)
        blocked = compute_rollout_correction(old, roll, mask, config=cfg)
        monkeypatch.undo()
        _same_bits(blocked, whole)

