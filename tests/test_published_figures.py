"""diagnose's thresholds against published figures (docs/metrics.md, "What normal looks like").

verl #7519 (DAPO, 32 steps) published ``rollout_corr/kl`` per rollout precision: bf16 0.0063 → 0.0089,
FP8 tensorwise 0.0100 → 0.0313 (χ²_token 0.025 → 0.319 and the Pearson correlation of p 0.986 → 0.874
over the same run), MXFP8 0.0095 → 0.0087. For each setting a log-prob dump is synthesised whose own
metrics, as the library computes them, match the figures (within 1 %), written in the toolkit's dump
format and diagnosed from the file:

* the bf16 run at its last figures passes every check that grades the mismatch itself (|kl|, k3 per
  token, χ²_token), as does MXFP8's, and prime-rl #3543's bf16 DeepSeek-V4-Flash run without router
  replay at its largest mismatch_kl (k3) 0.0011;
* the FP8-tensorwise run at its last figures is flagged (k3 per token above 0.01).

The dumps' other statistics (response lengths, the spread of p) are this test's choices, not the
runs': the checks of the importance weights at sequence level depend on the response length (a long
response makes ∏ρ_t degenerate at any of these gaps), so they are not what "normal" is judged by here.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
from rollout_correction.diagnose import diagnose_file
from rollout_correction.integrations.dump import write_step_dump

P = "rollout_corr/"
ROWS, LENGTH = 96, 256
#: The checks that grade the size of the mismatch (by name prefix, as diagnose's health table names them).
MISMATCH_CHECKS = ("|kl|", "k3 per token", "χ² token")
TAIL = 2.0  # log ρ of the heavy-tail tokens: tokens the rollout engine found unlikely, the trainer e² times likelier


def _dump(s: float, f: float, g: float, seed: int = 0):
    """(trainer, rollout) log-probs (ROWS, LENGTH): rollout probabilities p = 0.02 + 0.98·u^g of the bulk
    (the smaller g, the more of them near 1, as sampled tokens' are, and the lower the correlation of
    p the same gap gives), bulk log ρ = σz − σ²/2 − c with σ = s·(1 − p) (the engines agree more on the
    tokens the engine was sure of) and c making E[ρ] = 1 over all tokens; a share ``f`` of tokens
    with log ρ = TAIL at p = e^−TAIL (the trainer gives them probability 1)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)
    u = torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64)
    tail = torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) < f
    log_p = torch.log(0.02 + 0.98 * u.pow(g))  # rollout probabilities in (0.02, 1], the more near 1 the smaller g
    log_p = torch.where(tail, -TAIL, log_p)
    sigma = s * (1.0 - log_p.exp())
    shift = math.log((1.0 - f) / (1.0 - f * math.exp(TAIL)))  # the tail's mass comes from the bulk: E[ρ] = 1
    log_q = torch.where(tail, log_p + TAIL, (log_p + sigma * z - sigma * sigma / 2 - shift).clamp(max=0.0))
    return log_q.float(), log_p.float()


def _metrics(s, f, g):
    q, p = _dump(s, f, g)
    out = metrics_to_floats(compute_offpolicy_metrics(q, p, torch.ones_like(q), mismatch_metrics=True))
    return out[P + "kl"], out[P + "chi2_token"], out[P + "prob_pearson"]


def _bisect(fn, lo, hi, target, increasing, steps=30):
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (fn(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate(kl, chi2=None, pearson=None):
    """(s, f, g) whose dump has the given kl (and χ²_token, Pearson): one bisection per parameter,
    repeated until they settle (each mostly moves one metric: s the kl, f the χ², g the Pearson)."""
    s, f, g = 0.1, 0.0, 0.35
    for _ in range(1 if chi2 is None else 5):
        s = _bisect(lambda x: _metrics(x, f, g)[0], 0.0, 3.0, kl, True)
        if chi2 is not None:
            f = _bisect(lambda x: _metrics(s, x, g)[1], 0.0, 0.1, chi2, True)
        if pearson is not None:
            g = _bisect(lambda x: _metrics(s, f, x)[2], 0.02, 1.0, pearson, True)
    return s, f, g


#: setting -> (kl, χ²_token, Pearson, flagged), the figures of its last step (source: module docstring)
RUNS = {
    "verl #7519 bf16, last": (0.0089, None, None, False),
    "verl #7519 bf16, first": (0.0063, None, None, False),
    "verl #7519 MXFP8, first": (0.0095, None, None, False),
    "prime-rl #3543 bf16 without router replay, largest": (0.0011, None, None, False),
    "verl #7519 FP8 tensorwise, last": (0.0313, 0.319, 0.874, True),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_diagnose_grades_the_published_runs(run, tmp_path):
    kl, chi2, pearson, flagged = RUNS[run]
    q, p = _dump(*calibrate(kl, chi2, pearson))
    path = write_step_dump(str(tmp_path), 0, old_log_probs=q, rollout_log_probs=p,
                           response_mask=torch.ones_like(q, dtype=torch.bool),
                           response_lengths=torch.full((ROWS,), LENGTH))
    diag = diagnose_file(path, presets=[])
    got = diag.profile.metrics
    assert got[P + "kl"] == pytest.approx(kl, rel=0.01)  # the dump is the run's, as far as its figures go
    if chi2 is not None:
        assert got[P + "chi2_token"] == pytest.approx(chi2, rel=0.01)
        assert got[P + "prob_pearson"] == pytest.approx(pearson, rel=0.01)
    checks = {c.name: c for c in diag.health}
    graded = [c for name, c in checks.items() if name.startswith(MISMATCH_CHECKS)]
    assert len(graded) == len(MISMATCH_CHECKS)
    warned = [c.name for c in graded if c.verdict != "ok"]
    if flagged:
        assert any(name.startswith("k3 per token") for name in warned), warned
        assert diag.recommendation.case != "tiny"
    else:
        assert warned == [], warned
        assert diag.recommendation.case not in ("severe", "tiny")
