"""Constants every layer of the core shares (defined once, imported everywhere else)."""

from __future__ import annotations

import warnings

__all__ = ["SAFETY_BOUND", "METRIC_PREFIX", "LOG_PROB_FLOOR"]

#: Log-space clamp applied before every ``exp``: weights, metrics and losses live in
#: [e^-20, e^20] ≈ [2e-9, 4.9e8], so no exponential overflows float32.
SAFETY_BOUND = 20.0

#: Prefix of every metric name (``rollout_corr/rollout_is_mean``, ``rollout_corr/kl``, …).
METRIC_PREFIX = "rollout_corr/"

#: A log-prob at or below this is an engine's sentinel (vLLM's −9999), not a log-prob: handled as
#: non-finite (``log_prob_floor``).
LOG_PROB_FLOOR = -1000.0


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """A ``DeprecationWarning`` that ``old`` goes in 0.4 and ``new`` replaces it, pointing at the code
    that used ``old`` (``stacklevel`` 3: the caller of the function that calls this one)."""
    warnings.warn(f"{old} is deprecated since 0.3 and will be removed in 0.4; use {new}", DeprecationWarning,
                  stacklevel=stacklevel)
