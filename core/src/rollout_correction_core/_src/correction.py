"""The correction pipeline: log-ratio → weights / rejection masks → statistics → metrics.

One call makes one pass over its inputs to build the log-ratio and the per-row reductions the
config needs, records every statistic locally, reduces them over the process group (≤ 2
collectives), and derives the batch-normalisation factor and all metrics from the reduced values.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from .alignment import MisalignmentWarning, alignment_metrics, alignment_report, alignment_statistics
from .config import RolloutCorrectionConfig, as_config
from .declared import ALIGN, COUNTS, EXPECT_ZERO, RS
from .logratio import LogRatioBatch, RowSums, bounds_log_probs, float_mask, log_ratio_batch, nonfinite_positions
from .m2po import m2po_keep, second_moment
from .packing import packable
from .parallel import Parallel, as_parallel, verified
from .segments import Segments
from .metrics import (Accumulator, Metrics, add_offpolicy_statistics, add_row_statistics, metrics_to_floats,
                      nonfinite_metrics, offpolicy_metrics, prefixed)
from .rejection import RejectionResult, rejection_keep, rs_metrics, veto_metrics
from .sequence_group import (RowExchange, check_sequence_group, describe, group_ranks, raise_nonfinite,
                             raise_nonfinite_on_any_rank, reduce_owned,
                             stats_owner)
from .agreement import agreed_setting
from .stats import SufficientStats, Value, maximum, safe_div
from .validation import check_pair, check_segment_ids, first_nonfinite
from .weights import ISWeights, add_is_statistics, batch_norm_factor, importance_weights, is_metrics

__all__ = ["CorrectionOutput", "compute_rollout_correction", "CorrectionAccumulator", "BatchHook", "local_correction",
           "correction_metrics", "correction_pass", "RowValues", "MismatchError", "MismatchWarning"]


class MismatchError(ValueError):
    """Expect-zero mode: old and rollout log-probs differ by more than ``expect_zero_atol``."""


class MismatchWarning(UserWarning):
    """Expect-zero mode with ``expect_zero_action="warn"``: the tolerance was exceeded."""


@dataclass
class CorrectionOutput:
    """Result of :func:`compute_rollout_correction`: ``weights`` (B, T) float32 IS weights (detached,
    0 at padding and at rows dropped for non-finite input; None without ``rollout_is``);
    ``response_mask`` (B, T), the input mask (and dtype) with rejected tokens set to 0; ``metrics``
    ``rollout_corr/<name>`` → 0-d tensor, a :class:`~rollout_correction_core._src.metrics.Metrics` mapping
    that derives the tensors on first access (on the device, without a sync)."""

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def metrics_as_floats(self) -> dict[str, float]:
        """All metrics as Python floats, derived on the host in float64 after one device sync."""
        return metrics_to_floats(self.metrics)


def local_correction(batch: LogRatioBatch, config: RolloutCorrectionConfig, stats: SufficientStats,
                     advantages: Optional[torch.Tensor] = None, per_row=True) -> tuple[Optional[ISWeights], RejectionResult]:
    """Weights (before batch normalisation), keep masks, and the local statistics of ``config``'s metric
    families and of its decisions (``advantages`` (B, T) or (B,): for
    ``rollout_rs_rejected_positive_fraction``; ``per_row``: :func:`add_offpolicy_statistics`')."""
    isw, families = None, config.families
    if config.is_spec is not None:
        isw = importance_weights(batch, config.is_spec)
        add_is_statistics(stats, batch, config.is_spec, isw, families)
    rej = rejection_keep(batch, config.rs_options, config.rollout_token_veto_threshold,
                         stats if "default" in families else None, config.rollout_token_veto_threshold_high)
    add_offpolicy_statistics(stats, batch, per_row=per_row, families=families)
    if config.rs_enabled or advantages is not None:  # rows every criterion rejects in full, and their outcome
        full = (rej.kept_per_row(batch) == 0) & batch.row_valid
        stats.add(RS.rejected_rows, full)
        if advantages is not None and "default" in families:
            adv = advantages if advantages.dim() == 1 else batch.row_total(
                torch.where(batch.valid, advantages.float(), 0.0)) / batch.n_row.clamp_min(1.0)
            stats.add(RS.rejected_positive, full & (adv > 0))
    if "expect_zero" in families:  # max |old − rollout| over valid input tokens, non-finite as 1e30
        stats.add(EXPECT_ZERO.max_abs, batch.gap_row)
    if config.check_alignment:
        sums = alignment_statistics(batch.old_log_prob, batch.rollout_log_prob, batch.response_mask)
        for stat, value in zip(ALIGN, sums.unbind()):
            stats.add(stat, value)
    return isw, rej


def _block_pass(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                config: RolloutCorrectionConfig, row_offset: int = 0, segment_ids: Optional[torch.Tensor] = None,
                max_segments: Optional[int] = None, advantages: Optional[torch.Tensor] = None, rows=None):
    """Everything that touches (B, T) data: weights before normalisation, keep mask, local statistics
    (given a list ``rows``, not :func:`add_row_statistics`'; the block's row sums are appended to it)."""
    batch = log_ratio_batch(old_log_prob, rollout_log_prob, response_mask, on_nonfinite=config.on_nonfinite,
                            row_offset=row_offset, segment_ids=segment_ids, max_segments=max_segments,
                            log_prob_floor=config.log_prob_floor, log_prob_ceiling=config.log_prob_ceiling)
    stats = SufficientStats()
    batch.add_counts(stats, config.families)
    isw, rej = local_correction(batch, config, stats, advantages, per_row=rows is None)
    if rows is not None:
        rows.append((*batch.sums, batch.row_valid))
    return (isw.weights if isw is not None else None), rej.keep_mask(batch), stats


def _local_pass(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                segment_ids: Optional[torch.Tensor], max_segments: Optional[int], config: RolloutCorrectionConfig,
                advantages: Optional[torch.Tensor] = None):
    """:func:`_block_pass` on the whole batch with each statistic reduced: pure tensor code in and
    out, so torch.compile can fuse it."""
    weights, keep, stats = _block_pass(old_log_prob, rollout_log_prob, response_mask, config,
                                       segment_ids=segment_ids, max_segments=max_segments, advantages=advantages)
    return (weights, keep, *stats.each_reduced())


@dataclass
class RowValues:
    """Per-sequence values of the whole (unsplit) sequences on every rank of the sequence group.

    kept: (B,) valid tokens every rejection criterion accepts; token_keep: (B, T_local) float 0/1,
    this rank's valid tokens the token-level criteria accept (the final mask is ``token_keep ·
    row_keep`` times the segment-level decisions); row_keep: (B,) bool, rows the sequence-level
    criteria and the veto accept;
    dropped: (B,) bool, rows dropped for a non-finite value; weights: (B, T_local) IS weights before
    batch normalisation (None without IS); row_weight: (B,) bounded per-row weight at sequence /
    geometric level (None at token level). A partial passed to the exchange must depend on this
    rank's tokens only: apply ``row_keep`` / ``row_weight`` to the reduced value, and sum over the
    accepted tokens with :meth:`kept_total` (which applies the segment decisions after the reduction).
    """

    kept: torch.Tensor
    token_keep: torch.Tensor
    row_keep: torch.Tensor
    dropped: torch.Tensor
    weights: Optional[torch.Tensor] = None
    row_weight: Optional[torch.Tensor] = None
    batch: Optional[LogRatioBatch] = None
    rejection: Optional[RejectionResult] = None

    def kept_total(self, x: torch.Tensor) -> torch.Tensor:
        """(B,) group Σ of a (B, T_local) tensor that is 0 outside ``token_keep``, over the tokens
        the segment-level criteria accept too (``row_keep`` not applied)."""
        return self.rejection.kept_total(self.batch, x)


def correction_pass(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    config: RolloutCorrectionConfig, process_group: Optional[object], rows: RowExchange,
                    owner: Optional[bool], segment_ids: Optional[torch.Tensor] = None,
                    max_segments: Optional[int] = None,
                    advantages: Optional[torch.Tensor] = None) -> tuple[CorrectionOutput, RowValues]:
    """One pass of the correction over sequences split across ``rows.group``: placeholders in the
    collect pass, final in the replay pass (statistics reduced over ``process_group``, counted on
    the ranks ``owner`` selects, see :func:`~rollout_correction_core._src.sequence_group.stats_owner`)."""
    if segment_ids is not None and max_segments is None:
        raise ValueError("segment_ids with sequence_group needs max_segments: each rank holds a different "
                         "number of columns, and the per-segment partials must have one shape on every rank")
    if config.check_alignment:
        raise ValueError("check_alignment compares adjacent tokens and cannot run on sequences split across "
                         "sequence_group; run the alignment check on whole sequences (rollout-correction "
                         "diagnose, or a call without sequence_group) and set check_alignment=False here")
    batch = log_ratio_batch(old_log_prob, rollout_log_prob, response_mask, on_nonfinite=config.on_nonfinite, rows=rows,
                            segment_ids=segment_ids, max_segments=max_segments, log_prob_floor=config.log_prob_floor,
                            log_prob_ceiling=config.log_prob_ceiling)
    stats = SufficientStats()
    batch.add_counts(stats, config.families)
    isw, rej = local_correction(batch, config, stats, advantages)
    weights = isw.weights if isw is not None else None
    keep = rej.keep_mask(batch)
    token_keep = batch.mask if rej.token_keep is None else batch.mask * rej.token_keep
    values = RowValues(rej.kept_per_row(batch), token_keep, rej.rows(batch), batch.bad_rows, weights,
                       isw.row_weight if isw is not None else None, batch, rej)
    if not rows.final:
        return CorrectionOutput(weights, keep), values
    if config.on_nonfinite == "raise":
        raise_nonfinite(batch.bad_rows)
    if config.rollout_m2po_threshold is None or process_group is None:
        groups = (rows.group,)
    elif set(group_ranks(rows.group)) <= set(group_ranks(process_group)):  # data-parallel group with CP
        groups = (process_group,)
    else:
        groups = (process_group, rows.group)
    reduced = reduce_owned(stats, process_group, owner, _what(config, advantages))  # agreed before M2PO's
    out = _finish(reduced, None if weights is None else weights.clone(), keep, old_log_prob, rollout_log_prob,
                  config, groups, response_mask.dtype)
    out = _checked(out, config, reduced, old_log_prob, rollout_log_prob, response_mask)
    return out, values


#: The eager pass walks the batch in blocks of about this many tokens (512 KiB per float32
#: temporary): peak memory does not grow with the batch beyond the outputs. The statistics of all
#: blocks are joined and reduced once, as one block's would be.
#: (256x4096 fp32 on a 2-core EPYC: 2^18-token blocks ran about 10 % faster but took 15 MiB of peak
#: memory for token TIS instead of 11.5, less than 3x below verl's 43.)
BLOCK_TOKENS = 1 << 17
#: On an accelerator the blocks are larger (64 MiB per float32 temporary): each block costs its own
#: kernel launches, and memory bandwidth, not cache, is what it must saturate (H100, 1024x32768:
#: 4M-token blocks ran eager at 0.5-1.0x verl's speed, 16M-token blocks at 1.9-3.1x).
DEVICE_BLOCK_TOKENS = 1 << 24


def block_tokens(device: torch.device) -> int:
    """Tokens per block of the eager pass on ``device``."""
    return BLOCK_TOKENS if device.type == "cpu" else DEVICE_BLOCK_TOKENS


def _blocked_local_pass(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                        config: RolloutCorrectionConfig, segment_ids: Optional[torch.Tensor] = None,
                        max_segments: Optional[int] = None, advantages: Optional[torch.Tensor] = None):
    """:func:`_local_pass` over blocks of whole rows, writing into the outputs."""
    check_pair(old_log_prob, rollout_log_prob, response_mask)
    B, T = old_log_prob.shape
    rows = max(1, block_tokens(old_log_prob.device) // max(T, 1))
    if B <= rows:
        return _block_pass(old_log_prob, rollout_log_prob, response_mask, config, segment_ids=segment_ids,
                           max_segments=max_segments, advantages=advantages)
    device = old_log_prob.device
    weights = torch.empty((B, T), device=device) if config.is_spec is not None else None
    keep = torch.empty((B, T), dtype=response_mask.dtype, device=device)
    blocks, row_parts = [], []  # the per-row statistics are derived once, from every block's row sums
    for start in range(0, B, rows):
        block = slice(start, start + rows)
        seg = segment_ids[block] if segment_ids is not None else None
        seg_count = T if seg is not None and max_segments is None else max_segments  # the whole batch's S
        w, keep[block], local = _block_pass(old_log_prob[block], rollout_log_prob[block], response_mask[block],
                                            config, row_offset=start, segment_ids=seg, max_segments=seg_count,
                                            advantages=None if advantages is None else advantages[block], rows=row_parts)
        if weights is not None:
            weights[block] = w
        blocks.append(local)
    stats, per_row = SufficientStats.joined(blocks), [torch.cat(x) for x in zip(*row_parts)]
    add_row_statistics(stats, RowSums(*per_row[:-1]), per_row[-1], config.families,
                       bounds_log_probs(config.log_prob_floor, config.log_prob_ceiling))
    return weights, keep, stats  # reduced once, over all rows


#: How many compiled per-token passes are kept, one per config, the least recently used dropped first.
#: All of them compile the same function (no copy of its code), so torch's own limit on the
#: recompilations of one function applies too (``recompile_limit`` of ``torch._dynamo.config``, 8 by
#: default, counting configs and input shapes alike): past it, torch runs the pass of a further config
#: eagerly, with its warning, and the results are the same.
COMPILE_CACHE_SIZE = 8
_COMPILED: "OrderedDict[RolloutCorrectionConfig, Callable]" = OrderedDict()


def _compiled_local_pass(config: RolloutCorrectionConfig) -> Callable:
    """The compiled per-token pass for ``config`` (:data:`COMPILE_CACHE_SIZE`)."""
    fn = _COMPILED.pop(config, None)
    if fn is None:
        def local(old_log_prob, rollout_log_prob, response_mask, segment_ids, max_segments, advantages):
            return _local_pass(old_log_prob, rollout_log_prob, response_mask, segment_ids, max_segments, config,
                               advantages)

        fn = torch.compile(local)
    _COMPILED[config] = fn
    while len(_COMPILED) > COMPILE_CACHE_SIZE:
        _COMPILED.popitem(last=False)
    return fn


def _finish(stats: SufficientStats, weights: Optional[torch.Tensor], keep: torch.Tensor, old_log_prob: torch.Tensor,
            rollout_log_prob: torch.Tensor, config: RolloutCorrectionConfig, groups: tuple,
            mask_dtype: torch.dtype) -> CorrectionOutput:
    """Whole and split rows alike, from the reduced ``stats``: the metrics, batch normalisation (of
    ``weights`` in place) and M2PO among the kept tokens (batch-global over ``groups``)."""
    metrics = Metrics.derived(stats, functools.partial(correction_metrics, config=config))
    if weights is not None and config.is_spec.batch_normalize:
        weights = weights.div_(batch_norm_factor(stats, config.is_spec))
    if stats.verdict is not None:  # the ranks' agreement is not known here: nothing is learned unless they agreed
        keep = keep * stats.verdict.factor()
        weights = None if weights is None else weights.mul_(stats.verdict.factor())
    # M2PO's collectives run as the group agreed (this rank's own setting unless it is known to differ)
    tau = agreed_setting(stats.verdict, "rollout_m2po_threshold", config.rollout_m2po_threshold)
    if tau is not None:
        kept = keep > 0
        keep, m2po = m2po_keep(second_moment(old_log_prob, rollout_log_prob, kept), kept, float(tau), groups)
        if config.rollout_m2po_threshold is not None:
            metrics.update(prefixed(m2po))
    return CorrectionOutput(weights, keep.to(mask_dtype), metrics)


def _what(config: RolloutCorrectionConfig, advantages: Optional[torch.Tensor]) -> list[str]:
    """What the ranks of a call's reduction agree on: the kind of call (with advantages, as the loss
    makes it, or without: each kind keeps its own agreement, so that the two can alternate on a group),
    and every configuration key."""
    return describe("compute_rollout_correction" + (" with advantages" if advantages is not None else ""), config)


def correction_metrics(stats, config: RolloutCorrectionConfig) -> dict[str, Value]:
    """Every metric of ``config``'s families from reduced statistics (unprefixed names): 0-d tensors
    from a :class:`SufficientStats`, Python floats from a :class:`~rollout_correction_core._src.stats.HostStats`."""
    m: dict[str, Value] = {}
    families = config.families
    if config.is_spec is not None:
        m.update(is_metrics(stats, config.is_spec, families))
    low, high = config.rollout_token_veto_threshold is not None, config.rollout_token_veto_threshold_high is not None
    if "default" in families:
        m.update(rs_metrics(stats, config.rs_options))
        m.update(veto_metrics(stats, low, high) if low or high else {})
    m.update(offpolicy_metrics(stats, families))
    m.update(nonfinite_metrics(stats))
    m.update(_outcome_metrics(stats, config))
    if stats.has(EXPECT_ZERO.max_abs):
        m["max_abs_log_ratio"] = maximum(stats.max(EXPECT_ZERO.max_abs), 0.0)
    if config.check_alignment:
        m.update(alignment_metrics(stats, prefix=""))
    return m


def _outcome_metrics(stats, config: RolloutCorrectionConfig) -> dict[str, Value]:
    """``rollout_rs_rejected_positive_fraction``: share of the fully rejected rows whose advantage is
    > 0 (0 when none is). Read on the host, warns when every row is rejected (``rollout_rs_all_rejected``)."""
    if not stats.has(RS.rejected_rows):
        return {}
    rejected, n = stats.sum(RS.rejected_rows), stats.sum(COUNTS.n_rows)
    if isinstance(n, float) and 0 < n <= rejected and config.rollout_rs_all_rejected == "warn":
        warnings.warn(_ALL_REJECTED.format(int(n)) + " (rollout_rs_all_rejected='raise' makes it an error)",
                      RuntimeWarning, stacklevel=2)
    if not stats.has(RS.rejected_positive):
        return {}
    return {"rollout_rs_rejected_positive_fraction": safe_div(stats.sum(RS.rejected_positive), rejected)}


_ALL_REJECTED = ("rejection dropped all {} sequences of the batch: nothing is learned from it; loosen rollout_rs / "
                 "the veto, or check the engines")


def _checked(out: CorrectionOutput, config: RolloutCorrectionConfig, stats, old: torch.Tensor, rollout: torch.Tensor,
             response_mask: torch.Tensor) -> CorrectionOutput:
    """The host-side checks the config asks for (one host read each): every row rejected with
    ``rollout_rs_all_rejected="raise"``; expect-zero mode's tolerance, and its output (weights 1)."""
    if config.rs_enabled and config.rollout_rs_all_rejected == "raise":
        n = float(stats.sum(COUNTS.n_rows))
        if 0 < n <= float(stats.sum(RS.rejected_rows)):
            raise ValueError(_ALL_REJECTED.format(int(n)) + " (rollout_rs_all_rejected='warn' only warns)")
    atol = config.expect_zero_atol
    if atol is None:
        return out
    worst = float(stats.max(EXPECT_ZERO.max_abs))
    if worst > atol:
        diff = (old.float() - rollout.float()).abs()
        pos = first_nonfinite((response_mask != 0) & ~(diff <= atol))
        at = "on another rank" if pos is None else (f"first at row {pos[0]}, column {pos[1]} (old_log_prob="
                                                   f"{old[pos].item()}, rollout_log_prob={rollout[pos].item()})")
        msg = (f"expect_zero_atol={atol}: max |old_log_prob − rollout_log_prob| over the valid tokens is {worst:.6g}, "
               f"{at}; the engines were expected to agree")
        if config.expect_zero_action == "raise":
            raise MismatchError(msg)
        warnings.warn(msg, MismatchWarning, stacklevel=3)
    return CorrectionOutput(float_mask(response_mask), response_mask, out.metrics)


@verified
@packable("old_log_prob", "rollout_log_prob", "response_mask", "advantages")
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: Optional[RolloutCorrectionConfig] = None,
    parallel: Optional[Parallel] = None,
    compile: bool = False,
    segments: Optional[Segments] = None,
    advantages: Optional[torch.Tensor] = None,
) -> CorrectionOutput:
    """IS weights, rejection-adjusted response mask and diagnostics for one batch.

    log ρ_t = old_log_prob − rollout_log_prob on valid tokens; weights as in
    :mod:`~rollout_correction_core._src.weights`, rejection and veto as in
    :mod:`~rollout_correction_core._src.rejection`, then M2PO among the tokens they keep
    (:mod:`~rollout_correction_core._src.m2po`: batch-global over ``dp_group``, 32 small all-reduces).

    Args:
        old_log_prob: (B, T) π_old log-probs (decoupled mode) or π_θ log-probs (bypass mode);
            any float dtype, computed in float32.
        rollout_log_prob: (B, T) log-probs of the sampling engine.
        response_mask: (B, T) bool or 0/1 mask of valid tokens.
        config: a :class:`RolloutCorrectionConfig`; None means metrics only.
        parallel: :class:`Parallel` (None: one process, whole rows): weights, masks and every metric
            are those of the whole batch, one process's result; with a ``cp_group`` the (B, T_local)
            outputs cover this rank's tokens, and ``check_alignment`` raises.
        compile: run the per-token pass through ``torch.compile`` (compiled once per config and kept
            for the :data:`COMPILE_CACHE_SIZE` most recent configs; not with ``cp_group``, which runs
            eagerly). Equal to eager up to the order of float32 sums: masks equal, weights within
            rtol 1e-6 / atol 1e-7, metrics within 1e-6 + 1e-5·|value| (docs/api.md, "compile=True
            against eager"; a statistic within rounding of its threshold may decide differently).
        segments: :class:`Segments` of multi-turn rows, for ``rollout_is="segment"`` and the
            ``segment_*`` rejection options (None: every row is one segment). Per-segment values
            are (B, ``segments.count``) tensors, so no shape depends on the data. With
            ``segments.cu_seqlens`` the inputs are packed, (1, N) or (N,), and so are the weights and
            the mask (:mod:`~rollout_correction_core._src.packing`); ``advantages`` then (1, N), (N,) or (B,).
        advantages: optional (B, T) or (B,) advantages (a row's is its mean over valid tokens): with
            them ``rollout_rs_rejected_positive_fraction``, the share of fully rejected rows with A > 0.
    Returns:
        :class:`CorrectionOutput`.
    """
    config = as_config(config)
    if advantages is not None and advantages.shape not in (response_mask.shape, response_mask.shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected (B, T) = "
                         f"{tuple(response_mask.shape)} like response_mask, or (B,) = ({response_mask.shape[0]},)")
    parallel = as_parallel(parallel)
    process_group, sequence_group = parallel.dp_group, parallel.cp_group
    segment_ids, max_segments = (segments.ids, segments.count) if segments is not None else (None, None)
    if config.on_nonfinite == "raise" and (process_group is not None or sequence_group is not None):
        check_pair(old_log_prob, rollout_log_prob, response_mask)
        raise_nonfinite_on_any_rank(nonfinite_positions(old_log_prob, rollout_log_prob, response_mask,
                                                        config.log_prob_floor, config.log_prob_ceiling), "log-prob", process_group, sequence_group)
    if sequence_group is not None:
        check_sequence_group(sequence_group)
        owner = stats_owner(sequence_group, process_group)
        check_pair(old_log_prob, rollout_log_prob, response_mask)
        rows = RowExchange(sequence_group, describe("compute_rollout_correction", config, max_segments=max_segments),
                           config.families)
        with torch.no_grad():
            for _ in rows.passes():
                out, _values = correction_pass(old_log_prob, rollout_log_prob, response_mask, config,
                                               process_group, rows, owner, segment_ids, max_segments, advantages)
        return out
    with torch.no_grad():
        if compile:
            check_segment_ids(segment_ids, response_mask, max_segments)  # eagerly: the compiled pass skips reads
            weights, keep, sums, maxes = _compiled_local_pass(config)(old_log_prob, rollout_log_prob, response_mask,
                                                                      segment_ids, max_segments, advantages)
            stats = SufficientStats.from_values(sums, maxes)
        else:
            weights, keep, stats = _blocked_local_pass(old_log_prob, rollout_log_prob, response_mask, config,
                                                       segment_ids, max_segments, advantages)
        stats = stats.all_reduce(process_group, _what(config, advantages))
        out = _finish(stats, weights, keep, old_log_prob, rollout_log_prob, config, (process_group,),
                      response_mask.dtype)
        if config.check_alignment:  # the warning needs the values: one sync, only with this option
            report = alignment_report(torch.stack([stats.sum(k) for k in ALIGN]))
            if report.misaligned:
                warnings.warn(report.message, MisalignmentWarning, stacklevel=2)
    return _checked(out, config, stats, old_log_prob, rollout_log_prob, response_mask)


#: ``on_batch(batch, weights, keep)``: called by :class:`CorrectionAccumulator` once per chunk.
BatchHook = Callable[[LogRatioBatch, Optional[torch.Tensor], torch.Tensor], None]


class CorrectionAccumulator(Accumulator):
    """Streaming metrics of :func:`compute_rollout_correction` for ``config`` (anything
    :func:`as_config` reads): ``update`` per chunk of whole rows, then ``compute`` gives exactly the
    metrics of one call on the concatenated batch. ``on_batch(batch, weights, keep)``, optional, is
    called per chunk after its statistics are recorded, with its :class:`LogRatioBatch`, its (B, T)
    IS weights before batch normalisation (None without IS) and its (B, T) float 0/1 keep mask.
    """

    def __init__(self, config: Union[RolloutCorrectionConfig, None, object] = None,
                 on_batch: Optional[BatchHook] = None) -> None:
        self.config = as_config(config)
        self.on_batch = on_batch
        super().__init__(self.config.on_nonfinite, self.config.log_prob_floor, self.config.families,
                         self.config.log_prob_ceiling)

    def record(self, stats: SufficientStats, batch: LogRatioBatch) -> None:
        isw, rej = local_correction(batch, self.config, stats)
        if self.on_batch is not None:
            self.on_batch(batch, None if isw is None else isw.weights, rej.keep_mask(batch))

    def finalize(self, stats: SufficientStats) -> dict[str, torch.Tensor]:
        return correction_metrics(stats, self.config)

    def settings(self) -> list[str]:
        return describe(type(self).__name__, self.config)
