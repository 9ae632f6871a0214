"""The library's internals; the names here may change between releases (import from ``rollout_correction_core``)."""
