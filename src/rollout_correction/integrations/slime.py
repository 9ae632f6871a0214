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
``rs_lower_bound`` / ``rs_upper_bound`` (default: the TIS bounds), ``rs_veto_threshold``.
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
* without ``use_tis`` only the mismatch metrics are returned and nothing is changed.

Removed tokens leave the numerator only: which denominator a sample's mean uses is slime's
choice (slime ≥ PR #657 keeps each sample's original token count, so a rejected token counts as
a zero-loss token instead of shrinking the sample). Batch normalisation (``tis_batch_normalize``)
rescales the weights of this call to mean 1 over the original loss masks (before rejection, as
slime does): over valid tokens (token level) or over samples with at least one valid token
(sequence / geometric; slime itself rejects geometric and averages over every sample including
empty ones).

Metric names: the mismatch monitors ``mismatch_training_log_ppl``, ``mismatch_training_ppl``,
``mismatch_rollout_log_ppl``, ``mismatch_rollout_ppl``, ``mismatch_kl``, ``mismatch_k3_kl``,
``mismatch_log_ppl_diff``, ``mismatch_log_ppl_abs_diff``, ``mismatch_ppl_ratio``; the correction
metrics ``mis_mean_is_weight_before_clip``, ``mis_ratio_mean_after_mis``, and, by mode,
``mis_truncate_fraction`` / ``mis_clip_fraction_{low,high}`` / ``mis_mask_fraction_{low,high}``
(the mask fractions count every ratio band that removed a token: the ``mask`` mode and
``use_rs``), ``mis_catastrophic_{token,seq}_fraction`` (veto) and ``mis_batch_norm_factor``; and
every ``rollout_corr/...`` metric of this library (a batch value, repeated on every token).

Context parallelism: the tensors must hold whole responses (slime's ``mis.py`` gathers CP shards
itself); a CP-sliced input is detected (lengths do not add up to ``pg_loss``) and rejected.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.config import SAFETY_BOUND, config_value

__all__ = ["SlimeOptions", "options_from_args", "config_from_slime_args", "tis_function"]

_LEVEL_TO_RS_OPTION = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
_LEVELS = tuple(_LEVEL_TO_RS_OPTION)
_MODES = ("truncate", "clip", "mask")


class SlimeOptions:
    """slime's TIS/RS options with slime's defaults resolved (lower = 1/upper, RS inherits IS)."""

    def __init__(self, *, use_tis: bool, tis_mode: str, tis_level: str, tis_lower_bound: Optional[float],
                 tis_upper_bound: float, tis_batch_normalize: bool, use_rs: bool, rs_level: str,
                 rs_lower_bound: Optional[float], rs_upper_bound: Optional[float],
                 rs_veto_threshold: Optional[float]):
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
    )


def config_from_slime_args(args: Any) -> RolloutCorrectionConfig:
    """Our config equivalent to slime's options (see the module docstring)."""
    opts = args if isinstance(args, SlimeOptions) else options_from_args(args)
    if not opts.use_tis:
        return RolloutCorrectionConfig.disabled()
    data: dict[str, Any] = {"rollout_is": opts.tis_level,
                            "rollout_is_batch_normalize": opts.tis_batch_normalize}
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
    return RolloutCorrectionConfig.from_dict(data)


# ---------------------------------------------------------------------------------- helpers
def _pad(rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([r.to(dtype) for r in rows], batch_first=True)


def _unpad(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(B, T) → flat (Σ lengths,) keeping each row's first ``lengths[i]`` entries."""
    cols = torch.arange(x.shape[1], device=x.device)
    keep = cols.unsqueeze(0) < torch.tensor(lengths, device=x.device).unsqueeze(1)
    return x[keep]


def _level_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log ρ at ``level``: log ρ_t, Σ_t log ρ_t or mean_t log ρ_t (row value on every token)."""
    if level == "token":
        return log_ratio
    total = log_ratio.sum(dim=1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_ratio)
    return (total / valid.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(log_ratio)


def _mismatch_metrics(train: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """slime's mismatch monitors, per token (per-sample means repeated on the sample's tokens)."""
    n = valid.sum(dim=1, keepdim=True).clamp(min=1)
    mean_train = train.sum(dim=1, keepdim=True) / n
    mean_rollout = rollout.sum(dim=1, keepdim=True) / n
    clamp = lambda x: x.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # noqa: E731 - exp guards only
    log_ratio = train - rollout
    log_ppl_diff = mean_rollout - mean_train
    shape = train.shape
    return {
        "mismatch_training_log_ppl": (-mean_train).expand(shape),
        "mismatch_training_ppl": torch.exp(clamp(-mean_train)).expand(shape),
        "mismatch_rollout_log_ppl": (-mean_rollout).expand(shape),
        "mismatch_rollout_ppl": torch.exp(clamp(-mean_rollout)).expand(shape),
        "mismatch_kl": rollout - train,
        "mismatch_k3_kl": torch.exp(clamp(log_ratio)) - clamp(log_ratio) - 1,
        "mismatch_log_ppl_diff": log_ppl_diff.expand(shape),
        "mismatch_log_ppl_abs_diff": log_ppl_diff.abs().expand(shape),
        "mismatch_ppl_ratio": torch.exp(clamp(log_ppl_diff)).expand(shape),
    }


def tis_function(
    args: Any,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """slime's custom TIS hook: returns (pg_loss · w, modified loss masks, per-token metrics).

    Args:
        args: slime's argument namespace (options above).
        pg_loss: (N,) flat per-token policy loss, N = Σ_i len(train_log_probs[i]).
        train_log_probs: per-sample (n_i,) log π_train (π_old; π_θ under ``--use-rollout-logprobs``).
        rollout_log_probs: per-sample (n_i,) log π_rollout.
        loss_masks: per-sample (n_i,) 0/1 masks (0 for tool output in multi-turn data).
    """
    if not (len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)):
        raise ValueError(
            f"train_log_probs, rollout_log_probs and loss_masks must have one tensor per sample; got "
            f"{len(train_log_probs)}, {len(rollout_log_probs)} and {len(loss_masks)}"
        )
    lengths = []
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
        if t.dim() != 1 or t.shape != r.shape or t.shape != m.shape:
            raise ValueError(f"sample {i}: expected three 1-D tensors of one length; got train {tuple(t.shape)}, "
                             f"rollout {tuple(r.shape)}, loss_mask {tuple(m.shape)}")
        lengths.append(int(t.shape[0]))
    if pg_loss.dim() != 1 or pg_loss.shape[0] != sum(lengths):
        raise ValueError(
            f"pg_loss has shape {tuple(pg_loss.shape)} but the samples hold {sum(lengths)} tokens; the "
            "function needs whole (not context-parallel-sliced) responses and the flat packed pg_loss"
        )
    opts = options_from_args(args)
    cfg = config_from_slime_args(opts)
    if not lengths:
        return pg_loss, list(loss_masks), {}

    device = pg_loss.device
    train = _pad([t.detach() for t in train_log_probs], torch.float32).to(device)
    rollout = _pad([r.detach() for r in rollout_log_probs], torch.float32).to(device)
    mask = _pad(list(loss_masks), torch.float32).to(device)
    valid = (mask > 0) & torch.isfinite(train) & torch.isfinite(rollout)
    train0 = torch.where(valid, train, 0.0)
    rollout0 = torch.where(valid, rollout, 0.0)

    per_token = _mismatch_metrics(train0, rollout0, valid)
    if not opts.use_tis:
        metrics = {k: _unpad(v, lengths) for k, v in per_token.items()}
        return pg_loss, list(loss_masks), metrics

    result = compute_rollout_correction(train, rollout, mask > 0, cfg)
    new_mask = result.response_mask.to(torch.float32)

    log_ratio = train0 - rollout0
    before = torch.exp(_level_log_ratio(log_ratio, valid, opts.tis_level).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    weights = result.weights if result.weights is not None else torch.ones_like(train)
    per_token["mis_mean_is_weight_before_clip"] = before
    per_token["mis_ratio_mean_after_mis"] = weights
    if opts.tis_mode == "truncate":
        per_token["mis_truncate_fraction"] = (before > opts.tis_upper).float()
    elif opts.tis_mode == "clip":
        per_token["mis_clip_fraction_low"] = (before < opts.tis_lower).float()
        per_token["mis_clip_fraction_high"] = (before > opts.tis_upper).float()
    bands = opts.ratio_bands()
    if bands:
        low = torch.zeros_like(train, dtype=torch.bool)
        high = torch.zeros_like(low)
        for level, lo, hi in bands:
            ratio = torch.exp(_level_log_ratio(log_ratio, valid, level).clamp(-SAFETY_BOUND, SAFETY_BOUND))
            low |= ratio < lo
            high |= ratio > hi
        per_token["mis_mask_fraction_low"] = low.float()
        per_token["mis_mask_fraction_high"] = high.float()
    if opts.use_rs and opts.rs_veto_threshold is not None:
        bad = valid & (log_ratio < math.log(opts.rs_veto_threshold))
        per_token["mis_catastrophic_token_fraction"] = bad.float()
        per_token["mis_catastrophic_seq_fraction"] = bad.any(dim=1, keepdim=True).float().expand_as(train)
    for name, value in result.metrics.items():
        if name.endswith("batch_norm_factor"):
            per_token["mis_batch_norm_factor"] = value.float().expand_as(train)
        per_token[name] = value.float().expand_as(train)

    flat_weights = _unpad(weights, lengths).to(pg_loss.dtype)
    modified = [
        row[:n].to(m.dtype) for row, n, m in zip(new_mask, lengths, loss_masks)
    ]
    metrics = {k: _unpad(torch.nan_to_num(v.float()), lengths) for k, v in per_token.items()}
    return pg_loss * flat_weights, modified, metrics
