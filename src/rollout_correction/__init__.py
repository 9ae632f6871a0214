"""rollout-correction, the toolkit: the correction core (``rollout_correction_core``, a
distribution of its own that depends on torch alone) and, beside it, the surfaces built on it —
the demonstration, ``diagnose``, the monitor, diffusion, and the engine adapters.

The names below are the core's public API, re-exported unchanged, and two conveniences of the
toolkit (``config_value``, ``compute_rollout_correction_packed``); an engine that wants only the
math depends on ``rollout-correction-core`` and imports ``rollout_correction_core`` (docs/api.md).
"""

from rollout_correction_core import *  # noqa: F401,F403 — the core's curated public names
from rollout_correction_core import __all__, __version__  # noqa: F401
# The entry points that accept the 0.2 keywords for one minor release, with a DeprecationWarning.
from ._compat import (CorrectionAccumulator, OffPolicyAccumulator, agg_loss, compute_offpolicy_metrics,  # noqa: F401,E402
                      compute_policy_loss, compute_rollout_correction, compute_rollout_correction_packed,
                      ppo_clip_loss)
from .settings import config_value  # noqa: E402

#: The core's names, and the conveniences the toolkit adds: reading a setting, packed inputs.
__all__ = __all__ + ["config_value", "compute_rollout_correction_packed"]
