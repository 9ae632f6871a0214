"""The core's entry points as the toolkit exports them: the new forms, and for one minor release
(0.3.x) the wide keyword parameters of 0.2, each with a ``DeprecationWarning`` that names its
replacement (docs/api.md, "Migrating from 0.2"). The core itself takes only the new forms.

=====================================================  =====================================================
0.2 keyword                                            0.3 form
=====================================================  =====================================================
``process_group=g``, ``sequence_group=s``              ``parallel=Parallel(dp_group=g, cp_group=s)``
``segment_ids=ids``, ``max_segments=n``                ``segments=Segments(ids, count=n)``
``clip_ratio_low``, ``clip_ratio_high``,               ``loss=PolicyLoss(clip=ClipRange(low, high, dual))``
``clip_ratio_c``                                       (``ppo_clip_loss``: ``clip=ClipRange(...)``)
``loss_agg_mode``, ``global_num_tokens``,              ``loss=PolicyLoss(aggregation=Aggregation(mode,
``global_num_seqs``, ``dp_size``,                      global_num_tokens, global_num_seqs, dp_size,
``loss_scale_factor``                                  scale_factor))`` (``agg_loss``: ``aggregation=``)
=====================================================  =====================================================
"""

from __future__ import annotations

import warnings
from typing import Any

import rollout_correction_core as core
from rollout_correction_core import Aggregation, ClipRange, Parallel, PolicyLoss, Segments

from . import packed

__all__ = ["compute_rollout_correction", "compute_rollout_correction_packed", "compute_offpolicy_metrics",
           "compute_policy_loss", "agg_loss", "ppo_clip_loss", "OffPolicyAccumulator", "CorrectionAccumulator"]

_UNSET = object()
_TOPOLOGY = {"process_group": "dp_group", "sequence_group": "cp_group"}
_SEGMENTS = {"segment_ids": "ids", "max_segments": "count"}
_CLIP = {"clip_ratio_low": "low", "clip_ratio_high": "high", "clip_ratio_c": "dual"}
_AGGREGATION = {"loss_agg_mode": "mode", "global_num_tokens": "global_num_tokens",
                "global_num_seqs": "global_num_seqs", "dp_size": "dp_size", "loss_scale_factor": "scale_factor"}
_NEW_FORM = {"parallel": "parallel=Parallel(dp_group=..., cp_group=...)",
             "segments": "segments=Segments(ids, count=...)",
             "clip": "clip=ClipRange(low, high, dual)", "aggregation": "aggregation=Aggregation(mode, ...)",
             "loss": "loss=PolicyLoss(clip=ClipRange(...), aggregation=Aggregation(...))"}


def _migrate(func: str, old: dict[str, Any], new: dict[str, Any], groups: dict[str, dict[str, str]],
             loss: bool = False) -> dict[str, Any]:
    """The new-form keywords of a call that used ``old`` 0.2 keywords: each group of ``groups``
    (new keyword → {old keyword → field}) built from its old keywords over the new value's fields
    (``loss``: the clip and aggregation groups are named as ``loss=PolicyLoss(...)``)."""
    known = {k for fields in groups.values() for k in fields}
    unknown = sorted(set(old) - known)
    if unknown:
        raise TypeError(f"{func}() got an unexpected keyword argument {unknown[0]!r}")
    if not old:
        return new
    used = [name for name, fields in groups.items() if set(fields) & set(old)]
    hints = dict.fromkeys("loss" if loss and name in ("clip", "aggregation") else name for name in used)
    warnings.warn(f"{func}({', '.join(sorted(old))}=...) is deprecated since 0.3 and will be removed in 0.4; "
                  f"pass {', '.join(_NEW_FORM[name] for name in hints)} (docs/api.md, 'Migrating from 0.2')",
                  DeprecationWarning, stacklevel=3)
    out = dict(new)
    for name in used:
        if new.get(name) is not None:
            raise TypeError(f"{func}(): give {name}= or the 0.2 keywords {sorted(set(groups[name]) & set(old))}, "
                            "not both")
        values = {field: old[key] for key, field in groups[name].items() if key in old}
        if name == "parallel":
            out[name] = Parallel(**values)
        elif name == "segments":
            if values.get("ids") is None:
                if values.get("count") is not None:
                    raise ValueError(f"max_segments={values['count']!r} given without segment_ids")
                continue
            out[name] = Segments(**values)
        elif name == "clip":
            out[name] = ClipRange(**values)
        elif name == "aggregation":
            out[name] = Aggregation(**values)
    return out


def compute_rollout_correction(old_log_prob, rollout_log_prob, response_mask, *, config=None, parallel=None,
                               compile=False, segments=None, advantages=None, **deprecated) -> core.CorrectionOutput:
    """:func:`rollout_correction_core.compute_rollout_correction` (0.2 keywords: module docstring)."""
    kw = _migrate("compute_rollout_correction", deprecated, {"parallel": parallel, "segments": segments},
                  {"parallel": _TOPOLOGY, "segments": _SEGMENTS})
    return core.compute_rollout_correction(old_log_prob, rollout_log_prob, response_mask, config=config,
                                           compile=compile, advantages=advantages, **kw)


def compute_rollout_correction_packed(old_log_prob, rollout_log_prob, *, config=None, lengths=None, cu_seqlens=None,
                                      response_mask=None, parallel=None, segments=None,
                                      **deprecated) -> core.CorrectionOutput:
    """:func:`rollout_correction.packed.compute_rollout_correction_packed` (0.2 keywords: module docstring)."""
    kw = _migrate("compute_rollout_correction_packed", deprecated, {"parallel": parallel, "segments": segments},
                  {"parallel": _TOPOLOGY, "segments": _SEGMENTS})
    return packed.compute_rollout_correction_packed(old_log_prob, rollout_log_prob, config=config, lengths=lengths,
                                                    cu_seqlens=cu_seqlens, response_mask=response_mask, **kw)


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask, *, parallel=None, on_nonfinite="reject",
                              mismatch_metrics=False, metrics=("default",), segments=None, **deprecated):
    """:func:`rollout_correction_core.compute_offpolicy_metrics` (0.2 keywords: module docstring)."""
    kw = _migrate("compute_offpolicy_metrics", deprecated, {"parallel": parallel}, {"parallel": _TOPOLOGY})
    return core.compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask, on_nonfinite=on_nonfinite,
                                          mismatch_metrics=mismatch_metrics, metrics=metrics, segments=segments,
                                          **kw)


def compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, *, config=None, rollout_log_prob=None,
                        rollout_is_weights=None, loss=None, parallel=None, segments=None, **deprecated):
    """:func:`rollout_correction_core.compute_policy_loss` (0.2 keywords: module docstring)."""
    kw = _migrate("compute_policy_loss", deprecated, {"parallel": parallel, "segments": segments},
                  {"parallel": _TOPOLOGY, "segments": _SEGMENTS, "clip": _CLIP, "aggregation": _AGGREGATION}, loss=True)
    clip, aggregation = kw.pop("clip", None), kw.pop("aggregation", None)
    if clip is not None or aggregation is not None:
        if loss is not None:
            raise TypeError("compute_policy_loss(): give loss= or the 0.2 clip and aggregation keywords, not both")
        loss = PolicyLoss(clip or ClipRange(), aggregation or Aggregation())
    return core.compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, config=config,
                                    rollout_log_prob=rollout_log_prob, rollout_is_weights=rollout_is_weights,
                                    loss=loss if loss is not None else PolicyLoss(), **kw)


def agg_loss(loss_mat, loss_mask, aggregation=None, *, parallel=None, count_mask=None, segments=None, **deprecated):
    """:func:`rollout_correction_core.agg_loss` (0.2 keywords: module docstring)."""
    kw = _migrate("agg_loss", deprecated, {"aggregation": aggregation, "parallel": parallel},
                  {"aggregation": _AGGREGATION, "parallel": {"sequence_group": "cp_group"}})
    return core.agg_loss(loss_mat, loss_mask, kw.pop("aggregation") or Aggregation(), count_mask=count_mask,
                         segments=segments, **kw)


def ppo_clip_loss(log_prob, prox_log_prob, advantages, clip=None, **deprecated):
    """:func:`rollout_correction_core.ppo_clip_loss` (0.2 keywords: module docstring)."""
    kw = _migrate("ppo_clip_loss", deprecated, {"clip": clip}, {"clip": _CLIP})
    return core.ppo_clip_loss(log_prob, prox_log_prob, advantages, kw["clip"] or ClipRange())


class _Compute:
    """``compute(parallel)``, and for 0.3.x ``compute(process_group)`` / ``compute(process_group=g)``."""

    def compute(self, parallel=None, *, process_group=_UNSET):
        if parallel is not None and not isinstance(parallel, Parallel):  # 0.2: a bare group, positionally
            process_group, parallel = parallel, None
        kw = _migrate(f"{type(self).__name__}.compute",
                      {} if process_group is _UNSET else {"process_group": process_group},
                      {"parallel": parallel}, {"parallel": {"process_group": "dp_group"}})
        return super().compute(kw["parallel"])


class OffPolicyAccumulator(_Compute, core.OffPolicyAccumulator):
    __doc__ = core.OffPolicyAccumulator.__doc__


class CorrectionAccumulator(_Compute, core.CorrectionAccumulator):
    __doc__ = core.CorrectionAccumulator.__doc__


# Same names, same documentation: help() on the toolkit's entry points reads as the core's.
for _name in ("compute_rollout_correction", "compute_rollout_correction_packed", "compute_offpolicy_metrics",
              "compute_policy_loss", "agg_loss", "ppo_clip_loss"):
    globals()[_name].__doc__ = getattr(packed if _name.endswith("packed") else core, _name).__doc__ + "\n\n" + globals()[_name].__doc__
del _name
