"""slime: a custom TIS function backed by this library.

Use it in place of slime's example ``mis.py``::

    --use-tis --custom-config-path mis.yaml \\
    --custom-tis-function-path rollout_correction.integrations.slime.tis_function

slime calls ``fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)``
with per-sample 1-D tensors (one per response) and the flat, packed per-token ``pg_loss``
(their concatenation), and expects ``(pg_loss, modified_loss_masks, metrics)`` back, where
``metrics`` maps a name to a flat per-token tensor that slime averages with its own
``sum_of_sample_mean`` over the *original* loss masks (sequence-level values are repeated on
every token of their sample).

Options are read from ``args`` under slime's names (the YAML of ``--custom-config-path`` is
merged into ``args``): ``use_tis``, ``tis_mode`` (``truncate`` | ``clip`` | ``mask``),
``tis_level`` (``token`` | ``sequence`` | ``geometric``), ``tis_lower_bound`` (default
1/upper), ``tis_upper_bound``, ``tis_batch_normalize``, ``use_rs``, ``rs_level``,
``rs_lower_bound`` / ``rs_upper_bound`` (default: the TIS bounds), ``rs_veto_threshold``; and this
library's ``rollout_correction_metrics`` (:data:`METRICS_KEY`, the metric families), ``log_prob_floor``,
``expect_zero_atol`` and ``expect_zero_action``.
The older ``mis_level`` / ``mis_mode`` / ``mis_lower_bound`` / ``mis_upper_bound`` /
``mis_veto_threshold`` names are read when the ``tis_*`` ones are absent.

Semantics (same as slime's ``mis.py``), with ρ = π_train/π_rollout aggregated at the level
(token ρ_t, sequence ∏ρ_t, geometric exp mean log ρ_t; log-space clamp ±20):

* ``truncate``: w = min(ρ, upper); ``clip``: w = clamp(ρ, lower, upper);
* ``mask``: w = ρ (untruncated) and tokens/samples with ρ ∉ [lower, upper] are removed from the
  returned loss mask;
* ``use_rs`` (only together with ``use_tis``, as in slime): also remove tokens/samples whose
  ratio at ``rs_level`` lies outside [rs_lower, rs_upper]; ``rs_veto_threshold`` C removes a
  whole sample if any valid token has unclamped ρ_t < C;
* without ``use_tis`` (slime's ``--get-mismatch-metrics``) only the metrics are returned (the
  mismatch ones and this library's off-policy ones) and nothing is changed.

Removed tokens leave the numerator only: which denominator a sample's mean uses is slime's
choice (slime ≥ PR #657 keeps each sample's original token count, ``rollout_mask_sums``, so a
rejected token counts as a zero-loss token instead of shrinking the sample): the adapter's
``loss_denominator`` defaults to ``valid``, slime's own reduction. ``loss_denominator: kept`` in
the YAML multiplies each sample's returned loss by n_i / k_i (its given over its kept token
count, over the whole sample with context parallelism), so that slime's division by n_i gives the
mean over the kept tokens; exact when each rollout is one sample (slime's default), while a
rollout of several samples (``rollout_mask_sums`` summed over them) gets each sample's share
rescaled by its own ratio. A fully rejected sample keeps contributing zero either way. Batch
normalisation (``tis_batch_normalize``) rescales the weights of this call to mean 1 over the original loss masks (before rejection, as
slime does): over valid tokens (token level) or over samples with at least one valid token
(sequence / geometric; slime itself rejects geometric and averages over every sample including
empty ones).

Metric names are those of slime's current ``examples/train_infer_mismatch_helper/mis.py``
(``mis_`` + the name it records), each a per-token tensor with the meaning it has there:

* always: ``mis_training_log_ppl``, ``mis_training_ppl``, ``mis_rollout_log_ppl``,
  ``mis_rollout_ppl``, ``mis_kl``, ``mis_k3_kl``, ``mis_log_ppl_diff``, ``mis_log_ppl_abs_diff``,
  ``mis_ppl_ratio``, ``mis_chi2_token``, ``mis_chi2_seq``, and the name slime's policy loss logs,
  ``train_rollout_logprob_abs_diff`` (|log π_train − log π_rollout| per token);
* with ``use_tis``: ``mis_tis_weight_before_bound``, by mode ``mis_tis_truncate_fraction`` /
  ``mis_tis_clip_fraction_{low,high}`` / ``mis_tis_mask_fraction_{low,high}``,
  ``mis_tis_weight_after_bound``, ``mis_is_ratio_mean_after_tis_rs``, ``mis_is_ratio_mean_final``,
  ``mis_is_ratio_min_final``, ``mis_is_ratio_max_final``; with ``use_rs``
  ``mis_rs_mask_fraction_{low,high}`` and, with a veto, ``mis_rs_catastrophic_token_fraction``
  / ``mis_rs_catastrophic_seq_fraction``; with ``tis_batch_normalize`` ``mis_batch_norm_factor``;
* beside them every ``rollout_corr/...`` metric of this library (a batch value over this call's
  samples, repeated on every token).

``rollout_correction_dump_dir: DIR`` in the YAML (off by default) makes the function keep each
micro-batch's train and rollout log-probs and loss masks (before any change) and write them once per
optimizer step — every ``global_batch_size`` / data-parallel-size samples on a rank — to
``DIR/step_{N}[_rank_{R}].pt`` (:mod:`rollout_correction.integrations.dump`; N counts the process's
steps from 0), for ``rollout-correction diagnose DIR``. It is refused with context parallelism, where the
function sees slices (slime's own ``--save-debug-train-data`` restores them and is read too).

Context parallelism (``--context-parallel-size`` > 1): slime passes each rank's slice of the
log-probs (the response positions whose logits fall in the rank's two zig-zag chunks, see
:func:`cp_response_ranges`) with full-length loss masks. The function then reduces every
per-sample quantity over Megatron's context-parallel group with one all-gather of a few scalars
per sample (see :class:`rollout_correction.reductions.RowExchange`), so weights, masks and metrics are
those of the whole responses; ``pg_loss`` and the metrics cover this rank's tokens, the returned
loss masks are full length, exact on this rank's positions (the ones slime's reducer reads) and
carrying the sample-level decisions elsewhere.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from rollout_correction import METRIC_PREFIX, RolloutCorrectionConfig
from rollout_correction import config_value
from rollout_correction import SAFETY_BOUND
from rollout_correction.primitives import correction_pass
from rollout_correction.reductions import RowExchange

__all__ = ["DUMP_KEY", "METRICS_KEY", "SlimeOptions", "options_from_args", "config_from_slime_args", "tis_function",
           "make_tis_function"]

_LEVEL_TO_RS_OPTION = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
_LEVELS = tuple(_LEVEL_TO_RS_OPTION)
_MODES = ("truncate", "clip", "mask")


class SlimeOptions:
    """slime's TIS/RS options with slime's defaults resolved (lower = 1/upper, RS inherits IS)."""

    def __init__(self, *, use_tis: bool, tis_mode: str, tis_level: str, tis_lower_bound: Optional[float],
                 tis_upper_bound: float, tis_batch_normalize: bool, use_rs: bool, rs_level: str,
                 rs_lower_bound: Optional[float], rs_upper_bound: Optional[float],
                 rs_veto_threshold: Optional[float], loss_denominator: Optional[str] = None,
                 extra: Optional[dict] = None):
        if loss_denominator not in (None, "kept", "valid"):
            raise ValueError(f"loss_denominator={loss_denominator!r}: allowed values are 'kept', 'valid' "
                             "(null: 'valid', slime's own reduction)")
        self.loss_denominator = loss_denominator or "valid"
        self.extra = {k: v for k, v in (extra or {}).items() if v is not None}  # this library's keys, as given
        if tis_mode not in _MODES:
            raise ValueError(f"tis_mode={tis_mode!r}: allowed values are {list(_MODES)}")
        for key, level in (("tis_level", tis_level), ("rs_level", rs_level)):
            if level not in _LEVELS:
                raise ValueError(f"{key}={level!r}: allowed values are {list(_LEVELS)}")
        if tis_upper_bound is None or not float(tis_upper_bound) > 0:
            raise ValueError(f"tis_upper_bound={tis_upper_bound!r}: a bound > 0 is required")
        self.use_tis = bool(use_tis)
        self.tis_mode = tis_mode
        self.tis_level = tis_level
        self.tis_upper = float(tis_upper_bound)
        self.tis_lower = 1.0 / self.tis_upper if tis_lower_bound is None else float(tis_lower_bound)
        if tis_mode in ("clip", "mask") and not 0 <= self.tis_lower < self.tis_upper:
            raise ValueError(f"tis_lower_bound={self.tis_lower} must lie in [0, tis_upper_bound={self.tis_upper})")
        self.tis_batch_normalize = bool(tis_batch_normalize)
        self.use_rs = bool(use_rs)
        self.rs_level = rs_level
        self.rs_lower = self.tis_lower if rs_lower_bound is None else float(rs_lower_bound)
        self.rs_upper = self.tis_upper if rs_upper_bound is None else float(rs_upper_bound)
        if self.use_rs and not 0 <= self.rs_lower < self.rs_upper:
            raise ValueError(f"rs bounds [{self.rs_lower}, {self.rs_upper}] must satisfy 0 <= lower < upper")
        self.rs_veto_threshold = None if rs_veto_threshold is None else float(rs_veto_threshold)

    def ratio_bands(self) -> list[tuple[str, float, float]]:
        """(level, lower, upper) of every band that removes tokens from the loss mask."""
        bands = []
        if self.use_tis and self.tis_mode == "mask":
            bands.append((self.tis_level, self.tis_lower, self.tis_upper))
        if self.use_tis and self.use_rs:
            bands.append((self.rs_level, self.rs_lower, self.rs_upper))
        return bands


def _get(args: Any, name: str, legacy: Optional[str], default: Any) -> Any:
    return config_value(args, name, default, aliases=(legacy,) if legacy else ())


def options_from_args(args: Any) -> SlimeOptions:
    """Read slime's option names from ``args`` (a namespace), with slime's defaults."""
    metrics = _get(args, METRICS_KEY, None, None)
    return SlimeOptions(
        use_tis=_get(args, "use_tis", None, False),
        tis_mode=_get(args, "tis_mode", "mis_mode", "truncate"),
        tis_level=_get(args, "tis_level", "mis_level", "token"),
        tis_lower_bound=_get(args, "tis_lower_bound", "mis_lower_bound", None),
        tis_upper_bound=_get(args, "tis_upper_bound", "mis_upper_bound", 2.0),
        tis_batch_normalize=_get(args, "tis_batch_normalize", "mis_batch_normalize", False),
        use_rs=_get(args, "use_rs", None, False),
        rs_level=_get(args, "rs_level", None, "token"),
        rs_lower_bound=_get(args, "rs_lower_bound", None, None),
        rs_upper_bound=_get(args, "rs_upper_bound", None, None),
        rs_veto_threshold=_get(args, "rs_veto_threshold", "mis_veto_threshold", None),
        loss_denominator=_get(args, "loss_denominator", None, None),
        extra={**{k: _get(args, k, None, None) for k in PASSED_KEYS}, **({} if metrics is None else {"metrics": metrics})},
    )


#: This library's keys read from slime's arguments under their own names (``--expect-zero-atol 1e-6``
#: for slime's true on-policy mode: no correction, an error when the engines disagree).
PASSED_KEYS = ("log_prob_floor", "expect_zero_atol", "expect_zero_action")
#: The metric families of the ``rollout_corr/...`` metrics (the config's ``metrics`` key), read from
#: ``args`` under this name: ``rollout_correction_metrics: [default, raw]`` in the YAML of
#: ``--custom-config-path`` (slime's own ``mis_*`` metrics are computed whatever it selects).
METRICS_KEY = "rollout_correction_metrics"


def config_from_slime_args(args: Any) -> RolloutCorrectionConfig:
    """Our config equivalent to slime's options (see the module docstring)."""
    opts = args if isinstance(args, SlimeOptions) else options_from_args(args)
    if not opts.use_tis:
        return RolloutCorrectionConfig.from_dict(opts.extra) if opts.extra else RolloutCorrectionConfig.disabled()
    data: dict[str, Any] = {"rollout_is": opts.tis_level, "loss_denominator": opts.loss_denominator,
                            "rollout_is_batch_normalize": opts.tis_batch_normalize, **opts.extra}
    if opts.tis_mode == "truncate":
        data["rollout_is_threshold"] = opts.tis_upper
    elif opts.tis_mode == "clip":
        data.update(rollout_is_mode="clip", rollout_is_threshold=opts.tis_upper,
                    rollout_is_threshold_lower=opts.tis_lower)
    else:  # mask: the weight stays the (safety-bounded) ratio; the band goes to rejection
        data["rollout_is_threshold"] = math.exp(SAFETY_BOUND)
    bands: dict[str, tuple[float, float]] = {}
    for level, lo, hi in opts.ratio_bands():
        option = _LEVEL_TO_RS_OPTION[level]
        if option in bands:  # the same statistic twice: both bands must accept
            lo, hi = max(lo, bands[option][0]), min(hi, bands[option][1])
            if lo > hi:
                raise ValueError(f"the tis and rs bands at level {level!r} do not overlap; nothing could pass")
        bands[option] = (lo, hi)
    if bands:
        data["rollout_rs"] = ",".join(bands)
        data["rollout_rs_threshold"] = ",".join(f"{lo!r}_{hi!r}" for lo, hi in bands.values())
    if opts.use_rs and opts.rs_veto_threshold is not None:
        data["rollout_token_veto_threshold"] = opts.rs_veto_threshold
    cfg = RolloutCorrectionConfig.from_dict(data)
    if cfg.rollout_is_batch_normalize and "default" not in cfg.families:
        raise ValueError(f"{METRICS_KEY}={list(cfg.metrics)} without 'default' under tis_batch_normalize: "
                         "mis_batch_norm_factor and mis_is_ratio_*_final read the batch-normalisation factor, a "
                         "metric of the default family; add 'default'")
    return cfg


# ---------------------------------------------------------------------------------- helpers
def _pad(rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([r.to(dtype) for r in rows], batch_first=True)


def _unpad(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(B, T) → flat (Σ lengths,) keeping each row's first ``lengths[i]`` entries."""
    cols = torch.arange(x.shape[1], device=x.device)
    keep = cols.unsqueeze(0) < torch.tensor(lengths, device=x.device, dtype=torch.long).unsqueeze(1)
    return x[keep]


def cp_response_ranges(total_length: int, response_length: int, cp_size: int,
                       cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) ranges of response positions whose log-probs ``cp_rank`` holds.

    slime's context parallelism splits each packed sequence of ``total_length`` tokens into
    2·CP chunks of ⌈total_length / (2·CP)⌉ tokens; rank r holds chunks r and 2·CP−1−r. The
    log-prob of response token j comes from the logits at position prompt_length − 1 + j, so a
    rank holds the response tokens whose logit position falls in its chunks (an empty range is
    (0, 0)). Its per-sample log-prob tensor is the concatenation of the two ranges.
    """
    prompt_length = total_length - response_length
    chunk = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    out = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo = max(c * chunk, prompt_length - 1)
        hi = min((c + 1) * chunk, total_length - 1)
        out.append((lo - (prompt_length - 1), hi - (prompt_length - 1)) if lo < hi else (0, 0))
    return out[0], out[1]


def _context_parallel(args: Any) -> tuple[int, int, Optional[object]]:
    """(CP size, CP rank, CP group) from slime's ``--context-parallel-size`` and Megatron's state."""
    size = int(getattr(args, "context_parallel_size", 1) or 1)
    if size <= 1:
        return 1, 0, None
    try:
        from megatron.core import mpu
    except ImportError as e:
        raise RuntimeError(f"context_parallel_size={size} needs Megatron's parallel state (megatron.core.mpu) to "
                           "find the context-parallel group; run inside slime's Megatron actor") from e
    group = mpu.get_context_parallel_group()
    if mpu.get_context_parallel_world_size() != size:
        raise ValueError(f"args.context_parallel_size={size} but Megatron's context-parallel group has "
                         f"{mpu.get_context_parallel_world_size()} ranks")
    return size, mpu.get_context_parallel_rank(), group


def _local_masks(loss_masks, train_log_probs, total_lengths, response_lengths, cp_size, cp_rank):
    """Per-sample loss masks restricted to this rank's positions, and the (a, b, c, d) ranges."""
    if cp_size == 1:
        return list(loss_masks), [None] * len(loss_masks)
    if total_lengths is None or response_lengths is None:
        raise ValueError("with context parallelism tis_function needs total_lengths and response_lengths "
                         "(slime passes them to the custom TIS function)")
    masks, ranges = [], []
    for i, (m, n_tot, n_resp) in enumerate(zip(loss_masks, total_lengths, response_lengths)):
        if m.shape[0] != n_resp:
            raise ValueError(f"sample {i}: loss_mask has {m.shape[0]} entries but response_length is {n_resp}; "
                             "slime passes full-length loss masks")
        (a, b), (c, d) = cp_response_ranges(int(n_tot), int(n_resp), cp_size, cp_rank)
        masks.append(torch.cat([m[a:b], m[c:d]]))
        ranges.append((a, b, c, d))
    return masks, ranges


def _tis_pass(opts: SlimeOptions, cfg: RolloutCorrectionConfig, train: torch.Tensor, rollout: torch.Tensor,
              mask: torch.Tensor, rows: RowExchange):
    """One pass over this rank's (B, T) tokens; per-sample reductions go through ``rows``.

    Returns (weights or None, new local mask or None, per-row keep (B,) or None, per-token metrics).
    """
    in_mask = mask > 0
    valid = in_mask & torch.isfinite(train) & torch.isfinite(rollout)
    zero = torch.zeros((), dtype=torch.float32, device=train.device)
    train0, rollout0 = torch.where(valid, train, zero), torch.where(valid, rollout, zero)
    lr = train0 - rollout0
    clamp = lambda x: x.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # noqa: E731 - exp guards only
    shape = train.shape

    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32).unsqueeze(-1).expand(shape)

    n = rows.sum(valid.sum(-1).to(torch.float64)).clamp_min(1.0)
    mean_train = rows.sum(train0.double().sum(-1)) / n
    mean_rollout = rows.sum(rollout0.double().sum(-1)) / n
    lr_sum = rows.sum(lr.double().sum(-1))
    rho = torch.exp(clamp(lr)) * valid
    chi2_token = rows.sum((rho.double() ** 2).sum(-1)) / n - 1.0
    log_ppl_diff = mean_rollout - mean_train
    m: dict[str, torch.Tensor] = {
        "mis_training_log_ppl": expand(-mean_train),
        "mis_training_ppl": expand(torch.exp(clamp(-mean_train))),
        "mis_rollout_log_ppl": expand(-mean_rollout),
        "mis_rollout_ppl": expand(torch.exp(clamp(-mean_rollout))),
        "mis_kl": rollout0 - train0,
        "mis_k3_kl": torch.exp(clamp(lr)) - clamp(lr) - 1,
        "mis_log_ppl_diff": expand(log_ppl_diff),
        "mis_log_ppl_abs_diff": expand(log_ppl_diff.abs()),
        "mis_ppl_ratio": expand(torch.exp(clamp(log_ppl_diff))),
        "mis_chi2_token": expand(chi2_token),
        "mis_chi2_seq": expand(torch.exp(2.0 * clamp(lr_sum)) - 1.0),
        # slime's own name: |log π_train − log π_rollout| per token (slime reduces it per sample, then
        # over samples, as its policy loss does)
        "train_rollout_logprob_abs_diff": lr.abs(),
    }
    result, values = correction_pass(train, rollout, in_mask, cfg, None, rows, None)
    for name, value in result.metrics.items():
        m[name] = value.float().expand(shape)
    if not opts.use_tis:
        return None, None, None, m

    def level_ratio(level: str) -> torch.Tensor:
        if level == "token":
            x = lr
        elif level == "sequence":
            x = expand(lr_sum)
        else:
            x = expand(lr_sum / n)
        return torch.exp(clamp(x))

    weights = result.weights if result.weights is not None else torch.ones_like(train)
    before = level_ratio(opts.tis_level)
    m["mis_tis_weight_before_bound"] = before
    prefix = {"truncate": "mis_tis_truncate_fraction", "clip": "mis_tis_clip_fraction",
              "mask": "mis_tis_mask_fraction"}[opts.tis_mode]
    if opts.tis_mode == "truncate":
        m[prefix] = (before > opts.tis_upper).float()
    else:
        m[prefix + "_low"] = (before < opts.tis_lower).float()
        m[prefix + "_high"] = (before > opts.tis_upper).float()
    bn = result.metrics.get(f"{METRIC_PREFIX}rollout_is_batch_norm_factor")
    after = values.weights  # before batch normalisation
    m["mis_tis_weight_after_bound"] = after
    if opts.use_rs:
        rs_ratio = level_ratio(opts.rs_level)
        m["mis_rs_mask_fraction_low"] = (rs_ratio < opts.rs_lower).float()
        m["mis_rs_mask_fraction_high"] = (rs_ratio > opts.rs_upper).float()
        if opts.rs_veto_threshold is not None:
            bad = valid & (lr < math.log(opts.rs_veto_threshold))
            m["mis_rs_catastrophic_token_fraction"] = bad.float()
            m["mis_rs_catastrophic_seq_fraction"] = expand(rows.max(bad.any(-1)))
    m["mis_is_ratio_mean_after_tis_rs"] = after
    if bn is not None:
        m["mis_batch_norm_factor"] = bn.float().expand(shape)
    # Final weights per sample over the loss mask: mean, min, max (0 for an empty sample). The
    # reduced partials use the weights before batch normalisation (this rank's tokens only).
    n_mask = rows.sum(in_mask.sum(-1).to(torch.float64))
    has = n_mask > 0
    if values.row_weight is None:
        w, empty = after.double(), torch.full(shape[:1], torch.inf, dtype=torch.float64, device=train.device)
        w_mean = rows.sum((w * in_mask).sum(-1)) / n_mask.clamp_min(1.0)
        w_max = rows.max(torch.where(in_mask, w, -torch.inf).amax(-1) if shape[-1] else -empty)
        w_min = rows.min(torch.where(in_mask, w, torch.inf).amin(-1) if shape[-1] else empty)
    else:
        w_mean = w_max = w_min = values.row_weight.double()
    factor = bn.double() if bn is not None else 1.0
    m["mis_is_ratio_mean_final"] = expand(torch.where(has, w_mean, 0.0) / factor)
    m["mis_is_ratio_min_final"] = expand(torch.where(has, w_min, 0.0) / factor)
    m["mis_is_ratio_max_final"] = expand(torch.where(has, w_max, 0.0) / factor)
    row_keep = values.row_keep & ~values.dropped
    return weights, result.response_mask.to(torch.float32), row_keep, m


#: ``rollout_correction_dump_dir`` (a key of the ``--custom-config-path`` YAML; off by default).
DUMP_KEY = "rollout_correction_dump_dir"
_DUMPS: dict[str, list] = {}  # directory → [StepDump, steps written by this process]


def _data_parallel_size(args: Any) -> int:
    """Megatron's ``args.data_parallel_size``, else world size / (TP · PP · CP)."""
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return int(dp)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    model = 1
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= int(getattr(args, key, 1) or 1)
    return max(1, world // model)


def _check_dump(args: Any) -> None:
    cp_size = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp_size > 1:
        raise ValueError(f"{DUMP_KEY} with --context-parallel-size {cp_size}: this function sees each rank's slices "
                         "of the responses; use slime's --save-debug-train-data, which restores whole responses "
                         "(rollout-correction diagnose reads its files)")
    if not getattr(args, "global_batch_size", None):
        raise ValueError(f"{DUMP_KEY} needs args.global_batch_size (slime sets it) to write once per step")


def _dump(args: Any, train_log_probs, rollout_log_probs, loss_masks) -> None:
    """Keeps this micro-batch's log-probs and masks; writes them once per optimizer step, i.e. every
    ``global_batch_size / data-parallel size`` samples on this rank
    (:mod:`rollout_correction.integrations.dump`)."""
    batch = args.global_batch_size
    from rollout_correction.integrations.dump import StepDump

    directory = str(getattr(args, DUMP_KEY))
    state = _DUMPS.setdefault(directory, [StepDump(directory), 0])
    state[0].add(train_log_probs, rollout_log_probs, loss_masks)
    if len(state[0]) >= max(1, int(batch) // _data_parallel_size(args)):
        state[0].flush(state[1])
        state[1] += 1


def tis_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    total_lengths: Optional[list[int]] = None,
    response_lengths: Optional[list[int]] = None,
    monitor: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """slime's custom TIS hook: returns (pg_loss · w, modified loss masks, per-token metrics).
    ``monitor``: a :class:`~rollout_correction.monitor.HealthMonitor` fed once per call (slime does
    not pass one; :func:`make_tis_function` binds it).

    Args:
        args: slime's argument namespace (options above; ``context_parallel_size``).
        pg_loss: (N,) flat per-token policy loss, N = Σ_i len(train_log_probs[i]).
        train_log_probs: per-sample log π_train (π_old; π_θ under ``--use-rollout-logprobs``):
            whole responses, or with context parallelism this rank's slice (slime's layout).
        rollout_log_probs: per-sample log π_rollout, laid out as ``train_log_probs``.
        loss_masks: per-sample (response_length,) 0/1 masks (0 for tool output in multi-turn
            data), always full length.
        total_lengths, response_lengths: per-sample prompt + response and response lengths (slime
            passes them; needed with context parallelism).
    Returns:
        ``pg_loss`` times the weights (this rank's tokens), the modified full-length loss masks,
        and the per-token metrics of this rank's tokens.
    """
    if not (len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)):
        raise ValueError(
            f"train_log_probs, rollout_log_probs and loss_masks must have one tensor per sample; got "
            f"{len(train_log_probs)}, {len(rollout_log_probs)} and {len(loss_masks)}"
        )
    if getattr(args, DUMP_KEY, None):
        _check_dump(args)
    cp_size, cp_rank, cp_group = _context_parallel(args)
    local_masks, ranges = _local_masks(loss_masks, train_log_probs, total_lengths, response_lengths, cp_size, cp_rank)
    lengths = []
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, local_masks)):
        if t.dim() != 1 or t.shape != r.shape or t.shape != m.shape:
            where = f" (this context-parallel rank's slice: {ranges[i]})" if cp_size > 1 else ""
            raise ValueError(f"sample {i}: expected 1-D train/rollout log-probs matching the loss mask{where}; got "
                             f"train {tuple(t.shape)}, rollout {tuple(r.shape)}, loss_mask {tuple(m.shape)}")
        lengths.append(int(t.shape[0]))
    if pg_loss.dim() != 1 or pg_loss.shape[0] != sum(lengths):
        raise ValueError(f"pg_loss has shape {tuple(pg_loss.shape)} but the samples hold {sum(lengths)} tokens on "
                         "this rank; pg_loss must be the flat concatenation of the per-sample tokens")
    opts = options_from_args(args)
    cfg = config_from_slime_args(opts)
    if getattr(args, DUMP_KEY, None):
        _dump(args, train_log_probs, rollout_log_probs, loss_masks)
    if not lengths:
        return pg_loss, list(loss_masks), {}

    device = pg_loss.device
    train = _pad([t.detach() for t in train_log_probs], torch.float32).to(device)
    rollout = _pad([r.detach() for r in rollout_log_probs], torch.float32).to(device)
    mask = _pad(local_masks, torch.float32).to(device)
    rows = RowExchange(cp_group)
    with torch.no_grad():
        for _ in rows.passes():
            weights, new_mask, row_keep, per_token = _tis_pass(opts, cfg, train, rollout, mask, rows)
            if new_mask is not None and opts.loss_denominator == "kept":  # whole samples: given, kept
                counts = rows.sum(torch.stack([mask.sum(-1), new_mask.sum(-1)]))
    from rollout_correction.monitor import active_monitor  # beside the adapters, not below

    monitor = monitor if monitor is not None else active_monitor()  # the latter: deprecated since 0.2.0
    if monitor is not None:  # feed the health monitor; its numbers go back as slime metrics
        batch = {k: v.reshape(-1)[0] for k, v in per_token.items() if k.startswith(METRIC_PREFIX) and v.numel()}
        per_token.update({k: torch.full_like(train, x) for k, x in monitor.observe(batch).items()})
    metrics = {k: _unpad(torch.nan_to_num(v.float()), lengths) for k, v in per_token.items()}
    if weights is None:
        return pg_loss, list(loss_masks), metrics

    modified = []
    for i, (m, n) in enumerate(zip(loss_masks, lengths)):
        local = new_mask[i, :n].to(device=m.device, dtype=m.dtype)
        if cp_size == 1:
            modified.append(local)
            continue
        # Other ranks' positions carry the sequence-level decisions; slime reads only this rank's.
        full = m * row_keep[i].to(device=m.device, dtype=m.dtype)
        a, b, c, d = ranges[i]
        full[a:b] = local[: b - a]
        full[c:d] = local[b - a:]
        modified.append(full)
    if opts.loss_denominator == "kept":  # slime divides by the given count: make it the kept count
        weights = weights * (counts[0] / counts[1].clamp_min(1.0)).unsqueeze(-1)
    flat_weights = _unpad(weights, lengths).to(pg_loss.dtype)
    return pg_loss * flat_weights, modified, metrics


def make_tis_function(monitor: Any) -> Callable[..., tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]]:
    """:func:`tis_function` feeding ``monitor`` (a :class:`~rollout_correction.monitor.HealthMonitor`)
    once per call, for slime's ``--custom-tis-function-path``: in a module of yours,
    ``tis = make_tis_function(HealthMonitor())``, then ``--custom-tis-function-path your_module.tis``."""

    def tis(args: Any, **kwargs: Any):
        return tis_function(args, monitor=monitor, **kwargs)

    tis.__doc__ = tis_function.__doc__
    return tis
