"""The core's public seam ``rollout_correction_core.vocabulary``, under the toolkit's name (the same
objects; see that module for what it holds).

``SKYRL_KEYS`` and ``from_skyrl`` moved to :mod:`rollout_correction.compat.skyrl` in 0.3.0; under their
former names here they still work, with a ``DeprecationWarning``, and are removed in 0.4."""

import warnings

from rollout_correction_core.vocabulary import *  # noqa: F401,F403
from rollout_correction_core.vocabulary import __all__  # noqa: F401

_MOVED_TO_SKYRL = ("SKYRL_KEYS", "from_skyrl")


def __getattr__(name: str):
    if name in _MOVED_TO_SKYRL:
        from .compat import skyrl  # on use only: the vocabulary does not depend on the SkyRL adapter

        warnings.warn(f"rollout_correction.vocabulary.{name} is deprecated since 0.3 and will be removed in 0.4; "
                      f"use rollout_correction.compat.skyrl.{name}", DeprecationWarning, stacklevel=2)
        return getattr(skyrl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
