"""rollout-correction, the toolkit: the correction core (``rollout_correction_core``, a
distribution of its own that depends on torch alone) and, beside it, the surfaces built on it —
the demonstration, ``diagnose``, the monitor, diffusion, and the engine adapters.

The names below are the core's public API, re-exported unchanged; an engine that wants only the
math depends on ``rollout-correction-core`` and imports ``rollout_correction_core`` (docs/api.md).
"""

from rollout_correction_core import *  # noqa: F401,F403 — the core's curated public names
from rollout_correction_core import __all__, __version__  # noqa: F401
