"""OpenRLHF: its rollout correction options mapped onto ours, and a drop-in policy loss.

Used through the launcher ``python -m rollout_correction.integrations.openrlhf.train_ppo_ray``
(:mod:`.train_ppo_ray`: OpenRLHF's own ``train_ppo_ray`` on the same flags, whose policy actor is the
subclass of :mod:`.actor`, which builds :class:`RolloutCorrectionPolicyLoss` from the args and calls
its :meth:`~RolloutCorrectionPolicyLoss.prepare_experience` in ``append``). Importing this package
changes nothing in OpenRLHF.

OpenRLHF (0.10.4 to 0.11.2) corrects the vLLM/DeepSpeed mismatch inside ``PolicyLoss.forward``
(``openrlhf/models/loss.py``), driven by options of ``openrlhf.cli.train_ppo_ray``. Two
generations of options exist:

* 0.10.4 – 0.11.1: ``--algo.advantage.is_correction_enable``, ``--algo.advantage.is_correction_type
  tis | icepop | seq-mask-tis`` (default ``tis``) and ``--algo.advantage.is_correction_threshold
  LOW HIGH`` (default ``0.5 5.0``); ``PolicyLoss.forward`` returns four values.
* 0.11.2: ``--algo.advantage.is_correction_level off | token | seq`` (default ``off``),
  ``--algo.advantage.is_correction_mode mask | clip`` (default ``mask``),
  ``--algo.advantage.is_correction_gating ratio | binary_kl | tv`` (default ``ratio``) and
  ``--algo.advantage.is_correction_threshold HIGH`` or ``LOW HIGH`` (a single HIGH means LOW = 0);
  ``PolicyLoss.forward`` returns five values, the fifth being ``is_filter_ratio`` (the share of
  units, tokens or sequences, outside the band), logged by the actor beside ``vllm_kl``.

:func:`config_from_openrlhf` (first generation) and :func:`config_from_openrlhf_gate` (0.11.2)
map them onto a :class:`~rollout_correction.RolloutCorrectionConfig` (ρ_t = π_old(y_t)/π_rollout(y_t),
``[lo, hi]`` the threshold):

=================================  ==================  ==========================================
OpenRLHF ≤ 0.11.1                  OpenRLHF 0.11.2     ours
=================================  ==================  ==========================================
``tis``                            token, clip, ratio  token IS, w_t = clamp(ρ_t, lo, hi)
                                                       (``rollout_is_mode="clip"``)
``icepop``                         token, mask, ratio  token IcePop, w_t = ρ_t·1[lo ≤ ρ_t ≤ hi];
                                                       the token keeps its place in the
                                                       denominator (a zero weight, as in OpenRLHF)
``seq-mask-tis``                   seq, mask, ratio    rejection of sequences whose geometric
                                                       mean ρ̄ = exp(mean log ρ_t) lies outside
                                                       [lo, hi] (``seq_mean_k1``) and token IS
                                                       w_t = clamp(ρ_t, lo, hi) on the kept ones
—                                  token, mask,        rejection of tokens whose binary KL / TV
                                   binary_kl | tv      between the sampled token's probabilities
                                                       exceeds HIGH (``token_binary_kl`` /
                                                       ``token_tv``) and token IS w_t = ρ_t on the
                                                       kept ones (no bound beyond the ±20 log clamp)
—                                  seq, mask,          the same on the sequence mean of the
                                   binary_kl | tv      divergence (``seq_mean_binary_kl`` /
                                                       ``seq_mean_tv``)
=================================  ==================  ==========================================

0.11.2's other combinations are refused by name: ``seq`` + ``clip`` and ``clip`` with the
``binary_kl`` / ``tv`` gatings (OpenRLHF refuses them too). LOW = 0 means no lower bound. The
divergence gates compute the statistic as OpenRLHF does (both probabilities clamped to
[1e-6, 1 − 1e-6], the same float32 expression), so the same tokens and sequences are dropped; a
binary KL that rounds below 0 (p ≈ q) is kept here and dropped by OpenRLHF's band [0, HIGH].

Two deliberate differences, both fixes:

* ``seq-mask-tis`` in OpenRLHF (0.11.2: ``seq`` / ``mask`` / ``ratio``) multiplies the loss by the
  *unclamped* token ratio exp(log ρ_t):
  one token with log ρ_t ≳ 89 in an accepted sequence makes the fp32 loss ``inf`` and its
  gradient NaN. Here the token weight is clamped to [lo, hi] (OpenRLHF's own TIS bound) after a
  ±20 log-space clamp.
* rejected tokens and sequences leave the loss denominators. OpenRLHF's actor divides by
  ``batch_num_tokens`` / ``global_batch_size``, which ``utils/loss_utils.py`` counts from the
  action masks of the whole optimizer step (all gradient-accumulation micro-batches, all
  data-parallel ranks) *before* the first micro-batch's loss is computed; OpenRLHF itself only
  zeroes the rejected tokens' loss. A loss module sees one micro-batch and cannot know how many
  tokens the other micro-batches and ranks reject, so the rejection is applied where the
  counts come from: :meth:`RolloutCorrectionPolicyLoss.prepare_experience` removes the rejected
  tokens from ``experience.action_mask`` when the experience enters the actor's replay buffer
  (π_old and π_rollout are fixed for the whole step, so the decision is the same in every PPO
  epoch). Every action-mask reduction of the step then counts accepted tokens only: the policy
  loss, its KL and entropy terms, and the token / sample counts OpenRLHF logs. The one exception,
  so that no micro-batch is left without tokens (OpenRLHF's logging divides by its token count),
  is described in :meth:`RolloutCorrectionPolicyLoss.prepare_experience`.

The geometric mean is taken over per-token log-ratios clamped to ±20 (OpenRLHF: unclamped), so a
row whose band decision hinges on one log-ratio beyond ±20 can be decided differently.

:class:`RolloutCorrectionPolicyLoss` wraps an OpenRLHF ``PolicyLoss`` built with its own
correction off and hands it the advantages scaled by our weights:
``−min(r·wA, clip(r)·wA) = −w·min(r·A, clip(r)·A)`` for w ≥ 0, and the same holds for dual clip,
so the per-token loss is exactly ``w_t`` times OpenRLHF's and OpenRLHF's aggregation is used
unchanged.

Methods beyond the weights (a config passed to ``from_args(args, config)``; every key is honoured
or refused at construction, naming it):

* ``loss_type`` ``gspo`` / ``cispo`` / ``dppo_tv`` / ``dppo_kl`` and ``rollout_opsm_delta`` (OPSM):
  the loss call has what they need (π_θ, π_old, π_rollout, advantages), so ``forward`` computes the
  loss with the core's :func:`~rollout_correction.compute_policy_loss` — on the accepted mask, with
  the IS weights, OpenRLHF's clip range as ε_lo / ε_hi (DPPO: δ_lo / δ_hi), ``--actor.dual_clip`` as
  the dual-clip constant of PPO clip and as DPPO's ratio cap c (default 3), OpenRLHF's aggregation
  (token mean, or sequence mean for ``gspo`` and 0.11.2's ``seq-mean-token-mean``) and its
  denominators ``batch_num_tokens`` / ``global_batch_size``. OPSM decides on π_θ, which changes
  during the step, so it acts in the loss only: the tokens of the sequences it drops leave the loss
  but stay in the denominators (as in DeepSeek-V3.2's formula, where the mask multiplies the term
  inside the normalisation). ``loss_type`` ``ppo_clip`` without OPSM keeps OpenRLHF's ``PolicyLoss``.
* ``gspo`` and OpenRLHF's ``--actor.policy_loss_type gspo`` must agree: ``from_args`` sets
  ``loss_type="gspo"`` when it maps OpenRLHF's flags under ``--actor.policy_loss_type gspo``; a
  config of this library with ``gspo`` needs the flag (OpenRLHF then aggregates per sequence), and a
  config with another ``loss_type`` under the flag is refused. There is one GSPO, the core's
  (GSPO-token form, as verl's): each token's gradient is weighted by its own w_t, whereas
  OpenRLHF's back-propagates through the sequence mean (the same for per-sequence weights).
  ``--actor.dual_clip`` with ``gspo`` / ``cispo`` is refused (they have no dual clip here).
* refused: ``bypass_mode`` (``ppo_clip`` against π_rollout, ``reinforce``, ``topr``: the rejection
  is decided at experience time from π_old, a bypass one from π_θ), ``rollout_m2po_threshold``
  (M2PO's cutoff is batch-global; the adapter sees one experience or micro-batch at a time) and
  ``rollout_is_batch_normalize`` (it would normalise over one micro-batch).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from typing import Any, Optional, Sequence

import torch

from rollout_correction import (
    METRIC_PREFIX,
    RolloutCorrectionConfig,
    as_config,
    compute_policy_loss,
    compute_rollout_correction,
)
from rollout_correction import SAFETY_BOUND
from rollout_correction_core import Aggregation, ClipRange, PolicyLoss

__all__ = [
    "OPENRLHF_CORRECTION_TYPES",
    "SUPPORTED_OPENRLHF",
    "check_openrlhf_version",
    "ACTIVE_METRIC",
    "PLACEHOLDER_METRIC",
    "OPENRLHF_CORRECTION_GATES",
    "config_from_openrlhf",
    "config_from_openrlhf_gate",
    "config_from_openrlhf_args",
    "RolloutCorrectionPolicyLoss",
]

logger = logging.getLogger(__name__)

OPENRLHF_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
"""The values of ``--algo.advantage.is_correction_type`` (OpenRLHF 0.10.4 – 0.11.1)."""

OPENRLHF_CORRECTION_GATES = {
    ("token", "clip", "ratio"): "tis",
    ("token", "mask", "ratio"): "icepop",
    ("seq", "mask", "ratio"): "seq-mask-tis",
}
"""OpenRLHF 0.11.2's (``is_correction_level``, ``_mode``, ``_gating``) combinations that have an
equivalent here, and the first-generation type each one is."""

_TINY_RATIO = 1e-30  # a positive ratio bound below every geometric mean of ±20-clamped log-ratios

SUPPORTED_OPENRLHF = ">=0.10.4,<0.11.3"
"""OpenRLHF releases whose ``PolicyLoss``, ``ppo_actor`` loss call and replay buffer are tested."""

PLACEHOLDER_METRIC = f"{METRIC_PREFIX}openrlhf_placeholder"
"""Per-sample info key: 1 for a fully rejected sample kept as a one-token placeholder
(:meth:`RolloutCorrectionPolicyLoss.prepare_experience`)."""

ACTIVE_METRIC = f"{METRIC_PREFIX}openrlhf_rejected_token_fraction"
"""Per-sample info key that only this library writes: its presence in OpenRLHF's logs shows the
correction ran at experience time."""


def check_openrlhf_version(version: Optional[str] = None) -> None:
    """Raise unless ``version`` (default: the installed OpenRLHF's) is in :data:`SUPPORTED_OPENRLHF`."""
    from packaging.specifiers import SpecifierSet

    if version is None:
        import importlib.metadata

        try:
            version = importlib.metadata.version("openrlhf")
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(
                f"RolloutCorrectionPolicyLoss needs OpenRLHF: pip install 'rollout-correction[openrlhf]' "
                f"(openrlhf{SUPPORTED_OPENRLHF})"
            ) from None
    if version not in SpecifierSet(SUPPORTED_OPENRLHF, prereleases=True):
        raise RuntimeError(
            f"RolloutCorrectionPolicyLoss is tested with openrlhf{SUPPORTED_OPENRLHF} (its PolicyLoss "
            f"arguments, the actor's loss call and replay buffer); the installed openrlhf is {version}. "
            f"Install a supported release: pip install 'rollout-correction[openrlhf]'"
        )


def _band(threshold: Sequence[float]) -> tuple[float, float]:
    values = [float(v) for v in threshold]
    if len(values) != 2:
        raise ValueError(f"is_correction_threshold={threshold!r}: expected two values, LOW HIGH")
    lo, hi = values
    if not (0.0 <= lo < hi):
        raise ValueError(f"is_correction_threshold={threshold!r}: need 0 <= LOW < HIGH")
    return lo, hi


def config_from_openrlhf(
    is_correction_type: str = "tis", is_correction_threshold: Sequence[float] = (0.5, 5.0)
) -> RolloutCorrectionConfig:
    """Our config for ``--algo.advantage.is_correction_type`` / ``_threshold`` (see the module table)."""
    if is_correction_type not in OPENRLHF_CORRECTION_TYPES:
        raise ValueError(
            f"is_correction_type={is_correction_type!r} is not one of {list(OPENRLHF_CORRECTION_TYPES)}"
        )
    lo, hi = _band(is_correction_threshold)
    if is_correction_type == "icepop":
        return RolloutCorrectionConfig.from_dict(
            {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_threshold": hi,
             "rollout_is_threshold_lower": lo}
        )
    token_clip = {"rollout_is": "token", "rollout_is_mode": "clip", "rollout_is_threshold": hi,
                  "rollout_is_threshold_lower": lo}
    if is_correction_type == "tis":
        return RolloutCorrectionConfig.from_dict(token_clip)
    # LOW = 0 (0.11.2's single HIGH): no lower bound. Our geometric mean is taken over log-ratios
    # clamped to ±20, so it is ≥ e⁻²⁰ and a bound of 1e-30 rejects nothing.
    rs_lo = lo if lo > 0.0 else _TINY_RATIO
    return RolloutCorrectionConfig.from_dict(
        {**token_clip, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": f"{rs_lo!r}_{hi!r}"}
    )


def _flag(name: str) -> str:
    return f"--algo.advantage.is_correction_{name}"


def config_from_openrlhf_gate(
    is_correction_level: str,
    is_correction_mode: str = "mask",
    is_correction_gating: str = "ratio",
    is_correction_threshold: Sequence[float] = (0.5, 5.0),
) -> RolloutCorrectionConfig:
    """Our config for OpenRLHF 0.11.2's ``--algo.advantage.is_correction_level`` / ``_mode`` /
    ``_gating`` / ``_threshold`` (see the module table); the other combinations raise, naming them."""
    level, mode, gating = is_correction_level, is_correction_mode, is_correction_gating
    for name, value, allowed in (("level", level, ("off", "token", "seq")), ("mode", mode, ("mask", "clip")),
                                 ("gating", gating, ("ratio", "binary_kl", "tv"))):
        if value not in allowed:
            raise ValueError(f"{_flag(name)} {value!r} is not one of {list(allowed)}")
    if level == "off":
        raise ValueError(
            f"{_flag('level')} is off: set it to token or seq on the OpenRLHF command line; without it "
            "vLLM returns no sampling log-probs (experience.rollout_log_probs is None) and there is "
            "nothing to correct"
        )
    if gating != "ratio":
        return _divergence_gate(level, mode, gating, is_correction_threshold)
    kind = OPENRLHF_CORRECTION_GATES.get((level, mode, gating))
    if kind is None:
        raise ValueError(
            f"{_flag('level')} {level} with {_flag('mode')} {mode} is not a correction: only a "
            "per-token ratio can be clipped (OpenRLHF refuses it as well); use mode mask"
        )
    threshold = [float(v) for v in is_correction_threshold]
    if len(threshold) == 1:  # HIGH alone: an upper bound only, as OpenRLHF's parser reads it
        threshold = [0.0, threshold[0]]
    return config_from_openrlhf(kind, threshold)


def _divergence_gate(level: str, mode: str, gating: str, threshold: Sequence[float]) -> RolloutCorrectionConfig:
    """0.11.2's ``binary_kl`` / ``tv`` gating: a rejection on the divergence (per token, or its
    sequence mean) at HIGH, and the survivors' token ratio as weight (see the module table)."""
    if mode != "mask":
        raise ValueError(f"{_flag('gating')} {gating} with {_flag('mode')} {mode}: a divergence is a "
                         "rejection filter, not a weight (OpenRLHF refuses it as well); use mode mask")
    values = [float(v) for v in threshold]
    lo, hi = (0.0, values[0]) if len(values) == 1 else _band(values)
    if lo != 0.0 or not hi > 0.0:
        raise ValueError(f"{_flag('threshold')} {list(threshold)!r}: gating {gating} takes an upper bound only "
                         "(a single HIGH > 0, or LOW 0)")
    return RolloutCorrectionConfig.from_dict(
        {"rollout_is": "token", "rollout_is_mode": "truncate", "rollout_is_threshold": math.exp(SAFETY_BOUND),
         "rollout_rs": f"{'token' if level == 'token' else 'seq_mean'}_{gating}", "rollout_rs_threshold": hi})


def _gate_level(args: Any) -> str:
    """``token`` or ``seq``: the unit OpenRLHF's correction filters, for the args' release."""
    adv = args.algo.advantage
    if hasattr(adv, "is_correction_level"):
        return "seq" if adv.is_correction_level == "seq" else "token"
    return "seq" if getattr(adv, "is_correction_type", "tis") == "seq-mask-tis" else "token"


def config_from_openrlhf_args(args: Any) -> RolloutCorrectionConfig:
    """Our config from OpenRLHF's parsed CLI (``train_ppo_ray`` + ``hierarchize``), either generation.

    The correction must be on (``--algo.advantage.is_correction_enable`` up to 0.11.1,
    ``--algo.advantage.is_correction_level token|seq`` from 0.11.2): it is what makes OpenRLHF
    request the vLLM sampling log-probs (``experience.rollout_log_probs``) the correction needs.
    """
    adv = args.algo.advantage
    if hasattr(adv, "is_correction_level"):  # OpenRLHF 0.11.2
        return config_from_openrlhf_gate(adv.is_correction_level, adv.is_correction_mode,
                                         adv.is_correction_gating, adv.is_correction_threshold)
    if not adv.is_correction_enable:
        raise ValueError(
            "add --algo.advantage.is_correction_enable to the OpenRLHF command line: without it vLLM "
            "returns no sampling log-probs (experience.rollout_log_probs is None) and there is nothing "
            "to correct"
        )
    return config_from_openrlhf(adv.is_correction_type, adv.is_correction_threshold)


_TURN_CORRECTION_ON = (
    "turn OpenRLHF's correction on (--algo.advantage.is_correction_enable, or "
    "--algo.advantage.is_correction_level token|seq from 0.11.2) so vLLM returns its sampling log-probs"
)

_CORE_LOSS_TYPES = ("gspo", "cispo", "dppo_tv", "dppo_kl")
"""``loss_type`` values the adapter computes with the core's ``compute_policy_loss`` (ppo_clip:
OpenRLHF's own PolicyLoss, weighted; with ``rollout_opsm_delta``: the core's PPO clip)."""


def _check_config(config: RolloutCorrectionConfig, policy_loss: Any) -> None:
    """Refuse, naming the key, every setting the OpenRLHF adapter would not honour."""
    where = "compute_policy_loss / compute_rollout_correction called on the whole batch (e.g. the verl adapter)"
    if config.bypass_mode:
        raise ValueError(
            f"bypass_mode=True (loss_type={config.loss_type!r}) is not available with the OpenRLHF adapter: "
            "OpenRLHF's actor computes π_old and the adapter removes rejected tokens from the step's "
            "denominators at experience time, which a bypass correction (decided on π_θ, which changes "
            "during the step) cannot do. Bypass losses (ppo_clip against π_rollout, reinforce, topr) act in "
            f"{where}; on OpenRLHF use a decoupled config (bypass_mode=False)"
        )
    if config.rollout_m2po_threshold is not None:
        raise ValueError(
            f"rollout_m2po_threshold={config.rollout_m2po_threshold!r} is not available with the OpenRLHF "
            "adapter: M2PO's cutoff is batch-global, and OpenRLHF hands the adapter one experience, then "
            "shuffled micro-batches, never the step's whole batch over all ranks. It acts in "
            f"{where}; remove it from the config"
        )
    if config.rollout_is_batch_normalize:
        raise ValueError(
            "rollout_is_batch_normalize=True is not available with the OpenRLHF adapter: the weights are "
            "computed per micro-batch at loss time, so the mean-1 normalisation would be over one "
            f"micro-batch, not the batch. It acts in {where}; remove it from the config"
        )
    if config.loss_type not in ("ppo_clip",) + _CORE_LOSS_TYPES:
        raise ValueError(f"loss_type={config.loss_type!r} is not available with the OpenRLHF adapter; "
                         f"use ppo_clip or one of {list(_CORE_LOSS_TYPES)}")
    theirs = getattr(policy_loss, "policy_loss_type", "ppo")
    if theirs == "gspo" and config.loss_type != "gspo":
        raise ValueError(
            f"--actor.policy_loss_type gspo with loss_type={config.loss_type!r} in the config: the two "
            "disagree. Set loss_type='gspo' in the config (GSPO weighted by this library's correction; "
            "the default when from_args maps OpenRLHF's own flags) or drop --actor.policy_loss_type gspo"
        )
    if config.loss_type == "gspo" and theirs != "gspo":
        raise ValueError(
            f"loss_type='gspo' with --actor.policy_loss_type {theirs}: add --actor.policy_loss_type gspo, "
            "so that OpenRLHF's PolicyLoss and the config agree (GSPO averages per sequence: "
            "OpenRLHF then passes the sequence count global_batch_size it divides by)"
        )
    if config.loss_denominator == "valid" and (config.loss_type != "ppo_clip" or config.rollout_opsm_delta is not None):
        raise ValueError(
            f"loss_denominator='valid' with loss_type={config.loss_type!r}"
            f"{' and rollout_opsm_delta' if config.rollout_opsm_delta is not None else ''}: the adapter keeps "
            "rejected tokens counted by zeroing their weight in OpenRLHF's own PolicyLoss (ppo_clip without "
            "OPSM); the other loss types read the kept mask itself (GSPO's sequence ratio, OPSM's mean). "
            "Use loss_denominator='kept' (the adapter's default) or loss_type='ppo_clip'"
        )
    if config.loss_type in ("gspo", "cispo") and getattr(policy_loss, "dual_clip", None) is not None:
        raise ValueError(
            f"--actor.dual_clip {policy_loss.dual_clip} with loss_type={config.loss_type!r}: this library's "
            f"{config.loss_type} has no dual clip (it acts with loss_type ppo_clip, and as the ratio cap c "
            "of dppo_tv / dppo_kl); remove --actor.dual_clip"
        )


class RolloutCorrectionPolicyLoss(torch.nn.Module):
    """Drop-in for OpenRLHF's ``PolicyLoss`` with this library's correction step.

    Args:
        policy_loss: an OpenRLHF ``PolicyLoss`` built with its own correction off
            (``enable_vllm_is_correction=False`` up to 0.11.1, ``is_correction_level="off"`` in 0.11.2).
        config: the correction (e.g. from :func:`config_from_openrlhf_args`).
        micro_batch_size: OpenRLHF's ``--train.micro_batch_size`` (``from_args`` reads it); bounds
            how many fully rejected sequences :meth:`prepare_experience` may leave empty.
        filter_level: ``token`` or ``seq``, the unit ``is_filter_ratio`` counts (``from_args``:
            OpenRLHF's correction level, ``seq`` for ``seq-mask-tis``).

    :meth:`prepare_experience` applies the rejection to an experience's action mask (call it
    where the actor appends to its replay buffer); ``forward`` takes OpenRLHF's loss arguments and
    returns what the wrapped ``PolicyLoss`` returns: ``(loss, clip_ratio, ppo_kl, vllm_kl)`` up to
    0.11.1, ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` in 0.11.2. ``vllm_kl`` is the
    mean over the (accepted) action tokens of log π_rollout − log π_old. ``is_filter_ratio`` is the
    share of this training step's units (in this actor process) that the correction filtered,
    counted by :meth:`prepare_experience` on the masks before rejection: at ``token`` level the
    action tokens rejected or whose token IS weight was clamped or zeroed (ρ_t outside the band),
    at ``seq`` level the sequences rejected. (Without ``prepare_experience``, it is counted on the
    micro-batch at loss time.) Our metrics of the last forward (``rollout_corr/...``, 0-d tensors;
    with OPSM or a ``loss_type`` other than ``ppo_clip`` also ``rollout_corr/opsm_*`` and ``actor/*``
    from :func:`~rollout_correction.compute_policy_loss`, see the module docstring) are in
    ``self.last_metrics``; ``clip_ratio`` and ``ppo_kl`` are then that loss's ``actor/pg_clipfrac``
    and ``actor/ppo_kl``.
    """

    def __init__(self, policy_loss: torch.nn.Module, config: RolloutCorrectionConfig,
                 micro_batch_size: int = 1, filter_level: str = "token"):
        super().__init__()
        config.refuse_segments("OpenRLHF's PolicyLoss call")
        if getattr(policy_loss, "enable_vllm_is_correction", False) or \
                getattr(policy_loss, "is_correction_level", "off") != "off":
            raise ValueError(
                "wrap a PolicyLoss built with its own correction off (enable_vllm_is_correction=False, "
                "or is_correction_level='off' in OpenRLHF 0.11.2); otherwise the correction would be "
                "applied twice"
            )
        _check_config(config, policy_loss)
        if filter_level not in ("token", "seq"):
            raise ValueError(f"filter_level={filter_level!r}: expected 'token' or 'seq'")
        self.policy_loss = policy_loss
        self.config = config
        self.filter_level = filter_level
        self.last_metrics: Any = {}  # a Metrics mapping after the first forward
        self.micro_batch_size = int(micro_batch_size)
        self._empty_rows = 0  # fully rejected rows left empty since the last training phase
        self._pending_filter = [0, 0]  # (filtered units, units) counted by prepare_experience
        self._step_filter_ratio: Optional[float] = None  # of the step being trained on
        self._warned_unprepared = False
        # OPSM and the loss types other than PPO clip run through the core's compute_policy_loss.
        self.uses_core_loss = config.loss_type != "ppo_clip" or config.rollout_opsm_delta is not None
        # 0.11.2's PolicyLoss returns five values (its constructor has is_correction_level).
        self._five_values = hasattr(policy_loss, "is_correction_level")

    @classmethod
    def from_args(
        cls,
        args: Any,
        config: Any = None,
        *,
        policy_loss_cls: Any = None,
        metrics: Optional[Sequence[str]] = None,
    ) -> "RolloutCorrectionPolicyLoss":
        """Build from OpenRLHF's parsed args exactly as ``ppo_actor.py`` builds its ``PolicyLoss``.

        ``args`` is the namespace ``train_ppo_ray`` produces (``self.args`` in the actor), of any
        supported release. ``config`` (a config, preset name or mapping) replaces the mapping of
        OpenRLHF's correction options by any correction of this library, e.g. a token-level
        rejection (the correction must still be on, for the log-probs).
        ``policy_loss_cls`` defaults to ``openrlhf.models.PolicyLoss``; ``metrics`` (metric family
        names, as the config's ``metrics`` key) replaces the families of either config.
        """
        check_openrlhf_version()
        mapped = config_from_openrlhf_args(args)
        if policy_loss_cls is None:
            from openrlhf.models import PolicyLoss as policy_loss_cls  # noqa: N813
        kwargs = dict(
            clip_eps_low=args.actor.eps_clip_low_high[0],
            clip_eps_high=args.actor.eps_clip_low_high[1],
            dual_clip=args.actor.dual_clip,
            policy_loss_type=args.actor.policy_loss_type,
        )
        if hasattr(args.actor, "loss_agg_mode"):  # --actor.loss_agg_mode (0.11.2), read as ppo_actor does
            kwargs["token_level_loss"] = args.actor.loss_agg_mode == "token-mean"
        if "is_correction_level" in inspect.signature(policy_loss_cls).parameters:
            kwargs["is_correction_level"] = "off"
        else:
            kwargs["enable_vllm_is_correction"] = False
        if config is None and args.actor.policy_loss_type == "gspo":
            # OpenRLHF's --actor.policy_loss_type gspo selects the loss; the mapped correction weights it.
            mapped = dataclasses.replace(mapped, loss_type="gspo")
        chosen = mapped if config is None else as_config(config)
        return cls(policy_loss_cls(**kwargs), chosen if metrics is None else chosen.replace(metrics=list(metrics)),
                   micro_batch_size=args.train.micro_batch_size,
                   filter_level=_gate_level(args) if config is None else "token")

    def _filter_counts(self, old_log_probs, rollout_log_probs, valid, kept):
        """(filtered units, units) at ``self.filter_level``: ``valid`` the action tokens before
        rejection, ``kept`` after it."""
        if self.filter_level == "seq":
            rows = valid.any(-1)
            return (rows & ~(kept & valid).any(-1)).sum(), rows.sum()
        filtered = ~kept
        spec = self.config.is_spec
        if spec is not None and spec.level == "token":
            rho = (old_log_probs.float() - rollout_log_probs.float()).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
            filtered = filtered | (rho > spec.upper)
            if spec.lower is not None:
                filtered = filtered | (rho < spec.lower)
        return (valid & filtered).sum(), valid.sum()

    @torch.no_grad()
    def prepare_experience(self, experience: Any) -> Any:
        """Remove the rejected tokens from ``experience.action_mask`` (in place) and return it.

        Call it on each experience before it enters the actor's replay buffer, so that the token
        and sequence counts OpenRLHF divides by (``batch_num_tokens`` / ``global_batch_size``)
        count accepted tokens only. Adds per-sample ``rollout_corr/...`` entries to
        ``experience.info`` (logged by OpenRLHF like its own): the rejected-token fraction of each
        sample (:data:`ACTIVE_METRIC`), whether the sample keeps a placeholder token (below) and
        this micro-batch's correction metrics.

        A micro-batch whose sequences are all fully rejected would have no action tokens, and
        OpenRLHF's ``ppo_train`` divides its logged token metrics by that count. So per actor
        process and training step at most ``micro_batch_size − 1`` fully rejected sequences are
        left empty (then no micro-batch can be all empty); each further one keeps its first
        action token with advantage 0 as a placeholder: its loss is 0, and it counts as one token
        and one sequence in the denominators instead of its length.
        """
        mask = experience.action_mask
        if experience.rollout_log_probs is None:
            raise ValueError(f"experience.rollout_log_probs is None: {_TURN_CORRECTION_ON}")
        result = compute_rollout_correction(
            experience.action_log_probs, experience.rollout_log_probs, mask, config=self.config
        )
        valid = mask.to(torch.bool)
        kept = result.response_mask.to(torch.bool) & valid
        counts = torch.stack(self._filter_counts(
            experience.action_log_probs, experience.rollout_log_probs, valid, kept)).tolist()  # one sync
        self._pending_filter = [a + b for a, b in zip(self._pending_filter, counts)]
        n_valid = valid.sum(-1)
        rejected = (n_valid - kept.sum(-1)).float()
        placeholder = torch.zeros_like(n_valid, dtype=torch.bool)
        if self.config.loss_denominator == "valid":  # rejected tokens stay counted: the loss zeroes them
            kept = valid
        for row in ((n_valid > 0) & ~kept.any(-1)).nonzero().flatten().tolist():
            if self._empty_rows < self.micro_batch_size - 1:
                self._empty_rows += 1
                continue
            first = int(valid[row].to(torch.int8).argmax())
            kept[row, first] = True
            placeholder[row] = True
            if getattr(experience, "advantages", None) is not None:
                experience.advantages[row, first] = 0.0
        experience.action_mask = kept.to(mask.dtype)
        batch = mask.shape[0]
        info = experience.info
        info[ACTIVE_METRIC] = torch.where(n_valid > 0, rejected / n_valid.clamp(min=1), 0.0)
        info[PLACEHOLDER_METRIC] = placeholder.float()
        for key, value in result.metrics.items():
            info[key] = value.detach().float().reshape(()).expand(batch).clone()
        return experience

    def _core_loss(self, log_probs, old_log_probs, advantages, mask, rollout_log_probs, weights, dp_size,
                   batch_num_tokens, global_batch_size):
        """(loss, clip_ratio, ppo_kl) from :func:`~rollout_correction.compute_policy_loss` with the
        config's ``loss_type`` and OPSM, the wrapped PolicyLoss's clip range, dual clip and
        aggregation, and OpenRLHF's denominators. ``mask`` is the correction's accepted mask and
        ``weights`` its IS weights (computed once, in ``forward``)."""
        pl = self.policy_loss
        dual_clip = getattr(pl, "dual_clip", None)
        # No dual clip: a cap no finite loss reaches (PPO clip); DPPO's ratio cap c defaults to 3.
        if self.config.loss_type in ("dppo_tv", "dppo_kl"):
            clip_c = 3.0 if dual_clip is None else float(dual_clip)
        else:
            clip_c = float(torch.finfo(torch.float32).max) if dual_clip is None else float(dual_clip)
        if weights is None:
            weights = mask.to(torch.float32)
        loss, metrics = compute_policy_loss(
            log_probs, old_log_probs, advantages, mask, config=self.config,
            rollout_log_prob=rollout_log_probs, rollout_is_weights=weights,
            loss=PolicyLoss(
                clip=ClipRange(low=float(pl.clip_eps_low), high=float(pl.clip_eps_high), dual=clip_c),
                aggregation=Aggregation(
                    "token-mean" if getattr(pl, "token_level_loss", True) else "seq-mean-token-mean",
                    global_num_tokens=batch_num_tokens, global_num_seqs=global_batch_size, dp_size=dp_size)))
        self.last_metrics.update(metrics)  # lazily: rollout_corr/opsm_*, actor/pg_clipfrac, actor/ppo_kl, ...
        return loss, metrics["actor/pg_clipfrac"].float(), metrics["actor/ppo_kl"].float()

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        if action_mask is None:
            action_mask = torch.ones_like(log_probs)
        if rollout_log_probs is None:
            raise ValueError(f"rollout_log_probs is None: {_TURN_CORRECTION_ON}")
        self._empty_rows = 0  # a training phase: the next prepare_experience starts a new step
        filtered, units = self._pending_filter
        if units:  # prepare_experience counted a new step
            self._step_filter_ratio = filtered / units
            self._pending_filter = [0, 0]
        result = compute_rollout_correction(old_log_probs.detach(), rollout_log_probs, action_mask, config=self.config)
        self.last_metrics = result.metrics
        mask = result.response_mask.to(action_mask.dtype)
        # Tokens rejected here but counted by OpenRLHF (placeholders have advantage 0 and do not count).
        counted = action_mask.to(torch.bool) & ~mask.to(torch.bool) & (advantages != 0)
        weights, accepted = result.weights, mask.to(torch.bool)
        if self.config.loss_denominator == "valid":  # OpenRLHF's own reduction: a zero weight, still counted
            weights = torch.where(mask.to(torch.bool), 1.0 if weights is None else weights, 0.0)
            finite = torch.isfinite(log_probs.detach()) & torch.isfinite(old_log_probs) & \
                torch.isfinite(rollout_log_probs)  # a non-finite token leaves the loss (no NaN)
            mask = action_mask * finite.to(action_mask.dtype)
        elif not self._warned_unprepared and bool(counted.any()):
            self._warned_unprepared = True
            logger.warning(
                "rollout-correction rejected tokens inside the loss: they are left out of the loss but "
                "still counted in batch_num_tokens / global_batch_size. Call "
                "actor_loss_fn.prepare_experience(experience) where the actor appends to its replay "
                "buffer (docs/integrations.md, OpenRLHF)"
            )
        if self.uses_core_loss:
            loss, clip_ratio, ppo_kl = self._core_loss(log_probs, old_log_probs, advantages, mask,
                                                       rollout_log_probs, weights, dp_size,
                                                       batch_num_tokens, global_batch_size)
            n_values = 5 if self._five_values else 4
        else:
            if weights is not None:
                advantages = advantages * weights.to(advantages.dtype)
            out = self.policy_loss(
                log_probs, old_log_probs, advantages, action_mask=mask, rollout_log_probs=rollout_log_probs,
                dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
            )
            loss, clip_ratio, ppo_kl = out[:3]
            n_values = len(out)
        valid = mask.to(torch.bool)
        diff = torch.where(valid, rollout_log_probs.float() - old_log_probs.detach().float(), 0.0)
        diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
        vllm_kl = diff.sum() / valid.sum().clamp(min=1)
        if n_values == 4:  # OpenRLHF 0.10.4 – 0.11.1
            return loss, clip_ratio, ppo_kl, vllm_kl
        # OpenRLHF 0.11.2: a fifth value, is_filter_ratio, logged by the actor beside vllm_kl.
        if self._step_filter_ratio is not None:
            filter_ratio = torch.tensor(self._step_filter_ratio, dtype=torch.float32, device=log_probs.device)
        else:  # no prepare_experience: what this micro-batch's loss filtered
            filtered, units = self._filter_counts(old_log_probs.detach(), rollout_log_probs,
                                                  action_mask.to(torch.bool), accepted)
            filter_ratio = filtered.float() / units.clamp(min=1).float()
        return loss, clip_ratio, ppo_kl, vllm_kl, filter_ratio
