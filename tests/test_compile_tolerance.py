"""``compute_rollout_correction(..., compile=True)`` equals the eager pass within the tolerance
docs/api.md states ("``compile=True`` against eager"): masks equal, weights within ``rtol=1e-6,
atol=1e-7``, every metric within ``rel=1e-5, abs=1e-6``.

The compiled pass evaluates the same formulas; inductor adds the float32 sums in another order, so
values differ by that rounding (about 1e-7 relative on these batches) and a mask could differ only
where a statistic lies within rounding of its threshold, which these batches never put it.

Each batch (6 rows of 9 tokens, one shape so that each config compiles once) holds padding with NaN
and ±inf in it, an empty row, rows dropped for a NaN and for an infinite log-ratio at a valid
position, and advantages. Each config
starts from a reset of dynamo (torch stops compiling a function after ``recompile_limit`` configs and
runs it eagerly; the check that frames were compiled keeps this test from comparing eager with eager).
The default run compares two representative configs; ``-m slow`` every distinct preset (about 40 s of
compilation each on one CPU core, less with inductor's on-disk cache warm).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from rollout_correction_core import RolloutCorrectionConfig, compute_rollout_correction

WEIGHT_RTOL, WEIGHT_ATOL = 1e-6, 1e-7
METRIC_REL, METRIC_ABS = 1e-5, 1e-6


def _batches(B: int = 6, T: int = 9) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for seed, spread in ((0, 0.3), (1, 1.0), (2, 0.05)):  # mild, strong (rejections, truncation), tiny mismatch
        g = torch.Generator().manual_seed(seed)
        rollout = -torch.rand(B, T, generator=g) * 3
        old = (rollout + torch.randn(B, T, generator=g) * spread).clamp(max=0.0)  # log-probs are ≤ 0
        mask = torch.rand(B, T, generator=g) > 0.25
        mask[1] = False                                         # an empty row, garbage in its padding
        old[1, :2] = float("nan")
        mask[2, -3:], old[2, -3:] = False, float("inf")         # right padding holding +inf
        mask[3, 0], old[3, 0] = True, float("nan")              # a NaN at a valid position: the row is dropped
        mask[4, 1], rollout[4, 1] = True, -float("inf")         # log ρ = +inf at a valid position: dropped too
        out.append((old, rollout, mask, torch.randn(B, T, generator=g)))
    return out


BATCHES = _batches()


def _distinct_presets() -> list[str]:
    """One name per distinct preset configuration (aliases of one config are compared once)."""
    seen: dict[RolloutCorrectionConfig, str] = {}
    for name in RolloutCorrectionConfig.preset_names():
        seen.setdefault(RolloutCorrectionConfig.from_preset(name), name)
    return list(seen.values())


def assert_within_tolerance(fast, eager) -> None:
    """``fast`` (compiled) against ``eager``: masks equal, weights and every metric within the tolerance."""
    assert torch.equal(fast.response_mask, eager.response_mask)
    assert (fast.weights is None) == (eager.weights is None)
    if eager.weights is not None:
        torch.testing.assert_close(fast.weights, eager.weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    got, expected = fast.metrics_as_floats(), eager.metrics_as_floats()
    assert got.keys() == expected.keys()
    off = {k: (got[k], v) for k, v in expected.items()
           if not abs(got[k] - v) <= METRIC_ABS + METRIC_REL * abs(v) or math.isnan(got[k]) != math.isnan(v)}
    assert not off, off


def assert_compiled_equals_eager(config: RolloutCorrectionConfig, batches=BATCHES) -> None:
    torch._dynamo.reset()
    compiled_frames = counters["frames"]["ok"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # presets that reject every row of a batch say so
        for old, rollout, mask, advantages in batches:
            assert_within_tolerance(
                compute_rollout_correction(old, rollout, mask, config=config, compile=True, advantages=advantages),
                compute_rollout_correction(old, rollout, mask, config=config, advantages=advantages))
    assert counters["frames"]["ok"] > compiled_frames, "nothing was compiled: the comparison would be eager vs eager"


def test_a_chain_with_batch_normalisation_and_the_veto():
    """Sequence IS with batch normalisation, sequence rejection and the veto: every part of the pass;
    then a batch of another shape (the compiled pass recompiles for it, dynamic in B and T)."""
    assert_compiled_equals_eager(RolloutCorrectionConfig.decoupled_seq_is_rs().replace(
        rollout_is_batch_normalize=True, rollout_token_veto_threshold=0.5), BATCHES + _batches(B=5, T=2)[:1])


FAST = ["decoupled_geo_rs_token_tis"]  # token TIS with the geometric (k1 band) rejection


@pytest.mark.parametrize("name", FAST)
def test_representative_preset(name):
    assert_compiled_equals_eager(RolloutCorrectionConfig.from_preset(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in _distinct_presets() if n not in FAST])
def test_every_preset(name):
    assert_compiled_equals_eager(RolloutCorrectionConfig.from_preset(name))


def test_the_comparison_sees_a_difference_beyond_the_tolerance():
    """Not vacuous: weights 1e-5 relative off, a metric 1e-4 relative off, or one mask bit flipped fail it."""
    old, rollout, mask, _ = BATCHES[0]
    eager = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig.decoupled_token_is())
    assert_within_tolerance(dataclasses.replace(eager, weights=eager.weights * (1 + 1e-7)), eager)
    flipped = eager.response_mask.clone()
    flipped[0, 0] = ~flipped[0, 0]
    name, value = next((k, v) for k, v in eager.metrics_as_floats().items() if abs(v) > 0.1)
    for off in (dataclasses.replace(eager, weights=eager.weights * (1 + 1e-5)),
                dataclasses.replace(eager, metrics={**eager.metrics, name: torch.tensor(value * (1 + 1e-4))}),
                dataclasses.replace(eager, response_mask=flipped)):
        with pytest.raises(AssertionError):
            assert_within_tolerance(off, eager)
