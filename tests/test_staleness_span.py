"""Maximum off-policy span (verl's ``max_off_policy_threshold`` with ``drop`` / ``wait``) and the
trajectory span metrics, by hand and against verl 0.9.1's replay buffer on random batches.

By hand, at step S = 10 with N = 8: trajectories dispatched at steps 10, 9, 2, 1 span 1, 2, 9, 10
versions; the first three finished. drop: the finished one spanning 9 > 8 goes (span 10 is still in
flight); wait: nothing goes, and the batch waits for the unfinished one (10 ≥ 8).
"""

from __future__ import annotations

import random

import pytest
import torch

from rollout_correction.staleness import max_off_policy_control, off_policy_span, trajectory_span_metrics

P = "rollout_corr/off_policy/"
START = torch.tensor([10, 9, 2, 1])
DONE = torch.tensor([True, True, True, False])


def test_drop_and_wait_by_hand():
    assert off_policy_span(10, START).tolist() == [1, 2, 9, 10]
    drop = max_off_policy_control(10, START, DONE, threshold=8, strategy="drop")
    assert drop.keep.tolist() == [True, True, False, True] and not bool(drop.wait)
    m = {k: float(v) for k, v in drop.metrics.items()}
    assert m[P + "dropped"] == 1 and m[P + "dropped_fraction"] == pytest.approx(1 / 3)
    assert m[P + "dropped_span_mean"] == m[P + "dropped_span_max"] == m[P + "dropped_span_min"] == 9
    assert m[P + "span_mean"] == pytest.approx((1 + 2 + 9) / 3) and m[P + "span_max"] == 9 and m[P + "wait"] == 0
    wait = max_off_policy_control(10, START, DONE, threshold=8, strategy="wait")
    assert wait.keep.all() and bool(wait.wait) and float(wait.metrics[P + "dropped"]) == 0
    # an unfinished trajectory from step 1 does not hold the batch at span 7 < 8; at exactly 8 it does
    # (≥), while drop needs > 8: a finished one from step 2 at step 9 (span 8) stays
    start, done = torch.tensor([2, 1]), torch.tensor([True, False])
    assert not bool(max_off_policy_control(7, start, done, threshold=8, strategy="wait").wait)
    assert bool(max_off_policy_control(8, start, done, threshold=8, strategy="wait").wait)
    assert max_off_policy_control(9, start, done, threshold=8).keep.all()
    assert not max_off_policy_control(10, start, done, threshold=8).keep[0]
    off = max_off_policy_control(10, START, DONE, threshold=None)
    assert off.keep.all() and not bool(off.wait) and float(off.metrics[P + "dropped_span_min"]) == 0


def test_trajectory_span_metrics_by_hand():
    # generated across [3, 5], [5, 5], [6, 7]; the trainer holds version 7
    m = {k: float(v) for k, v in trajectory_span_metrics(torch.tensor([3, 5, 6]), torch.tensor([5, 5, 7]), 7).items()}
    assert (m[P + "trajectory_span_mean"], m[P + "trajectory_span_max"], m[P + "trajectory_span_min"]) == (2.0, 3, 1)
    assert (m[P + "trajectory_staleness_mean"], m[P + "trajectory_staleness_max"],
            m[P + "trajectory_staleness_min"]) == (pytest.approx(4 / 3), 2, 0)
    assert (m[P + "trajectory_staleness_worst_mean"], m[P + "trajectory_staleness_worst_max"],
            m[P + "trajectory_staleness_worst_min"]) == (pytest.approx(7 / 3), 4, 1)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="after the current step"):
        off_policy_span(3, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="threshold"):
        max_off_policy_control(3, torch.tensor([1]), torch.tensor([True]), threshold=0)
    with pytest.raises(ValueError, match="strategy"):
        max_off_policy_control(3, torch.tensor([1]), torch.tensor([True]), strategy="hold")
    with pytest.raises(ValueError, match="one flag per trajectory"):
        max_off_policy_control(3, torch.tensor([1, 2]), torch.tensor([True]))
    with pytest.raises(TypeError, match="integer"):
        off_policy_span(3, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="newer than current_version"):
        trajectory_span_metrics(torch.tensor([1]), torch.tensor([5]), 4)


def test_equals_verls_replay_buffer_on_random_batches():
    """verl's ReplayBufferAsync decides on the prompts' dispatch steps: ``_stale_terminal_keys``
    (drop) and ``_has_enough_samples`` (wait); its own methods run on the same state."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    rng = random.Random(0)
    for trial in range(40):
        n, step = rng.randint(1, 12), rng.randint(1, 30)
        threshold = rng.randint(1, 10)
        start = [rng.randint(1, step) for _ in range(n)]
        done = [rng.random() < 0.7 for _ in range(n)]
        keys = [f"uid{i}" for i in range(n)]
        rb = ReplayBufferAsync.__new__(ReplayBufferAsync)  # its decision methods read these fields only
        rb.max_off_policy_threshold = threshold
        rb.prompt_global_steps = {"train": dict(zip(keys, start))}
        rb.finished_keys = {"train": {k for k, d in zip(keys, done) if d}}
        rb.pending_keys = {"train": set()}
        rb.running_keys = {"train": {k for k, d in zip(keys, done) if not d}}
        for strategy in ("drop", "wait"):
            rb.max_off_policy_strategy = strategy
            ours = max_off_policy_control(step, torch.tensor(start), torch.tensor(done), threshold, strategy)
            evicted = rb._stale_terminal_keys(step, "train")
            assert {k for k, keep in zip(keys, ours.keep.tolist()) if not keep} == evicted, (trial, strategy)
            sampleable = rb.finished_keys["train"] - evicted
            theirs_ready = rb._has_enough_samples(step, "train", len(sampleable), sampleable)
            assert theirs_ready == (not bool(ours.wait)), (trial, strategy)
