"""OpenRLHF: its rollout correction options mapped onto ours, and a drop-in policy loss.

OpenRLHF (0.10.4 to 0.11.x) corrects the vLLM/DeepSpeed mismatch inside ``PolicyLoss.forward``
(``openrlhf/models/loss.py``), driven by three options of ``openrlhf.cli.train_ppo_ray``:
``--algo.advantage.is_correction_enable``, ``--algo.advantage.is_correction_type``
``tis | icepop | seq-mask-tis`` (default ``tis``) and ``--algo.advantage.is_correction_threshold
LOW HIGH`` (default ``0.5 5.0``).

:func:`config_from_openrlhf` maps them onto a :class:`~rollout_correction.RolloutCorrectionConfig`
(ρ_t = π_old(y_t)/π_rollout(y_t), ``[lo, hi]`` the threshold):

=================================  ==============================================================
OpenRLHF                           ours
=================================  ==============================================================
``tis``                            token IS, w_t = clamp(ρ_t, lo, hi)  (``rollout_is_mode="clip"``)
``icepop``                         token IcePop, w_t = ρ_t·1[lo ≤ ρ_t ≤ hi]; the token keeps its
                                   place in the denominator (a zero weight, as in OpenRLHF)
``seq-mask-tis``                   rejection of sequences whose geometric mean ρ̄ = exp(mean log ρ_t)
                                   lies outside [lo, hi] (``seq_mean_k1``) and token IS
                                   w_t = clamp(ρ_t, lo, hi) on the kept ones
=================================  ==============================================================

Two deliberate differences, both fixes:

* ``seq-mask-tis`` in OpenRLHF multiplies the loss by the *unclamped* token ratio exp(log ρ_t):
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
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from rollout_correction import METRIC_PREFIX, RolloutCorrectionConfig, as_config, compute_rollout_correction

__all__ = [
    "OPENRLHF_CORRECTION_TYPES",
    "SUPPORTED_OPENRLHF",
    "check_openrlhf_version",
    "ACTIVE_METRIC",
    "PLACEHOLDER_METRIC",
    "config_from_openrlhf",
    "config_from_openrlhf_args",
    "RolloutCorrectionPolicyLoss",
]

logger = logging.getLogger(__name__)

OPENRLHF_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
"""The values of ``--algo.advantage.is_correction_type``."""

SUPPORTED_OPENRLHF = ">=0.10.4,<0.12"
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
    if lo <= 0.0:
        raise ValueError(
            "seq-mask-tis needs a positive LOW bound: the geometric-mean ratio band is [LOW, HIGH]"
        )
    return RolloutCorrectionConfig.from_dict(
        {**token_clip, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": f"{lo!r}_{hi!r}"}
    )


def config_from_openrlhf_args(args: Any) -> RolloutCorrectionConfig:
    """Our config from OpenRLHF's parsed CLI (``train_ppo_ray`` + ``hierarchize``).

    ``--algo.advantage.is_correction_enable`` must be on: it is what makes OpenRLHF request the
    vLLM sampling log-probs (``experience.rollout_log_probs``) the correction needs.
    """
    adv = args.algo.advantage
    if not adv.is_correction_enable:
        raise ValueError(
            "add --algo.advantage.is_correction_enable to the OpenRLHF command line: without it vLLM "
            "returns no sampling log-probs (experience.rollout_log_probs is None) and there is nothing "
            "to correct"
        )
    return config_from_openrlhf(adv.is_correction_type, adv.is_correction_threshold)


class RolloutCorrectionPolicyLoss(torch.nn.Module):
    """Drop-in for OpenRLHF's ``PolicyLoss`` with this library's correction step.

    Args:
        policy_loss: an OpenRLHF ``PolicyLoss`` built with ``enable_vllm_is_correction=False``.
        config: the correction (e.g. from :func:`config_from_openrlhf_args`).
        micro_batch_size: OpenRLHF's ``--train.micro_batch_size`` (``from_args`` reads it); bounds
            how many fully rejected sequences :meth:`prepare_experience` may leave empty.

    :meth:`prepare_experience` applies the rejection to an experience's action mask (call it
    where the actor appends to its replay buffer); ``forward`` takes OpenRLHF's loss arguments and
    returns its four-tuple ``(loss, clip_ratio, ppo_kl, vllm_kl)`` with ``vllm_kl`` = mean over
    the (accepted) action tokens of log π_rollout − log π_old. Our metrics of the last forward
    (``rollout_corr/...``, 0-d tensors) are in ``self.last_metrics``.
    """

    def __init__(self, policy_loss: torch.nn.Module, config: RolloutCorrectionConfig, micro_batch_size: int = 1):
        super().__init__()
        if getattr(policy_loss, "enable_vllm_is_correction", False):
            raise ValueError(
                "wrap a PolicyLoss built with enable_vllm_is_correction=False; otherwise the "
                "correction would be applied twice"
            )
        if config.bypass_mode:
            raise ValueError("bypass configs replace π_old by π_rollout before the loss; pass "
                             "rollout log-probs as old_log_probs instead of wrapping the loss")
        self.policy_loss = policy_loss
        self.config = config
        self.last_metrics: dict[str, torch.Tensor] = {}
        self.micro_batch_size = int(micro_batch_size)
        self._empty_rows = 0  # fully rejected rows left empty since the last training phase
        self._warned_unprepared = False

    @classmethod
    def from_args(
        cls,
        args: Any,
        config: Any = None,
        *,
        policy_loss_cls: Any = None,
    ) -> "RolloutCorrectionPolicyLoss":
        """Build from OpenRLHF's parsed args exactly as ``ppo_actor.py`` builds its ``PolicyLoss``.

        ``args`` is the namespace ``train_ppo_ray`` produces (``self.args`` in the actor).
        ``config`` (a config, preset name or mapping) replaces the mapping of OpenRLHF's
        ``is_correction_type`` by any correction of this library, e.g. a token-level rejection
        (``--algo.advantage.is_correction_enable`` is still required for the log-probs).
        ``policy_loss_cls`` defaults to ``openrlhf.models.PolicyLoss``.
        """
        check_openrlhf_version()
        mapped = config_from_openrlhf_args(args)
        if policy_loss_cls is None:
            from openrlhf.models import PolicyLoss as policy_loss_cls  # noqa: N813
        policy_loss = policy_loss_cls(
            clip_eps_low=args.actor.eps_clip_low_high[0],
            clip_eps_high=args.actor.eps_clip_low_high[1],
            dual_clip=args.actor.dual_clip,
            policy_loss_type=args.actor.policy_loss_type,
            enable_vllm_is_correction=False,
        )
        return cls(policy_loss, mapped if config is None else as_config(config),
                   micro_batch_size=args.train.micro_batch_size)

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
            raise ValueError(
                "experience.rollout_log_probs is None: add --algo.advantage.is_correction_enable so "
                "vLLM returns its sampling log-probs"
            )
        result = compute_rollout_correction(
            experience.action_log_probs, experience.rollout_log_probs, mask, self.config
        )
        valid = mask.to(torch.bool)
        kept = result.response_mask.to(torch.bool) & valid
        n_valid = valid.sum(-1)
        rejected = (n_valid - kept.sum(-1)).float()
        placeholder = torch.zeros_like(n_valid, dtype=torch.bool)
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
            raise ValueError(
                "rollout_log_probs is None: add --algo.advantage.is_correction_enable so vLLM returns "
                "its sampling log-probs"
            )
        self._empty_rows = 0  # a training phase: the next prepare_experience starts a new step
        result = compute_rollout_correction(old_log_probs.detach(), rollout_log_probs, action_mask, self.config)
        self.last_metrics = result.metrics
        mask = result.response_mask.to(action_mask.dtype)
        # Tokens rejected here but counted by OpenRLHF (placeholders have advantage 0 and do not count).
        counted = action_mask.to(torch.bool) & ~mask.to(torch.bool) & (advantages != 0)
        if not self._warned_unprepared and bool(counted.any()):
            self._warned_unprepared = True
            logger.warning(
                "rollout-correction rejected tokens inside the loss: they are left out of the loss but "
                "still counted in batch_num_tokens / global_batch_size. Call "
                "actor_loss_fn.prepare_experience(experience) where the actor appends to its replay "
                "buffer (docs/integrations.md, OpenRLHF)"
            )
        if result.weights is not None:
            advantages = advantages * result.weights.to(advantages.dtype)
        loss, clip_ratio, ppo_kl, _ = self.policy_loss(
            log_probs, old_log_probs, advantages, action_mask=mask, rollout_log_probs=rollout_log_probs,
            dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        )
        valid = mask.to(torch.bool)
        diff = torch.where(valid, rollout_log_probs.float() - old_log_probs.detach().float(), 0.0)
        diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
        vllm_kl = diff.sum() / valid.sum().clamp(min=1)
        return loss, clip_ratio, ppo_kl, vllm_kl
