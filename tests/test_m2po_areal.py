"""M2PO side by side with AReaL's own code (``areal==1.0.4``, the engine that ships it).

AReaL's M2PO is ``_apply_m2po_masking`` (with ``_get_m2po_loss_mask``) in
``areal/trainer/ppo/actor.py``, called from ``grpo_loss_fn`` with ``m2_threshold=`` on each
micro-batch: the second moment is (log π_behaviour − log π_proximal)², where AReaL's behaviour
log-probs (``input_data["logprobs"]``) are the rollout engine's and the proximal ones the recomputed
π_old — the same (log ρ)² as ours, since the square ignores the sign.

The two functions are compiled from the installed file's own source text: the rest of that module
imports AReaL's training service (HTTP clients, trackers, numba, …), which these two functions never
use. Nothing in them is changed.

Documented differences (docs/methods.md), each pinned by a test below: AReaL keeps the tokens whose
mean is strictly below τ and always at least one token; ours keeps a mean ≤ τ, keeps or masks equal
values together and keeps nothing when every value exceeds τ. Everywhere else the masks are equal.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

NAMES = ("_get_m2po_loss_mask", "_apply_m2po_masking")


def _load_areal_m2po() -> dict:
    spec = importlib.util.find_spec("areal")
    if spec is None:
        pytest.skip("areal is not installed; CI runs: pip install --no-deps areal==1.0.4")
    from importlib.metadata import version

    assert version("areal") == "1.0.4", "the comparison is written against areal 1.0.4"
    path = Path(spec.submodule_search_locations[0]) / "trainer" / "ppo" / "actor.py"
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in NAMES]
    assert sorted(f.name for f in functions) == sorted(NAMES), f"{path} no longer defines {NAMES}"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


AREAL = _load_areal_m2po()


def areal_mask(old_log_prob, rollout_log_prob, mask, tau):
    # grpo_loss_fn: _apply_m2po_masking(old_logp=behaviour (rollout), prox_logp=π_old, loss_mask, τ)
    return AREAL["_apply_m2po_masking"](rollout_log_prob, old_log_prob, mask.bool(), tau)


def our_mask(old_log_prob, rollout_log_prob, mask, tau):
    out = compute_rollout_correction(old_log_prob, rollout_log_prob, mask,
                                     config=RolloutCorrectionConfig(rollout_m2po_threshold=tau))
    return out.response_mask.bool()


def _batch(seed, rows, length, scale):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen) * 3.0 - 0.01
    rollout = (old + scale * torch.randn(rows, length, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return old, rollout, mask


CASES = [(seed, rows, length, scale, tau)
         for seed in range(6)
         for rows, length in ((4, 16), (32, 64), (128, 200))
         for scale, tau in ((0.1, 0.004), (0.3, 0.04), (0.3, 0.01), (1.0, 0.04), (1.0, 0.5))]


@pytest.mark.parametrize("seed,rows,length,scale,tau", CASES)
def test_masks_equal_areals_on_random_batches(seed, rows, length, scale, tau):
    old, rollout, mask = _batch(seed, rows, length, scale)
    m2 = (old - rollout)[mask.bool()] ** 2
    assert m2.min() < tau, "the case must keep some tokens (the all-above case is pinned separately)"
    theirs = areal_mask(old, rollout, mask, tau)
    ours = our_mask(old, rollout, mask, tau)
    assert torch.equal(ours, theirs), f"{int((ours != theirs).sum())} tokens differ"


def test_the_cases_mask_something_and_keep_something():
    masked = [int((our_mask(*_batch(s, r, t, sc), tau) == 0).sum() - (_batch(s, r, t, sc)[2] == 0).sum())
              for s, r, t, sc, tau in CASES]
    assert sum(m > 0 for m in masked) >= len(CASES) * 2 // 3  # the comparison is not between two no-ops


def _by_hand(values, tau):
    """One row whose (log ρ)² are ``values`` (squares of binary fractions, so exact in float32):
    rollout = old − sqrt(m)."""
    m = torch.tensor([values], dtype=torch.float32)
    old = torch.full_like(m, -1.0)
    return old, old - m.sqrt(), torch.ones_like(m), tau


def test_difference_mean_equal_to_tau_is_kept_by_us_masked_by_areal():
    # values 1.0 and 0.25: mean 0.625. With τ = 0.625 ours keeps both (mean ≤ τ); AReaL needs < τ
    # and masks the larger one.
    case = _by_hand([1.0, 0.25], 0.625)
    assert our_mask(*case).tolist() == [[True, True]]
    assert areal_mask(*case).tolist() == [[False, True]]


def test_difference_ties_are_kept_or_masked_together_by_us():
    # values 0.0625, 0.0625, 0: keeping all gives mean 0.0417 > τ = 0.04; keeping one 0.0625 and
    # the 0 gives 0.03125 < τ. AReaL's sort masks one of the two equal values; ours masks both.
    case = _by_hand([0.0625, 0.0625, 0.0], 0.04)
    assert our_mask(*case).tolist() == [[False, False, True]]
    assert areal_mask(*case).sum() == 2


def test_difference_every_value_above_tau():
    # AReaL keeps the smallest token (its loss needs one); ours keeps none, so the loss is exactly 0
    case = _by_hand([1.0, 0.25, 0.5625], 0.1)
    assert our_mask(*case).tolist() == [[False, False, False]]
    assert areal_mask(*case).tolist() == [[False, True, False]]


def test_areal_decides_per_micro_batch_ours_per_batch():
    # Split one batch in two micro-batches, as AReaL's loss sees it: each half gets its own cut,
    # while ours (batch-global) equals the whole-batch cut.
    old, rollout, mask = _batch(11, 16, 32, 0.3)
    tau = 0.04
    whole = areal_mask(old, rollout, mask, tau)
    halves = torch.cat([areal_mask(old[:8], rollout[:8], mask[:8], tau),
                        areal_mask(old[8:], rollout[8:], mask[8:], tau)])
    assert torch.equal(our_mask(old, rollout, mask, tau), whole)
    assert not torch.equal(halves, whole)
