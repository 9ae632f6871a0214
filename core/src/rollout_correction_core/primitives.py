"""The building blocks a correction step is made of, for adapters that assemble their own.

``compute_rollout_correction`` and ``compute_policy_loss`` (package root) are the entry points
most code needs. The names here are the pieces they are built from, public so that an adapter
(an engine's drop-in, a custom hook, a diagnostics reader) can compose them without reaching into
the package's private modules; provisional (docs/api.md), a minor release may change them.

* **Log ratios** — :func:`log_ratio_batch` makes the one pass every estimator shares and returns a
  :class:`LogRatioBatch` (per-token log ρ, the valid mask, per-row sums :class:`RowSums`).
* **Importance weights** — :func:`importance_weights` (token / sequence / geometric / segment
  level, :class:`ISWeights`), :func:`bound_weights`, :func:`batch_norm_factor`, and their
  statistics :func:`add_is_statistics` / :func:`is_metrics`.
* **Rejection** — :func:`rejection_keep` (every criterion of ``rollout_rs`` plus the veto),
  :func:`option_keep` for one :class:`RSOption`, :func:`token_divergence`, and the metrics
  :func:`rs_metrics`, :func:`rs_option_metrics`, :func:`veto_metrics`. :data:`RS_OPTIONS` lists
  the criteria by name.
* **The correction pass** — :func:`correction_pass` (one rank's weights, masks and statistics,
  before any reduction), :func:`local_correction`, :func:`correction_metrics`.
* **Metrics** — the statistics behind ``compute_offpolicy_metrics``
  (:func:`add_offpolicy_statistics`, :func:`offpolicy_metrics`, :func:`mismatch_metrics`,
  :func:`nonfinite_metrics`, :func:`prefixed`, :class:`Accumulator`).
* **Sequence masks and policy-loss terms** — M2PO (:func:`m2po_keep`, :func:`second_moment`),
  OPSM (:func:`opsm_keep`, :func:`compute_opsm`), GSPO / CISPO / DPPO / TOPR / ratio-PG per-token losses.
* **Alignment** — the one-token shift detector (:func:`alignment_report`, :func:`check_alignment`).
* **Segments** — :func:`segment_sums` (per-(row, segment) sums), :func:`segment_ids_from_mask`
  (segments as the runs of a mask) and :func:`max_runs` (a static bound on their number);
  :class:`Packing`, the padded layout of a packed batch (``Segments.cu_seqlens``).
* **Config types** — :class:`ISSpec` (resolved IS settings), :class:`RSOption`, the literal
  types of the config's fields, and :data:`DRIFT`, the per-token log-ratio ``length_limits`` assumes.
"""

from ._src.alignment import (AlignmentReport, MisalignmentWarning, alignment_metrics, alignment_report,
                             alignment_statistics, check_alignment)
from ._src.config import (DRIFT, RS_OPTIONS, DivergenceEstimator, ISSpec, IsLevel, IsMode, LossDenominator, LossType,
                          NonFinitePolicy, RsAggregation, RSOption, WarnOrRaise)
from ._src.correction import BatchHook, RowValues, correction_metrics, correction_pass, local_correction
from ._src.logratio import NONFINITE_SENTINEL, LogRatioBatch, RowSums, float_mask, log_ratio_batch, nonfinite_positions
from ._src.losses import LossAggMode
from ._src.m2po import m2po_keep, second_moment
from ._src.metrics import (Accumulator, Metrics, add_offpolicy_statistics, mismatch_metrics, nonfinite_metrics,
                           offpolicy_metrics, prefixed)
from ._src.opsm import OPSMResult, compute_opsm, opsm_keep
from ._src.packing import Packing
from ._src.policy_losses import (cispo_loss, dppo_loss, gspo_loss, ratio_pg_loss, rollout_is_loss, sequence_advantage,
                                 topr_loss, topr_weights)
from ._src.segments import max_runs, segment_ids_from_mask, segment_sums
from ._src.rejection import (PROB_CLAMP, RejectionResult, option_keep, rejection_keep, rs_metrics, rs_option_metrics,
                             token_divergence, veto_metrics)
from ._src.weights import ISWeights, add_is_statistics, batch_norm_factor, bound_weights, importance_weights, is_metrics

__all__ = [
    # log ratios
    "LogRatioBatch", "RowSums", "log_ratio_batch", "NONFINITE_SENTINEL", "float_mask", "nonfinite_positions",
    # importance weights
    "ISWeights", "importance_weights", "bound_weights", "batch_norm_factor", "add_is_statistics", "is_metrics",
    # rejection
    "RS_OPTIONS", "RSOption", "RejectionResult", "PROB_CLAMP", "token_divergence", "option_keep", "rejection_keep",
    "rs_metrics", "rs_option_metrics", "veto_metrics",
    # the correction pass
    "correction_pass", "local_correction", "correction_metrics", "RowValues", "BatchHook",
    # metrics
    "add_offpolicy_statistics", "offpolicy_metrics", "mismatch_metrics", "nonfinite_metrics", "prefixed", "Metrics",
    "Accumulator",
    # sequence masks and policy-loss terms
    "m2po_keep", "second_moment", "OPSMResult", "opsm_keep", "compute_opsm", "sequence_advantage", "gspo_loss",
    "cispo_loss", "dppo_loss", "topr_loss", "topr_weights", "rollout_is_loss", "ratio_pg_loss", "LossAggMode",
    # alignment
    "MisalignmentWarning", "AlignmentReport", "alignment_statistics", "alignment_metrics", "alignment_report",
    "check_alignment",
    # segments
    "segment_sums", "segment_ids_from_mask", "max_runs", "Packing",
    # config types
    "ISSpec", "IsLevel", "IsMode", "LossType", "NonFinitePolicy", "RsAggregation", "DivergenceEstimator",
    "LossDenominator", "WarnOrRaise", "DRIFT",
]
