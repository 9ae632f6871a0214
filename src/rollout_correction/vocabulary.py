"""The core's public seam ``rollout_correction_core.vocabulary``, under the toolkit's name (the same
objects; see that module for what it holds)."""

from rollout_correction_core.vocabulary import *  # noqa: F401,F403
from rollout_correction_core.vocabulary import __all__  # noqa: F401
