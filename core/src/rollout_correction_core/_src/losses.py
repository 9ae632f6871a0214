"""Policy losses: PPO clip (dual clip), decoupled IS weighting, bypass PPO-clip, REINFORCE.

Notation: r_t = π_θ/π_prox (log clamped to ±20), A_t the advantage, ε_lo/ε_hi the clip range,
c > 1 the dual-clip constant, w_t the (detached) IS weight.

* PPO clip (Schulman et al. 2017) with dual clip (Ye et al. 2020) for A < 0:
      ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1−ε_lo, 1+ε_hi));   if A_t < 0: ℓ_t ← min(ℓ_t, −c A_t)
* decoupled (Hilton et al. 2021; three policies): ℓ_t ← w_t · ℓ_t with π_prox = π_old and
  w_t = π_old/π_rollout (bounded as configured)
* bypass PPO-clip: π_prox = π_rollout; rejection masks apply; IS weights are diagnostics only
* bypass REINFORCE (pure IS): ℓ_t = −sg(w_t) · A_t · log π_θ(y_t), w = π_θ/π_rollout bounded as
  configured; with untruncated sequence weights its gradient is the on-policy gradient E_π[A ∇log π]
* the other ``loss_type`` values: :mod:`rollout_correction_core._src.policy_losses`, with the same
  weights, masks and aggregation; OPSM (:mod:`rollout_correction_core._src.opsm`) drops whole sequences
  from the mask before aggregation (it needs the advantages, so it lives here)

Values at masked or rejected positions never reach the loss (they are replaced with ``where``, so
a NaN there cannot propagate, not even into the gradient). When every token is masked the loss is
exactly 0, still attached to the graph, with zero gradient.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union, get_args

import torch

from .agreement import agreed_setting, latest
from .config import ConfigError, LossType, RolloutCorrectionConfig, as_config
from .constants import SAFETY_BOUND
from .correction import RowValues, compute_rollout_correction, correction_pass
from .metrics import Metrics, prefixed
from .opsm import compute_opsm
from .packing import packable
from .parallel import Parallel, as_parallel, verified
from .segments import Segments
from .policy_losses import cispo_loss, dppo_loss, gspo_loss, ratio_pg_loss, rollout_is_loss, topr_loss
from .logratio import nonfinite_positions
from .sequence_group import RowExchange, check_sequence_group, describe, raise_nonfinite, raise_nonfinite_on_any_rank, stats_owner
from .declared import ACTOR
from .stats import SufficientStats, Value, maximum
from .validation import check_same, first_nonfinite

__all__ = ["LossAggMode", "LOSS_AGG_MODES", "ClipRange", "Aggregation", "PolicyLoss", "agg_loss", "ppo_clip_loss",
           "policy_loss_term", "compute_policy_loss"]

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
Count = Union[int, float, torch.Tensor, None]


@dataclass(frozen=True)
class ClipRange:
    """The ratio terms' hyper-parameters: ε_lo (``low``), ε_hi (``high``) and the dual-clip constant c
    (``dual``); for DPPO the divergence bounds δ_lo / δ_hi and the ratio truncation c."""

    low: float = 0.2
    high: float = 0.2
    dual: float = 3.0


@dataclass(frozen=True)
class Aggregation:
    """How :func:`agg_loss` makes a (B, T) per-token loss a scalar: ``mode``, the totals
    ``global_num_tokens`` / ``global_num_seqs`` over the data-parallel ranks (None: local counts),
    ``dp_size`` (the gradient-averaging world size) and ``scale_factor`` (S of seq-mean-token-sum-norm)."""

    mode: LossAggMode = "token-mean"
    global_num_tokens: Count = None
    global_num_seqs: Count = None
    dp_size: int = 1
    scale_factor: Optional[float] = None


@dataclass(frozen=True)
class PolicyLoss:
    """The trainer's loss hyper-parameters for :func:`compute_policy_loss`: its clip range and aggregation."""

    clip: ClipRange = field(default_factory=ClipRange)
    aggregation: Aggregation = field(default_factory=Aggregation)


def _count(value: Count, local: torch.Tensor) -> torch.Tensor:
    if value is None:
        den = local
    elif isinstance(value, torch.Tensor):
        den = value.to(dtype=local.dtype, device=local.device)
    else:  # a Python number: a fill on the device (torch.as_tensor would copy from the host and sync)
        den = torch.full((), value, dtype=local.dtype, device=local.device)
    return den.clamp_min(1.0)


def _check_clip(func: str, arg: str, clip: ClipRange, loss_type: str = "ppo_clip") -> None:
    """Raise, naming ``func``'s argument ``arg``, unless ``clip`` is a :class:`ClipRange` ``loss_type`` takes."""
    if not isinstance(clip, ClipRange):
        raise TypeError(f"{func}: {arg}={clip!r} is not a ClipRange; pass ClipRange(low, high, dual)")
    if not (clip.low >= 0 and clip.high >= 0):
        raise ValueError(f"{func}: {arg}.low={clip.low}, {arg}.high={clip.high} are invalid: clip ratios must be ≥ 0")
    if loss_type == "ppo_clip" and not clip.dual > 1.0:
        raise ValueError(f"{func}: {arg}.dual={clip.dual} is invalid: the dual-clip constant c must be > 1")


def _check_aggregation(func: str, arg: str, agg: Aggregation, split: bool) -> None:
    """Raise, naming ``func``'s argument ``arg``, unless ``agg`` is an :class:`Aggregation` that applies
    (``split``: the rows are split across a context-parallel group)."""
    if not isinstance(agg, Aggregation):
        raise TypeError(f"{func}: {arg}={agg!r} is not an Aggregation; pass Aggregation(mode, ...)")
    if agg.mode not in LOSS_AGG_MODES:
        raise ValueError(f"{func}: {arg}.mode={agg.mode!r} is invalid; allowed: {list(LOSS_AGG_MODES)}")
    if agg.dp_size > 1:
        needed = {"token-mean": "global_num_tokens", "token-sum": None}.get(agg.mode, "global_num_seqs")
        if needed is not None and getattr(agg, needed) is None:
            raise ValueError(f"{func}: {arg}.mode={agg.mode!r} with {arg}.dp_size={agg.dp_size} needs "
                             f"{arg}.{needed}: scaling a local mean by dp_size would give every rank the wrong "
                             "gradient scale")
    if split and agg.mode == "seq-mean-token-sum-norm" and agg.scale_factor is None:
        raise ValueError(f"{func}: {arg}.mode='seq-mean-token-sum-norm' with a cp_group needs {arg}.scale_factor "
                         "(e.g. the maximum response length): this rank holds only a slice of each sequence, so its "
                         "width is not the sequence length")


@verified
@packable("loss_mat", "loss_mask", "count_mask")
def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, aggregation: Aggregation = Aggregation(), *,
             parallel: Optional[Parallel] = None, count_mask: Optional[torch.Tensor] = None,
             segments: Optional[Segments] = None) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss over the valid (non-zero mask) tokens.

    * token-mean:              Σ_{i,t} ℓ / N_tok
    * token-sum:               Σ_{i,t} ℓ
    * seq-mean-token-sum:      Σ_i (Σ_t ℓ_it) / N_seq
    * seq-mean-token-mean:     Σ_i (Σ_t ℓ_it / n_i) / N_seq
    * seq-mean-token-sum-norm: Σ_i (Σ_t ℓ_it) / N_seq / S   (S = ``loss_scale_factor``, default T)

    (mode, N_tok, N_seq, S: :class:`Aggregation`.) N_tok / N_seq (sequences with ≥ 1 valid token)
    are the local counts unless ``global_num_tokens`` / ``global_num_seqs`` give the totals over all
    data-parallel ranks; with those under gradient averaging (DDP/FSDP) set ``dp_size`` = world
    size, so the averaged gradient is the global loss's. Denominators are at least 1: an all-masked
    batch gives exactly 0 (attached to the graph).

    ``count_mask``: the (B, T) tokens the denominators count (N_tok, n_i and the sequences of
    N_seq), when they are not ``loss_mask``'s: the response mask before rejection keeps rejected
    tokens and sequences counted with a zero loss (``loss_denominator="valid"``). Only tokens of
    ``loss_mask`` reach the numerator either way.

    ``parallel.cp_group``: every sequence is split across this group (context parallelism; see
    :func:`~rollout_correction_core.compute_rollout_correction`). The counts n_i are those of the whole
    sequences (one all-gather of B scalars) and the result is this rank's share: the shares add up
    over the group to the unsplit loss, and each rank's gradient is the unsplit gradient on its
    tokens. S must then be given (``scale_factor``): T here is only this rank's slice.

    ``segments``: :class:`Segments` with ``cu_seqlens`` for a packed (1, N) / (N,) ``loss_mat``: the
    sequences are those of ``cu_seqlens`` (and T, the default S, the longest of them or ``max_seqlen``).
    """
    sequence_group = as_parallel(parallel).cp_group
    _check_aggregation("agg_loss", "aggregation", aggregation, split=sequence_group is not None)
    check_same([("loss_mat", loss_mat), ("loss_mask", loss_mask), ("count_mask", count_mask)],
               float_names=("loss_mat",))
    valid = loss_mask.bool()
    counted = valid if count_mask is None else count_mask.bool()
    if sequence_group is not None:
        check_sequence_group(sequence_group)
    if sequence_group is None and aggregation.mode in ("token-mean", "token-sum"):
        n_row = None  # only the total is needed (token-mean), or nothing
    else:
        rows = RowExchange(sequence_group, describe("agg_loss", loss_agg_mode=aggregation.mode))
        for _ in rows.passes():
            n_row = rows.sum(counted.sum(-1, dtype=torch.float64))
    return _aggregate(loss_mat, valid, n_row, aggregation, counted=counted)


def _aggregate(loss_mat: torch.Tensor, valid: torch.Tensor, n_row: Optional[torch.Tensor], agg: Aggregation,
               counted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`agg_loss` with the per-row counted-token counts ``n_row`` (B,) of the whole sequences
    (None for token-mean / token-sum on whole sequences: the total of ``counted``, default ``valid``,
    is counted here); ``agg`` checked by :func:`_check_aggregation`."""
    loss_agg_mode, global_num_tokens, global_num_seqs = agg.mode, agg.global_num_tokens, agg.global_num_seqs
    dp_size, loss_scale_factor = agg.dp_size, agg.scale_factor
    lm = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-sum":
        return lm.sum() * dp_size if dp_size != 1 else lm.sum()
    if loss_agg_mode == "token-mean":
        local = (valid if counted is None else counted).sum(dtype=lm.dtype) if n_row is None else \
            n_row.to(lm.dtype).sum()
        loss = lm.sum() / _count(global_num_tokens, local)
    else:
        n_row = n_row.to(lm.dtype)
        seq = lm.sum(-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq = seq / n_row.clamp_min(1.0)
        loss = seq.sum() / _count(global_num_seqs, (n_row > 0).sum().to(lm.dtype))
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mat.shape[-1])
    return loss * dp_size if dp_size != 1 else loss


def ppo_clip_loss(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip: ClipRange = ClipRange()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with dual clip (module docstring; ε_lo, ε_hi, c from ``clip``): (loss
    (B, T), clipped (B, T) bool, the clipped branch is active, clipped_lower (B, T) bool, the dual
    clip is active)."""
    _check_clip("ppo_clip_loss", "clip", clip)
    clip_ratio_low, clip_ratio_high, clip_ratio_c = clip.low, clip.high, clip.dual
    ratio = (log_prob - prox_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    neg_adv = -advantages
    l1 = neg_adv * ratio
    l2 = neg_adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip1 = torch.maximum(l1, l2)
    l3 = advantages * -clip_ratio_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(l3, clip1), clip1)
    return loss, l2 > l1, (clip1 > l3) & negative


def _per_token_loss(loss_type: str, lp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor,
                    valid: torch.Tensor, clip: ClipRange, seq_values: Optional[dict[str, torch.Tensor]] = None):
    """(ℓ (B, T), clipped, clipped_lower) for ``loss_type`` (indicators None for REINFORCE; for TOPR
    (B,) the tapered sequences, and None); ``seq_values``: GSPO / TOPR per-sequence values given."""
    seq_values = seq_values or {}
    clip_ratio_low, clip_ratio_high, clip_ratio_c = clip.low, clip.high, clip.dual
    if loss_type == "reinforce":  # bypass mode only (the config refuses it in decoupled mode)
        return -adv * lp, None, None
    if loss_type == "ratio_pg":
        return ratio_pg_loss(lp, prox, adv), None, None
    if loss_type == "topr":
        return (*topr_loss(lp, prox, adv, valid, **seq_values), None)
    if loss_type == "gspo":
        pg, clipped = gspo_loss(lp, prox, adv, valid, clip_ratio_low, clip_ratio_high, **seq_values)
        return pg, clipped, torch.zeros_like(valid)
    if loss_type == "cispo":
        pg, clipped = cispo_loss(lp, prox, adv, clip_ratio_low, clip_ratio_high)
        return pg, clipped, torch.zeros_like(valid)
    if loss_type == "rollout_is":
        pg, outside = rollout_is_loss(lp, prox, adv, clip_ratio_low, clip_ratio_high)
        return pg, outside, torch.zeros_like(valid)
    if loss_type in ("dppo_tv", "dppo_kl"):
        return dppo_loss(lp, prox, adv, loss_type[5:], clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return ppo_clip_loss(lp, prox, adv, clip)


@packable("log_prob", "prox_log_prob", "advantages", "mask", "weights")
def policy_loss_term(log_prob: torch.Tensor, prox_log_prob: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, weights: Optional[torch.Tensor] = None, *, loss_type: LossType = "ppo_clip",
                     clip: ClipRange = ClipRange(), segments: Optional[Segments] = None
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The per-token loss ℓ_t of ``loss_type`` times sg(w_t), 0 outside ``mask``: PPO clip (module
    docstring), ``"reinforce"`` −A_t log π_θ(y_t), and GSPO / CISPO / DPPO / TOPR / rollout-IS
    (:mod:`~rollout_correction_core._src.policy_losses`); aggregate it with :func:`agg_loss`. All
    (B, T): ``log_prob`` log π_θ (with gradient), ``prox_log_prob`` π_prox (π_old, or π_rollout in
    bypass mode), ``advantages``, ``mask`` the tokens in the loss (after rejection), ``weights`` w_t
    (None: 1). Returns (ℓ, clipped, clipped_lower): the indicators of ``actor/pg_clipfrac`` /
    ``actor/pg_clipfrac_lower`` ((B, T) bool; None for REINFORCE; TOPR: (B,) tapered, None).
    ``segments`` with ``cu_seqlens``: packed (1, N) / (N,) inputs and per-token outputs (GSPO's and TOPR's
    sequences are those of ``cu_seqlens``).
    """
    check_same([("log_prob", log_prob), ("prox_log_prob", prox_log_prob), ("advantages", advantages),
                ("mask", mask), ("weights", weights)],
               float_names=("log_prob", "prox_log_prob", "advantages", "weights"))
    if loss_type not in get_args(LossType):
        raise ValueError(f"policy_loss_term: loss_type={loss_type!r} is invalid; allowed: {list(get_args(LossType))}")
    _check_clip("policy_loss_term", "clip", clip, loss_type)
    valid = mask.bool()
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    lp, prox, adv = (torch.where(valid, x, zero) for x in (log_prob, prox_log_prob.detach(), advantages.detach()))
    pg, clipped, clipped_lower = _per_token_loss(loss_type, lp, prox, adv, valid, clip)
    if weights is not None:
        pg = pg * torch.where(valid, weights.detach(), zero)
    return torch.where(valid, pg, zero), clipped, clipped_lower


class _LossRows:
    """Per-sequence sums over the tokens in the loss, of the whole sequences.

    ``keep`` (B, T) bool: this rank's tokens accepted at token level; ``total`` maps a (B, T)
    tensor that is 0 outside ``keep`` to its (B,) float64 sum over each whole sequence (over the
    sequence group when the rows are split, with the segment decisions applied after the
    reduction); ``row_keep`` (B,) bool or None, the sequence-level decisions; ``kept`` (B,) float32
    the number of tokens in the loss per sequence. With split rows a partial depends on this rank's
    tokens only, and every decision taken from a reduced value is applied to the reduced sum."""

    def __init__(self, keep: torch.Tensor, total: Callable[[torch.Tensor], torch.Tensor], kept: torch.Tensor,
                 row_keep: Optional[torch.Tensor] = None) -> None:
        self.keep, self.total, self.row_keep, self.kept = keep, total, row_keep, kept

    @classmethod
    def whole(cls, in_loss: torch.Tensor) -> "_LossRows":
        """Whole rows: ``in_loss`` is the final mask."""
        return cls(in_loss, lambda x: x.sum(-1, dtype=torch.float64), in_loss.sum(-1, dtype=torch.float32))

    @classmethod
    def split(cls, rows: RowExchange, valid: torch.Tensor, values: Optional[RowValues]) -> "_LossRows":
        """Rows split across ``rows.group``; ``values`` of the correction pass (None without one)."""
        if values is None:
            return cls(valid, lambda x: rows.sum(x.sum(-1, dtype=torch.float64)),
                       rows.sum(valid.sum(-1, dtype=torch.float32)))

        def total(x: torch.Tensor) -> torch.Tensor:  # (k, B, T) one part at a time: segments scatter per part
            if x.dim() == 2:
                return values.kept_total(x.double())
            return torch.stack([values.kept_total(p.double()) for p in x.unbind()])

        return cls(values.token_keep > 0, total, values.kept, values.row_keep)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) float64 Σ over each sequence's tokens in the loss of a detached (B, T) tensor; (k, B)
        for (k, B, T)."""
        out = self.total(torch.where(self.keep, x, 0.0))
        return out if self.row_keep is None else out * self.row_keep


def _actor_metrics(stats) -> dict[str, Value]:
    """``actor/*`` metrics from :func:`compute_policy_loss`'s sums: means over the tokens in the loss,
    the non-finite share over sequences with a valid input token."""
    out = {"actor/nonfinite_seq_fraction": stats.sum(ACTOR.bad_rows) / maximum(stats.sum(ACTOR.input_rows), 1.0)}
    n = maximum(stats.sum(ACTOR.n), 1.0)
    for stat in (ACTOR.ppo_kl, ACTOR.pg_clipfrac, ACTOR.pg_clipfrac_lower):
        if stats.has(stat):
            out["actor/" + stat.name] = stats.sum(stat) / n
    return out


@verified
@packable("log_prob", "old_log_prob", "advantages", "response_mask", "rollout_log_prob", "rollout_is_weights")
def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: Optional[torch.Tensor],
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Optional[RolloutCorrectionConfig] = None,
    rollout_log_prob: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    loss: PolicyLoss = PolicyLoss(),
    parallel: Optional[Parallel] = None,
    segments: Optional[Segments] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss with rollout correction, in the mode ``config`` selects.

    Decoupled (``config.bypass_mode`` False): PPO clip against ``old_log_prob``, the per-token loss
    multiplied by ``rollout_is_weights`` if given, else by the correction (weights and rejection
    mask) of ``old_log_prob`` vs ``rollout_log_prob`` computed here; with neither, plain PPO, and a
    config that asks for a correction or its diagnostics raises ConfigError naming the missing input.

    Bypass (``config.bypass_mode`` True): π_old := π_rollout (``rollout_log_prob``, or
    ``old_log_prob`` when the trainer already substituted it); the correction of π_θ (``log_prob``,
    without gradient) vs π_rollout is computed here and its rejection mask always applies.
    ``loss_type="ppo_clip"`` uses no IS weights; ``"reinforce"`` is −sg(w)·A·log π_θ.

    Whole and split rows take one path: every per-sequence value (the GSPO / TOPR sequence ratio
    and advantage, the token counts of the denominators, the ``actor/*`` sums) is a sum over the
    sequence's tokens in the loss, taken over the sequence group when there is one.

    Args:
        log_prob: (B, T) log π_θ, with gradient.
        old_log_prob: (B, T) log π_old (may be None in bypass mode when rollout_log_prob is given).
        advantages: (B, T) advantages.
        response_mask: (B, T) bool or 0/1 mask of valid tokens.
        config: :class:`RolloutCorrectionConfig` (None: plain decoupled PPO, metrics only).
        rollout_log_prob: (B, T) log π_rollout.
        rollout_is_weights: (B, T) precomputed IS weights (decoupled mode); detached here.
        loss: :class:`PolicyLoss`, the clip range (ε_lo, ε_hi, c) and the :class:`Aggregation` (see
            :func:`agg_loss`); rejected tokens are not counted in local denominators unless
            ``config.loss_denominator`` is ``"valid"`` (then every valid token of ``response_mask`` is).
        parallel: :class:`Parallel`; the correction statistics are reduced over ``dp_group``.
            ``cp_group``: every sequence is split across this group (context parallelism, as for
            :func:`~rollout_correction_core.compute_rollout_correction`). One all-gather of (B, k)
            per-row scalars serves the non-finite check, the correction, the denominators and the
            ``actor/*`` metrics; the loss is this rank's share (see :func:`agg_loss`).
        segments: :class:`Segments`, for ``rollout_is="segment"`` and the ``segment_*`` rejection
            options, as for :func:`~rollout_correction_core.compute_rollout_correction`.
    Returns:
        (loss, metrics): scalar loss; 0-d tensors ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower`` (PPO), ``actor/nonfinite_seq_fraction`` (over this data-parallel
        rank's sequences) and, when the correction was computed here, every ``rollout_corr/*``
        metric (over the whole batch of ``dp_group``).
    """
    config = as_config(config)
    parallel = as_parallel(parallel)
    process_group, sequence_group = parallel.dp_group, parallel.cp_group
    bypass = config.bypass_mode
    if not isinstance(loss, PolicyLoss):
        raise TypeError(f"compute_policy_loss: loss={loss!r} is not a PolicyLoss; pass PolicyLoss(clip, aggregation)")
    _check_clip("compute_policy_loss", "loss.clip", loss.clip,
                config.loss_type if bypass or config.loss_type != "reinforce" else "ppo_clip")
    _check_aggregation("compute_policy_loss", "loss.aggregation", loss.aggregation, split=sequence_group is not None)
    if bypass:
        rollout = rollout_log_prob if rollout_log_prob is not None else old_log_prob
        if rollout is None:
            raise ValueError("bypass mode needs rollout_log_prob (or old_log_prob set to the rollout log-probs)")
        prox = rollout
    else:
        if old_log_prob is None:
            raise ValueError("decoupled mode needs old_log_prob; set bypass_mode=True to clip against "
                             "rollout_log_prob instead")
        rollout, prox = rollout_log_prob, old_log_prob
        if rollout is None and rollout_is_weights is None:
            _refuse_uncorrected(config)
    check_same([("log_prob", log_prob), ("old_log_prob" if not bypass else "rollout_log_prob", prox),
                ("advantages", advantages), ("response_mask", response_mask),
                ("rollout_log_prob", rollout_log_prob), ("rollout_is_weights", rollout_is_weights)],
               float_names=("log_prob", "old_log_prob", "rollout_log_prob", "advantages", "rollout_is_weights"))
    if config.on_nonfinite == "raise" and (process_group is not None or sequence_group is not None):
        raise_nonfinite_on_any_rank(_nonfinite_inputs(response_mask, log_prob, prox, rollout, advantages,
                                                      rollout_is_weights, config), "loss input",
                                    process_group, sequence_group)
    owner = None
    if sequence_group is not None:
        if config.rollout_opsm_delta is not None or config.rollout_m2po_threshold is not None:
            raise ValueError(f"rollout_opsm_delta={config.rollout_opsm_delta!r}, rollout_m2po_threshold="
                             f"{config.rollout_m2po_threshold!r}: OPSM and M2PO are not available in "
                             "compute_policy_loss with sequence_group; disable them there, or gather whole "
                             "sequences on one rank")
        check_sequence_group(sequence_group)
        owner = stats_owner(sequence_group, process_group)
    rows = RowExchange(sequence_group, describe("compute_policy_loss", config, loss_agg_mode=loss.aggregation.mode,
                                                max_segments=None if segments is None else segments.count),
                       config.families)
    for _ in rows.passes():  # one pass for whole rows; collect and replay for split rows
        result = _policy_loss_pass(log_prob, prox, rollout, advantages, response_mask, rollout_is_weights, config,
                                   loss, parallel, rows, owner, segments)
    return result


def _refuse_uncorrected(config: RolloutCorrectionConfig) -> None:
    """Decoupled mode without ``rollout_log_prob`` or ``rollout_is_weights`` is plain PPO: a config that asks
    for a correction or its diagnostics then raises ConfigError naming what is missing."""
    asked = [f"{k}={getattr(config, k)!r}" for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold",
             "rollout_token_veto_threshold_high", "rollout_m2po_threshold", "expect_zero_atol")
             if getattr(config, k) is not None] + [f"{k}=True" for k in ("check_alignment", "mismatch_metrics")
                                                  if getattr(config, k)]
    if asked:
        raise ConfigError(f"compute_policy_loss got neither rollout_log_prob nor rollout_is_weights, but the config "
                          f"sets {', '.join(asked)}: pass rollout_log_prob (the correction is computed here) or "
                          "rollout_is_weights (computed before, with the response mask it returned)")


def _nonfinite_inputs(response_mask, log_prob, prox, rollout, advantages, rollout_is_weights, config) -> torch.Tensor:
    """(B, T) bool: valid positions where an input the loss reads is not finite, or where the
    log-ratio against the rollout log-probs is (the positions that raise with ``on_nonfinite="raise"``)."""
    bad = ~torch.isfinite(log_prob.detach()) | ~torch.isfinite(prox) | ~torch.isfinite(advantages)
    if config.log_prob_ceiling is not None:  # no probability
        bad |= torch.maximum(log_prob.detach(), prox) > config.log_prob_ceiling
    if rollout_is_weights is not None:
        bad |= ~torch.isfinite(rollout_is_weights)
    if rollout is not None:
        bad |= nonfinite_positions(prox, rollout, response_mask, config.log_prob_floor, config.log_prob_ceiling)
    return bad & (response_mask != 0)


def _policy_loss_pass(log_prob, prox, rollout, advantages, response_mask, rollout_is_weights,
                      config: RolloutCorrectionConfig, s: PolicyLoss, parallel: Parallel, rows: RowExchange, owner,
                      segments: Optional[Segments]):
    """One pass of :func:`compute_policy_loss`: the only one for whole rows (``rows`` local); for
    rows split across ``rows.group`` the collect pass makes the reductions only (returns None) and
    the replay pass builds loss and metrics."""
    bypass, process_group = config.bypass_mode, parallel.dp_group
    # Drop (or refuse) rows with a non-finite value at a valid position; sanitise the rest. The
    # inputs are checked and masked stacked: one where, one max |x| per row over all of them.
    input_valid = response_mask.bool()
    B, T = input_valid.shape
    inputs = torch.stack([log_prob.detach(), prox, advantages]
                         + ([rollout_is_weights.detach()] if rollout_is_weights is not None else []))
    if inputs.dtype != torch.float32:
        inputs = inputs.float()
    zero = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    masked = torch.where(input_valid, inputs, zero)
    if T > 0:
        bad_rows = ~(masked.abs().amax(dim=(0, 2)) < math.inf)  # NaN compares False
    else:
        bad_rows = torch.zeros(B, dtype=torch.bool, device=log_prob.device)
    floor = config.log_prob_floor if rollout is not None else None
    # a log-prob above the ceiling (no probability) or an engine sentinel drops its row, as in the correction
    ceiling = config.log_prob_ceiling
    sentinel = torch.maximum(masked[0], masked[1]) > ceiling if ceiling is not None else input_valid & False
    if rollout is not None and ceiling is not None:
        sentinel |= input_valid & (rollout > ceiling)
    if floor is not None:
        sentinel |= input_valid & ((prox <= floor) | (rollout <= floor))
    bad_rows = rows.max(bad_rows | sentinel.any(-1))
    input_rows = rows.max(input_valid.any(-1))
    rows.drop(bad_rows)
    if config.on_nonfinite == "raise" and rows.final:
        what = (f"log_prob / {('old_log_prob', 'rollout_log_prob')[bypass]} / advantages"
                f"{' / rollout_is_weights' if rollout_is_weights is not None else ''}")
        if rows.group is not None:  # raised on every rank of the group alike
            raise_nonfinite(bad_rows, what)
        pos = first_nonfinite(input_valid & ~torch.isfinite(masked).all(0) | sentinel)
        if pos is not None:
            raise ValueError(f"non-finite {what} (or a log-prob > log_prob_ceiling={ceiling}, or ≤ log_prob_floor={floor}) "
                             f"at valid position (row {pos[0]}, column {pos[1]}); set on_nonfinite='reject' to "
                             "drop such rows")
    valid = input_valid.masked_fill(bad_rows.unsqueeze(-1), False)
    clean = torch.where(valid, masked, zero)
    prox_s, adv = clean[1], clean[2]
    lp = torch.where(valid, log_prob.float(), zero)  # with gradient
    metrics = Metrics()  # derived on demand from packed statistics: no kernel per metric, no sync

    weights, mask, values = None, valid, None
    if rollout is not None and (bypass or rollout_is_weights is None):
        train_side = lp.detach() if bypass else prox_s
        if rows.group is None:
            corr = compute_rollout_correction(train_side, rollout, valid, config=config,
                                              parallel=dataclasses.replace(parallel, cp_group=None), segments=segments,
                                              advantages=adv)
        else:
            with torch.no_grad():
                seg = (segments.ids, segments.count) if segments is not None else (None, None)
                corr, values = correction_pass(train_side, rollout, valid, config, process_group, rows, owner, *seg, adv)
        mask, weights = corr.response_mask.bool(), corr.weights
        metrics.update(corr.metrics)
    if rollout_is_weights is not None and not bypass:
        weights = clean[3]
    # OPSM (whole rows only: refused with a sequence group), its collective as the group agreed
    delta = agreed_setting(latest(process_group), "rollout_opsm_delta", config.rollout_opsm_delta)
    if delta is not None:
        behaviour = rollout if rollout is not None else prox_s
        row_keep, opsm = compute_opsm(lp, behaviour, adv, mask, float(delta), process_group)
        mask = mask & row_keep.unsqueeze(-1)
        metrics.update(prefixed(opsm))
    in_loss = _LossRows.whole(mask) if rows.group is None else _LossRows.split(rows, valid, values)
    kept = in_loss.kept
    # loss_denominator="valid": each sequence counts its valid tokens, rejected ones included (a row
    # dropped for a non-finite value is out of the batch either way)
    counted = rows.sum(valid.sum(-1, dtype=torch.float32)) if config.loss_denominator == "valid" else kept

    seq_values: dict[str, torch.Tensor] = {}
    if config.loss_type == "gspo":  # mean log r over the sequence's tokens in the loss
        seq_values["seq_log_ratio"] = in_loss.sum(lp.detach() - prox_s) / kept.clamp_min(1)
    elif config.loss_type == "topr":  # Σ log r and the mean advantage
        sums = in_loss.sum(torch.stack([lp.detach() - prox_s, adv]))
        seq_values["seq_log_ratio_sum"], seq_values["seq_advantage"] = sums[0], sums[1] / kept.clamp_min(1)
    loss_type = config.loss_type if bypass or config.loss_type != "reinforce" else "ppo_clip"
    pg, clipped, clipped_lower = _per_token_loss(loss_type, lp, prox_s, adv, mask, s.clip, seq_values)
    if weights is not None and (not bypass or config.loss_type == "reinforce"):
        pg = pg * weights.detach()  # bypass PPO-clip / GSPO / …: the ratio to π_rollout is the correction

    # actor/* sums: per sequence over its tokens in the loss, then over this rank's sequences. The
    # GSPO / TOPR indicators depend on the sequence's value: counted per sequence from the reduced sums.
    token_parts = [prox_s - lp.detach()]
    if config.loss_type == "gspo":
        token_parts += [adv > 0, adv < 0]
    elif clipped is not None and config.loss_type != "topr":
        token_parts += [clipped, clipped_lower]
    per_row = list(in_loss.sum(torch.stack(token_parts)).unbind())
    if config.loss_type == "gspo":
        ratio = seq_values["seq_log_ratio"].float().clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        above, below = ratio > 1.0 + s.clip.high, ratio < 1.0 - s.clip.low
        per_row = [per_row[0], per_row[1] * above + per_row[2] * below, torch.zeros_like(kept)]
    elif config.loss_type == "topr":
        per_row += [kept * clipped, torch.zeros_like(kept)]  # clipped: the tapered sequences
    declared = [ACTOR.ppo_kl] + ([ACTOR.pg_clipfrac, ACTOR.pg_clipfrac_lower] if len(per_row) > 1 else [])
    if not rows.final:
        return None
    sums = torch.stack(per_row + [kept, input_rows, bad_rows]).sum(-1)  # a bad row has a valid input token
    actor = SufficientStats.from_vector(declared + [ACTOR.n, ACTOR.input_rows, ACTOR.bad_rows], sums)
    metrics.add_derived(actor, _actor_metrics, prefix="")
    loss = _aggregate(pg, mask, counted, s.aggregation)
    return loss, metrics
