"""The core's public seam ``rollout_correction_core.primitives``, under the toolkit's name (the same
objects; see that module for what it holds)."""

from rollout_correction_core.primitives import *  # noqa: F401,F403
from rollout_correction_core.primitives import __all__  # noqa: F401
