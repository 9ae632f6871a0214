"""The core's public seam ``rollout_correction_core.primitives``, under the toolkit's name (the same
objects; see that module for what it holds), and the packed-input helpers of
:mod:`rollout_correction.packed`."""

from rollout_correction_core.primitives import *  # noqa: F401,F403
from rollout_correction_core.primitives import __all__

from .packed import lengths_from_cu_seqlens, pack_index, to_padded  # noqa: F401

__all__ = __all__ + ["lengths_from_cu_seqlens", "pack_index", "to_padded"]
