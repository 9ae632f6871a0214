"""The words settings arrive in, and the named configurations: for adapters that read an engine's
own option names (verl's first-generation keys and ``"lo_hi"`` bands) and map them
onto :class:`~rollout_correction_core.RolloutCorrectionConfig`.

* Reading values — :func:`as_float`, :func:`read_threshold` (a number or a :class:`Band`),
  :func:`threshold_parts`, :func:`as_text`; :func:`invalid` builds the :class:`ConfigError` that
  names the key and what is allowed.
* Engines' keys — :data:`FIRST_GENERATION_KEYS` and :data:`LEGACY_RS` (verl's older names),
  :func:`canonical` (a settings dict in the current names); SkyRL's keys are read by
  ``rollout_correction.compat.skyrl`` (the toolkit).
* Presets — :data:`PRESETS` (name → :class:`Preset`), :func:`preset`; ``Presets`` and ``Loading``
  are the mixins ``RolloutCorrectionConfig`` is built from.
* Metric families — :data:`METRIC_FAMILIES`, :data:`DEFAULT_FAMILIES`, :func:`select_families`
  (the names of the config's ``metrics`` key).

Provisional (docs/api.md): a minor release may change these names without a deprecation release.
"""

from ._src.config import DEFAULT_FAMILIES, METRIC_FAMILIES, select_families
from ._src.config_io import Loading
from ._src.presets import PRESETS, Preset, Presets, preset
from ._src.vocab import (FIRST_GENERATION_KEYS, LEGACY_RS, Band, ConfigError, MissingSettingError, as_float,
                         as_text, canonical, invalid, read_threshold, threshold_parts)

__all__ = [
    "ConfigError", "MissingSettingError", "Band", "invalid", "as_float", "read_threshold", "threshold_parts", "as_text",
    "FIRST_GENERATION_KEYS", "LEGACY_RS", "canonical",
    "Loading", "Presets", "Preset", "PRESETS", "preset", "METRIC_FAMILIES", "DEFAULT_FAMILIES", "select_families",
]
