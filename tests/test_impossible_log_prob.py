"""An impossible log-probability, finite and above 0 (a probability above 1), at a valid position on
either side is handled like a non-finite one (whose rule docs/reliability.md states): under the default
``on_nonfinite="reject"`` its row is dropped and counted, in ``rollout_corr/nonfinite_seq_fraction`` or,
when the loss drops it before the correction runs, in ``actor/nonfinite_seq_fraction`` (once, not in
both), and nothing anywhere is NaN; under ``on_nonfinite="raise"`` the call raises ValueError naming
the position.

"Dropped" is checked against the same batch with that row masked out: the loss, the gradient and
every other metric are those of the batch without the row.

The first case is the one tests/test_fuzz.py::test_fuzz_segments drew in a fresh clone's CI
(hypothesis 6.170.27, ``@reproduce_failure('6.170.27',
b'AXicc2R0ZHRkYHBk0GCAA6CIgCMDUJgRVQKJ7cgA1gSmHdmBDACyQgTm')``): a bypass-mode REINFORCE loss whose
π_θ and π_rollout are both 1e30 at a valid token (so their log-ratio is 0), with segment-geometric
IS and the Δp rejection options, where ``rollout_corr/rollout_rs_segment_mean_dp_mean`` came out NaN
(Δp = e^1e30 − e^1e30).
"""

from __future__ import annotations

import re

import pytest
import torch

from rollout_correction_core import RolloutCorrectionConfig, Segments, compute_policy_loss, compute_rollout_correction

#: The drawn configuration (bypass mode, REINFORCE): segment-geometric IS and three Δp criteria.
DRAWN = dict(rollout_is="segment_geometric", rollout_is_threshold=1.5,
             rollout_rs="segment_mean_dp,token_dp,seq_sum_dp", rollout_rs_threshold="-0.2_0.2,-0.5_0.5,-1_1",
             bypass_mode=True, loss_type="reinforce")
COUNTERS = ("rollout_corr/nonfinite_seq_fraction", "actor/nonfinite_seq_fraction")
AT = (0, 1)  # the impossible value's position: row 0, column 1 (every position of both rows is valid)


def _batch():
    """Two rows of three valid tokens, ordinary log-probs, π_θ close to π_rollout, two segments."""
    log_prob = torch.tensor([[-0.40, -1.10, -0.70], [-0.90, -0.20, -1.60]])
    rollout = torch.tensor([[-0.45, -1.00, -0.72], [-0.88, -0.25, -1.50]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    segments = Segments(torch.tensor([[0, 0, 1], [0, 1, 1]]))
    return log_prob, rollout, advantages, mask, segments


def _impossible(side: str, value: float):
    """The batch with ``value`` at AT in the first log-prob (π_θ for the loss, π_old for the
    correction: ``side="policy"``), in π_rollout (``"rollout"``) or in both."""
    policy, rollout, advantages, mask, segments = _batch()
    policy, rollout = policy.clone(), rollout.clone()
    if side in ("both", "policy"):
        policy[AT] = value
    if side in ("both", "rollout"):
        rollout[AT] = value
    return policy, rollout, advantages, mask, segments


VALUES = pytest.mark.parametrize("value", [1e30, 5.0], ids=["1e30", "5.0"])
SIDES = pytest.mark.parametrize("side", ["both", "policy", "rollout"])


def _floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _assert_all_finite(metrics: dict[str, float], *tensors: torch.Tensor) -> None:
    bad = {k: v for k, v in metrics.items() if v != v or v in (float("inf"), float("-inf"))}
    assert not bad, f"non-finite metrics: {bad}"
    for t in tensors:
        assert bool(torch.isfinite(t).all()), t


def _assert_dropped_and_counted(got: dict[str, float], without_row: dict[str, float]) -> None:
    """Every metric equals the batch's without the row, except the two counters, which count the
    one dropped row of two once between them."""
    assert got.keys() == without_row.keys()
    for k in got:
        if k not in COUNTERS:
            assert got[k] == pytest.approx(without_row[k], rel=1e-6, abs=1e-7), k
    assert all(without_row.get(k, 0.0) == 0.0 for k in COUNTERS)
    assert sum(got.get(k, 0.0) for k in COUNTERS) == pytest.approx(0.5), {k: got.get(k) for k in COUNTERS}


def _loss(log_prob, rollout, advantages, mask, segments, **config):
    cfg = RolloutCorrectionConfig(**{**DRAWN, **config})
    log_prob = log_prob.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(log_prob, None, advantages, mask, config=cfg, rollout_log_prob=rollout,
                                        segments=segments)
    loss.backward()
    return loss.detach(), log_prob.grad, _floats(metrics)


@VALUES
@SIDES
def test_bypass_loss_drops_and_counts_the_row(side, value):
    """π_θ (``log_prob``), π_rollout or both (the drawn case) impossible at one token of row 0."""
    log_prob, rollout, advantages, mask, segments = _impossible(side, value)
    loss, grad, metrics = _loss(log_prob, rollout, advantages, mask, segments)
    _assert_all_finite(metrics, loss, grad)

    without = mask.clone()
    without[0] = False
    ref_loss, ref_grad, ref_metrics = _loss(*_batch()[:3], without, segments)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert bool((grad[0] == 0).all())
    _assert_dropped_and_counted(metrics, ref_metrics)


@VALUES
@SIDES
def test_bypass_loss_raises_under_on_nonfinite_raise(side, value):
    with pytest.raises(ValueError) as exc:
        _loss(*_impossible(side, value), on_nonfinite="raise")
    assert re.search(r"row 0\b.*column 1\b", str(exc.value)), exc.value


@VALUES
@SIDES
def test_correction_drops_and_counts_the_row(side, value):
    """``compute_rollout_correction``: π_old, π_rollout or both impossible at one token of row 0."""
    old, rollout, _, mask, segments = _impossible(side, value)
    cfg = RolloutCorrectionConfig(**DRAWN)
    out = compute_rollout_correction(old, rollout, mask, config=cfg, segments=segments)
    metrics = _floats(out.metrics)
    _assert_all_finite(metrics, out.weights)
    assert not bool(out.response_mask[0].any()) and bool((out.weights[0] == 0).all())

    without = mask.clone()
    without[0] = False
    ref = compute_rollout_correction(*_batch()[:2], without, config=cfg, segments=segments)
    assert torch.equal(out.response_mask[1], ref.response_mask[1])
    torch.testing.assert_close(out.weights, ref.weights)
    _assert_dropped_and_counted(metrics, _floats(ref.metrics))


@VALUES
@SIDES
def test_correction_raises_under_on_nonfinite_raise(side, value):
    old, rollout, _, mask, segments = _impossible(side, value)
    cfg = RolloutCorrectionConfig(**{**DRAWN, "on_nonfinite": "raise"})
    with pytest.raises(ValueError) as exc:
        compute_rollout_correction(old, rollout, mask, config=cfg, segments=segments)
    assert re.search(r"row 0\b.*column 1\b", str(exc.value)), exc.value
