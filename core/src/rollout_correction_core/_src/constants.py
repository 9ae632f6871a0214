"""Constants every layer of the core shares (defined once, imported everywhere else)."""

from __future__ import annotations

__all__ = ["SAFETY_BOUND", "METRIC_PREFIX", "LOG_PROB_FLOOR"]

#: Log-space clamp applied before every ``exp``: weights, metrics and losses live in
#: [e^-20, e^20] ≈ [2e-9, 4.9e8], so no exponential overflows float32.
SAFETY_BOUND = 20.0

#: Prefix of every metric name (``rollout_corr/rollout_is_mean``, ``rollout_corr/kl``, …).
METRIC_PREFIX = "rollout_corr/"

#: A log-prob at or below this is an engine's sentinel (vLLM's −9999), not a log-prob: handled as
#: non-finite (``log_prob_floor``).
LOG_PROB_FLOOR = -1000.0
