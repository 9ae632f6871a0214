"""Truncated sampling supports, shown with the demo's rollout engine.

The engine samples with top-k / top-p and reports the log-probs of the truncated distribution, as
inference engines do. The trainer's full-vocabulary log-probs then differ from them by the log of
the kept mass on every token — a ratio biased by log π(S) although the weights are identical —
while the trainer's log-probs renormalised over the engine's kept set match them exactly.
"""

import pytest
import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.supports import renormalized_log_probs

pytest.importorskip("transformers")
from rollout_correction.demo.engine import RolloutEngine  # noqa: E402
from rollout_correction.demo.model import build_model  # noqa: E402


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    engine = RolloutEngine(model, precision="fp32")  # same weights, same numerics as the trainer
    engine.sync(model)
    prompts = torch.randint(3, 12, (16, 5), generator=torch.Generator().manual_seed(1))
    kept: list[torch.Tensor] = []
    responses, rollout_lp = engine.generate(prompts, 8, generator=torch.Generator().manual_seed(2),
                                            top_k=6, top_p=0.8, kept=kept)
    tokens = torch.cat([prompts, responses], dim=1)
    with torch.no_grad():
        logits = model(tokens[:, :-1], use_cache=False).logits[:, prompts.shape[1] - 1:].float()
    return logits, responses, rollout_lp, torch.stack(kept, dim=1)


def test_raw_ratio_equals_the_kept_mass_and_renormalised_ratio_is_one(sampled):
    logits, responses, rollout_lp, kept = sampled
    full = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    log_kept_mass = torch.logsumexp(torch.log_softmax(logits, -1).masked_fill(~kept, -torch.inf), -1)
    # Same weights, yet the raw log-ratio is log π(S) < 0 on every truncated step.
    torch.testing.assert_close(full - rollout_lp, log_kept_mass, rtol=0, atol=2e-5)
    assert bool((log_kept_mass < -1e-3).float().mean() > 0.5)
    # Renormalised over the kept set (given exactly, or rebuilt from the settings): no gap.
    for kwargs in ({"kept_mask": kept}, {"top_k": 6, "top_p": 0.8, "order": "vllm"}):
        renorm = renormalized_log_probs(logits, responses, **kwargs)
        torch.testing.assert_close(renorm.log_prob, rollout_lp, rtol=0, atol=2e-5)


def test_truncation_bias_shows_as_mismatch_only_without_renormalisation(sampled):
    logits, responses, rollout_lp, kept = sampled
    mask = torch.ones_like(rollout_lp, dtype=torch.bool)
    full = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    renorm = renormalized_log_probs(logits, responses, kept_mask=kept).log_prob
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    raw = compute_rollout_correction(full, rollout_lp, mask, config=cfg).metrics_as_floats()
    fixed = compute_rollout_correction(renorm, rollout_lp, mask, config=cfg).metrics_as_floats()
    assert raw["rollout_corr/rollout_is_mean"] < 0.9  # every ratio is the kept mass, not 1
    assert abs(fixed["rollout_corr/rollout_is_mean"] - 1.0) < 1e-4
    assert abs(fixed["rollout_corr/kl"]) < 1e-5 < abs(raw["rollout_corr/kl"])
