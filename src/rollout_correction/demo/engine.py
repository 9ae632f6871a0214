"""The demo's rollout engine; it lives in :mod:`rollout_correction.rollout_engine` (shared with
``diagnose --example``) and is re-exported here under the demo's name."""

from rollout_correction.rollout_engine import GRANULARITIES, PRECISIONS, QUANTS, RolloutEngine, fake_quantize, sample

__all__ = ["PRECISIONS", "QUANTS", "GRANULARITIES", "fake_quantize", "sample", "RolloutEngine"]
