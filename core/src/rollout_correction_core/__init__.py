"""rollout-correction: keep LLM reinforcement learning correct when the tokens were sampled by a
different engine than the one computing gradients. The public surface is the names below: the
promise of docs/api.md (semantic versioning, a deprecation release before a name goes)."""

from ._src.alignment import MisalignmentWarning
from ._src.config import ConfigError, MissingSettingError, RolloutCorrectionConfig, as_config
from ._src.config_io import settings_dict
from ._src.constants import LOG_PROB_FLOOR, METRIC_PREFIX, SAFETY_BOUND
from ._src.correction import (CorrectionAccumulator, CorrectionOutput, MismatchError, MismatchWarning,
                              compute_rollout_correction)
from ._src.logratio import log_ratio
from ._src.losses import (LOSS_AGG_MODES, Aggregation, ClipRange, PolicyLoss, agg_loss, compute_policy_loss,
                          policy_loss_term, ppo_clip_loss)
from ._src.metrics import (ENGINE_METRIC_NAMES, OffPolicyAccumulator, compute_offpolicy_metrics, engine_metrics,
                           metrics_to_floats)
from ._src.parallel import Parallel
from ._src.rejection import rejection_mask
from ._src.segments import Segments, max_runs, segment_ids_from_mask
from ._src.stats import LayoutMismatchError
from ._src.validation import ShapeMismatchError
from ._src.weights import is_weights

#: The one source of the version: pyproject.toml reads it, CHANGELOG.md names it (docs/api.md).
__version__ = "0.3.0"

__all__ = [
    "RolloutCorrectionConfig",
    "ConfigError",
    "MissingSettingError",
    "ShapeMismatchError",
    "MismatchError",
    "MismatchWarning",
    "LayoutMismatchError",
    "MisalignmentWarning",
    "as_config",
    "settings_dict",
    "Parallel",
    "Segments",
    "compute_rollout_correction",
    "CorrectionOutput",
    "segment_ids_from_mask",
    "max_runs",
    "compute_offpolicy_metrics",
    "OffPolicyAccumulator",
    "CorrectionAccumulator",
    "compute_policy_loss",
    "PolicyLoss",
    "ClipRange",
    "Aggregation",
    # the functional pieces: pure functions of tensors
    "log_ratio",
    "is_weights",
    "rejection_mask",
    "policy_loss_term",
    "ppo_clip_loss",
    "agg_loss",
    "metrics_to_floats",
    "engine_metrics",
    "ENGINE_METRIC_NAMES",
    "LOSS_AGG_MODES",
    "SAFETY_BOUND",
    "METRIC_PREFIX",
    "LOG_PROB_FLOOR",
    "__version__",
]
