"""verl: this library's policy loss, correction step and GRPO advantage inside verl 0.9.1.

Importing this module (verl does, in every process, through the package's ``verl.plugins`` entry
point) registers two names in verl's ``verl.trainer.ppo.core_algos`` registries, and does nothing else:

* the policy loss ``"rollout_correction"`` (:func:`policy_loss`), selected with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction``;
* the advantage estimator ``"grpo_accepted"`` (:func:`grpo_accepted_advantage`), GRPO whose group
  baselines use accepted rows only, selected with ``algorithm.adv_estimator=grpo_accepted``.

verl's correction step (``compute_rollout_correction_and_add_to_batch``) stays verl's own. This
library's step runs where the user starts verl through this library's entry point,
``python -m rollout_correction.integrations.verl.main_ppo`` (:mod:`.main_ppo`): it mirrors
``verl.trainer.main_ppo`` with a V1 trainer subclass (:mod:`.trainer`) whose ``_compute_advantage``
calls this library and writes the corrected mask as the workers' ``loss_mask``, so rejected tokens
leave ``batch_num_tokens``. :func:`compute_rollout_correction_and_add_to_batch` is that step on a
``DataProto``; :func:`wire_trainer_config` copies the ``algorithm.rollout_correction`` block into the
actor's config before the workers are created.

Whichever piece runs, this library says once per process in the log that it runs, and adds
:data:`BACKEND_METRIC` (``rollout_corr/backend/rollout_correction``, which nothing in verl emits) to
the correction step's metrics and to the loss's (verl logs the latter as ``actor/...``).

verl's configuration is accepted unchanged: the ``algorithm.rollout_correction`` YAML block (or
verl's ``RolloutCorrectionConfig`` dataclass, or a plain dict) with any key either verl
generation documents, and the actor's ``policy_loss`` / ``clip_ratio*`` / ``global_batch_info``.
The entry point adds one key to the block, ``backend`` (``rollout_correction``, its default, or
``verl``), and removes it before verl sees the config: a ``backend`` key that reaches the loss or
the estimator was added to verl's own entry point (``+algorithm.rollout_correction.backend=...``),
where this library's step cannot run, and is refused there.

Wiring traps of verl that this path avoids:

* **bypass settings never reaching the workers** (verl #4912, #4930). verl's trainer switches
  to bypass by mutating ``actor.policy_loss`` on the driver (``apply_bypass_mode``) after the
  workers already hold their copy of the config. :func:`wire_trainer_config` writes
  ``loss_mode`` and the ``rollout_correction`` block into the actor config *before* the trainer
  builds its workers, and turns on ``rollout.calculate_log_probs`` when bypass needs rollout
  log-probs; the loss reads bypass mode from the worker's own config. Registration itself must
  also happen in each worker process: install the package (its ``verl.plugins`` entry point makes
  verl import this module in every process) or set
  ``VERL_USE_EXTERNAL_MODULES=rollout_correction.integrations.verl`` in the workers' environment.
* **rejected rows still entering GRPO group baselines** (verl #6375). verl computes GRPO means
  and standard deviations over every row of a group, including rows that rejection sampling
  removed from the loss. ``grpo_accepted`` uses only the rows with a valid token left in
  ``response_mask``; rejected rows get advantage 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rollout_correction import METRIC_PREFIX, RolloutCorrectionConfig, as_config, compute_policy_loss
from rollout_correction import config_value as _get
from rollout_correction import settings_dict
from rollout_correction.advantages import group_advantages
from rollout_correction import metrics_to_floats
from rollout_correction_core import Aggregation, ClipRange, PolicyLoss

__all__ = [
    "LOSS_NAME",
    "ADV_ESTIMATOR_NAME",
    "config_from_verl",
    "compute_rollout_correction_and_add_to_batch",
    "policy_loss",
    "grpo_accepted_advantage",
    "wire_trainer_config",
    "register",
    "registered",
    "require_registration",
    "REGISTRATION_ERROR",
    "BACKEND_KEY",
    "BACKEND_NAME",
    "BACKEND_METRIC",
    "ENTRY_POINT",
    "backend_requested",
    "check_trainer_config",
    "refuse_backend_key",
    "refuse_keys_verls_step_ignores",
]

LOSS_NAME = "rollout_correction"
ADV_ESTIMATOR_NAME = "grpo_accepted"


def config_from_verl(cfg: Any) -> Optional[RolloutCorrectionConfig]:
    """Our config from verl's ``algorithm.rollout_correction`` block (dict, DictConfig or dataclass).

    None (verl's "block absent") stays None. Unknown keys raise, naming the key.
    """
    return None if cfg is None else as_config(cfg)


def compute_rollout_correction_and_add_to_batch(batch: Any, rollout_corr_config: Any, *,
                                                monitor: Any = None) -> tuple[Any, dict[str, float]]:
    """Replacement for verl's function of this name (decoupled mode).

    The batch step is :func:`rollout_correction.compat.verl.compute_rollout_correction_and_add_to_batch`
    (one implementation: strict about unknown keys, honours every setting of the block). Given a
    ``monitor`` (:class:`rollout_correction.monitor.HealthMonitor`), it feeds it the step's metrics
    and adds its ``rollout_corr/health/*`` numbers; without one it feeds the deprecated
    process-wide monitor if ``set_active_monitor`` set one, else nothing.
    """
    from rollout_correction.compat.verl import compute_rollout_correction_and_add_to_batch as batch_step
    from rollout_correction.monitor import active_monitor  # both sit beside the adapters, not below

    batch, metrics = batch_step(batch, rollout_corr_config)
    monitor = monitor if monitor is not None else active_monitor()
    return batch, ({**metrics, **monitor.observe(metrics)} if monitor is not None else metrics)


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl policy-loss function (``PolicyLossFn`` signature) backed by this library.

    Decoupled (the actor's ``policy_loss.rollout_correction.bypass_mode`` false or absent):
    ℓ_t = w_t · ℓ^{loss_type}_t(π_θ/π_old) with verl's precomputed ``rollout_is_weights`` w (none:
    w=1), on the mask the driver's correction step left, aggregated with ``loss_agg_mode`` and verl's
    ``global_batch_info`` denominators; with ``ppo_clip`` (and no OPSM) these are the numbers of verl's
    ``compute_policy_loss_vanilla``, with ``gspo`` those of verl's ``compute_policy_loss_gspo``. The
    block's ``loss_type`` (ppo_clip, gspo, cispo, dppo_tv, dppo_kl) and ``rollout_opsm_delta`` act
    here; its IS, rejection and M2PO keys act in the driver's correction step (already applied), and
    a block asking for IS weights that verl did not pass is refused. verl's loss call passes no
    rollout log-probs, so OPSM compares π_old with π_θ here (the rule of
    :func:`~rollout_correction.compute_policy_loss`: π_rollout when given, otherwise π_old).

    Bypass (``bypass_mode`` true; verl's trainer has set ``old_log_prob`` to the rollout
    log-probs): the correction is computed here from π_θ vs π_rollout and every key of the block
    acts here: ``loss_type="ppo_clip"`` clips against π_rollout with the rejection mask applied,
    ``"reinforce"`` is −sg(w)·A·log π_θ, ``gspo`` / ``cispo`` / ``dppo_*`` / ``topr`` use
    r = π_θ/π_rollout, OPSM compares π_rollout with π_θ. Batch-level keys (``rollout_m2po_threshold``,
    ``rollout_is_batch_normalize``) act over the micro-batch the loss receives.
    The worker only sees the actor's block: neither verl trainer passes ``algorithm.rollout_correction``
    to it in time, hence the line
    ``+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}``.
    The rejection happens per micro-batch, after verl counted ``batch_num_tokens``, so rejected
    tokens stay in that denominator (as in verl's own bypass loss); ``loss_denominator`` decides the
    local counts (the per-sequence token counts of the seq-mean modes), and ``"valid"`` is refused in
    decoupled mode (the mask arrives already rejected).

    Args follow verl: (B, T) tensors; ``config`` is the actor config (``clip_ratio``,
    ``clip_ratio_low``/``_high``, ``clip_ratio_c``, ``policy_loss``, ``global_batch_info``).
    Returns (loss, metrics as floats: ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower``, :data:`BACKEND_METRIC` = 1 (verl's worker logs it as
    ``actor/rollout_corr/backend/rollout_correction``) and, in bypass mode, the ``rollout_corr/...``
    metrics). The first call in a process says once in the log that this library's loss runs.
    """
    if config is None:
        raise ValueError("the rollout_correction policy loss needs verl's actor config (clip ratios)")
    clip = _get(config, "clip_ratio", 0.2)
    low = _get(config, "clip_ratio_low", None)
    high = _get(config, "clip_ratio_high", None)
    clip_c = _get(config, "clip_ratio_c", 3.0)
    info = dict(_get(config, "global_batch_info", None) or {})
    rc = _actor_block(config)
    bypass = rc is not None and rc.bypass_mode
    if bypass:
        rc.refuse_segments("verl's policy-loss call (bypass mode; the decoupled correction step reads "
                           "batch.batch['segment_ids'])")
    if not bypass:
        # Decoupled: the driver's correction step already computed the IS weights and the rejection
        # mask; the loss runs the block's loss_type and OPSM on them (IS and RS off here).
        if rc is None and rollout_is_weights is None:
            _say_once("no_block", "rollout_correction loss: no IS weights from the driver and no "
                      "actor_rollout_ref.actor.policy_loss.rollout_correction block, so this is PPO on the "
                      "driver's rejection mask only; for bypass mode, loss_type or rollout_opsm_delta add "
                      "'+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'")
        if rc is not None and rc.loss_denominator == "valid":
            raise ValueError(
                "loss_denominator='valid' is not available in verl's decoupled mode: the driver's correction "
                "step rejects tokens from response_mask before the loss runs, and the V1 trainer counts "
                "batch_num_tokens from the corrected loss_mask, so the loss cannot count them again. Use "
                "loss_denominator='kept' (the default), or bypass mode, where the loss computes the rejection "
                "and honours it")
        rc = _decoupled_loss_config(rc, rollout_is_weights)
    loss, metrics = compute_policy_loss(
        log_prob, None if bypass else old_log_prob, advantages, response_mask, config=rc,
        rollout_log_prob=old_log_prob if bypass else None,
        rollout_is_weights=None if bypass else rollout_is_weights,
        loss=PolicyLoss(
            clip=ClipRange(
                low=low if low is not None else clip, high=high if high is not None else clip, dual=clip_c),
            aggregation=Aggregation(
                loss_agg_mode, global_num_tokens=info.get("batch_num_tokens"),
                global_num_seqs=info.get("global_batch_size"), dp_size=int(info.get("dp_size", 1) or 1),
                scale_factor=info.get("loss_scale_factor"))))
    _say_once("loss", f"rollout_correction: verl's policy loss runs this library "
              f"(actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_NAME}, {'bypass' if bypass else 'decoupled'} mode)")
    return loss, {**metrics_to_floats(metrics), BACKEND_METRIC: 1.0}


def _decoupled_loss_config(rc: Optional[RolloutCorrectionConfig],
                           rollout_is_weights: Optional[torch.Tensor]) -> RolloutCorrectionConfig:
    """What the loss itself does in decoupled mode: the block's ``loss_type``, ``rollout_opsm_delta``,
    ``on_nonfinite`` and metric families; IS, rejection and M2PO are the driver's correction step's
    (already applied).

    verl's loss call (``ppo_loss``) passes no rollout log-probs, so OPSM compares π_old with π_θ here
    (:func:`~rollout_correction.compute_policy_loss`: π_rollout when given, otherwise π_old). A block
    that asks for IS weights the driver did not deliver is refused, naming the key.
    """
    if rc is None:
        return RolloutCorrectionConfig.disabled()
    if rc.is_enabled and rollout_is_weights is None:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is={rc.rollout_is!r}: in decoupled "
            "mode the IS weights are computed by verl's correction step on the driver from "
            "algorithm.rollout_correction, and verl passed none to the loss; set rollout_is there (the same "
            "block: '+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'), "
            "or bypass_mode=true to compute the correction in the loss")
    return RolloutCorrectionConfig(loss_type=rc.loss_type, rollout_opsm_delta=rc.rollout_opsm_delta,
                                   on_nonfinite=rc.on_nonfinite, metrics=rc.metrics,
                                   mismatch_metrics=rc.mismatch_metrics)


def _actor_block(config: Any) -> Optional[RolloutCorrectionConfig]:
    """The actor's ``policy_loss.rollout_correction`` block, or None when the user gave none.

    verl's worker config fills an absent block with its ``RolloutCorrectionConfig()`` dataclass
    defaults (``_target_`` empty, ``rollout_is="sequence"`` unlike the YAML): that counts as none.
    The block may be an interpolation of ``algorithm.rollout_correction``; a ``backend`` key in it is
    refused (:func:`refuse_backend_key`: this library's entry point removes it); any other unknown key
    raises, naming it.
    """
    block = _get(_get(config, "policy_loss", None), "rollout_correction", None)
    refuse_backend_key(block, "actor_rollout_ref.actor.policy_loss.rollout_correction")
    if block is None or (dataclasses.is_dataclass(block) and type(block).__module__.startswith("verl.")
                         and block == type(block)()):
        return None
    return config_from_verl(_block_settings(block))


def _block_settings(block: Any) -> dict[str, Any]:
    """The block's settings without the entry point's ``backend`` key (not a config key;
    ``_target_`` is one :func:`~rollout_correction.as_config` ignores)."""
    return {k: v for k, v in settings_dict(block).items() if k != BACKEND_KEY}


_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        import logging

        logging.getLogger(__name__).warning(message)


def grpo_accepted_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Optional[bool] = None,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages whose group statistics use accepted rows only (fixes verl #6375).

    Row i is accepted iff ``response_mask[i]`` still has a valid token (rejection sampling zeroes
    a rejected row). With r_i = Σ_t token_level_rewards[i, t] and A_g the accepted rows of group g:
    Â_i = (r_i − mean_{A_g} r) / (std_{A_g} r + ε)  (or without the division when
    ``norm_adv_by_std_in_grpo`` is false; read from ``config`` when not given), broadcast over the
    row's valid tokens. Rejected rows, and groups with fewer than two accepted rows, get 0 (verl
    gives a lone row its raw score). Without rejection and with groups of ≥ 2 this equals verl's
    ``compute_grpo_outcome_advantage``. Returns (advantages, returns), both (B, T), as verl's does.
    A ``backend`` key in ``config.rollout_correction`` (verl passes ``algorithm``) is refused
    (:func:`refuse_backend_key`).
    """
    refuse_backend_key(_get(config, "rollout_correction", None), "algorithm.rollout_correction")
    if index is None:
        raise ValueError("grpo_accepted needs the group index (verl passes non_tensor_batch['uid'])")
    if norm_adv_by_std_in_grpo is None:
        norm_adv_by_std_in_grpo = bool(_get(config, "norm_adv_by_std_in_grpo", True))
    scores = token_level_rewards.sum(dim=-1)
    result = group_advantages(scores, list(index), estimator="grpo", response_mask=response_mask,
                              norm_by_std=norm_adv_by_std_in_grpo, epsilon=epsilon)
    adv = result.token_advantages.to(token_level_rewards.dtype)
    return adv, adv


def wire_trainer_config(config: Any, *, grpo_accepted: bool = True) -> Any:
    """Write the ``algorithm.rollout_correction`` block where verl's workers read it, before they exist.

    Reads ``config.algorithm.rollout_correction`` (unchanged verl block) and writes, in place:
    ``actor_rollout_ref.actor.policy_loss.loss_mode = "rollout_correction"``,
    ``actor_rollout_ref.actor.policy_loss.rollout_correction = <the block>``, and, in bypass mode,
    ``actor_rollout_ref.rollout.calculate_log_probs = True``. With ``grpo_accepted`` and
    ``algorithm.adv_estimator == "grpo"`` the estimator becomes ``"grpo_accepted"`` when
    rejection sampling is configured. The block is validated here, so a bad key fails on the
    driver before any worker starts. Returns ``config``.

    It changes the config only: which correction step runs is decided by the entry point (this
    library's with :mod:`rollout_correction.integrations.verl.main_ppo`, verl's with verl's own).
    """
    from omegaconf import OmegaConf, open_dict

    block = _get(_get(config, "algorithm", None), "rollout_correction", None)
    if block is None:
        return config
    backend_requested(block)  # a misspelt backend fails here, naming it
    settings = _block_settings(block)
    cfg = config_from_verl(settings)
    actor = config.actor_rollout_ref.actor
    mode = _get(_get(actor, "policy_loss", None), "loss_mode", None)
    if mode is not None and str(mode) not in _COMPATIBLE_LOSS_MODES:
        hint = (f"set loss_type: {mode} in algorithm.rollout_correction (this library's {mode}, with its IS "
                "weights and masks) and leave loss_mode at vanilla" if str(mode) in _LOSS_TYPES_OF_VERL else
                "leave loss_mode at vanilla")
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}: wire_trainer_config replaces "
                         f"the loss with {LOSS_NAME!r}, which would drop verl's {mode!r} loss; {hint}, or keep "
                         f"verl's loss without wire_trainer_config (this library's correction step through "
                         f"{ENTRY_POINT}, verl's loss on its weights)")
    with open_dict(config):
        if _get(actor, "policy_loss", None) is None:
            actor.policy_loss = OmegaConf.create({})
        actor.policy_loss.loss_mode = LOSS_NAME
        actor.policy_loss.rollout_correction = OmegaConf.create(settings)
        if cfg.bypass_mode:
            config.actor_rollout_ref.rollout.calculate_log_probs = True
        if grpo_accepted and cfg.rs_enabled and str(_get(config.algorithm, "adv_estimator", "")) == "grpo":
            config.algorithm.adv_estimator = ADV_ESTIMATOR_NAME
    check_trainer_config(config)
    return config


#: verl loss modes that wire_trainer_config may replace: verl's default, its bypass loss (written
#: by verl's own bypass set-up) and ours.
_COMPATIBLE_LOSS_MODES = ("vanilla", "bypass_mode", LOSS_NAME)
#: verl 0.9.1 loss modes that are a ``loss_type`` of this library.
_LOSS_TYPES_OF_VERL = ("gspo", "cispo", "dppo_tv", "dppo_kl")
#: loss_type values verl's own losses implement (its bypass loss: ppo_clip, reinforce).
_VERL_LOSS_TYPES = ("ppo_clip", "reinforce")


def check_trainer_config(config: Any) -> None:
    """Refuse settings of ``algorithm.rollout_correction`` that would not act where verl runs them.

    ``loss_type`` (other than ppo_clip / reinforce) and ``rollout_opsm_delta`` act in this library's
    policy loss only, which reads them from ``actor_rollout_ref.actor.policy_loss.rollout_correction``:
    with another ``loss_mode`` (verl's own loss runs), or without that block in the actor config,
    they would be ignored silently, so this raises, naming the key and where it acts. Called by
    :func:`wire_trainer_config` and by this library's correction step (with the trainer's config).
    """
    block = _get(_get(config, "algorithm", None), "rollout_correction", None)
    if block is None:
        return
    cfg = config_from_verl(_block_settings(block))
    wanted = {}
    if cfg.loss_type not in _VERL_LOSS_TYPES:
        wanted["loss_type"] = cfg.loss_type
    if cfg.rollout_opsm_delta is not None:
        wanted["rollout_opsm_delta"] = cfg.rollout_opsm_delta
    if not wanted:
        return
    key, value = next(iter(wanted.items()))
    actor = _get(_get(config, "actor_rollout_ref", None), "actor", None)
    mode = str(_get(_get(actor, "policy_loss", None), "loss_mode", "vanilla"))
    where = (f"it acts in this library's policy loss only (actor_rollout_ref.actor.policy_loss.loss_mode="
             f"{LOSS_NAME}, reading actor_rollout_ref.actor.policy_loss.rollout_correction)")
    if mode != LOSS_NAME:
        raise ValueError(f"algorithm.rollout_correction.{key}={value!r}: {where}, but loss_mode={mode!r} runs "
                         f"verl's own loss, which would ignore it; set loss_mode={LOSS_NAME} (verl's gspo / cispo "
                         "/ dppo_tv / dppo_kl are loss_type values of the block) or remove the key")
    actor_rc = _actor_block(actor)
    if actor_rc is None or any(getattr(actor_rc, k) != v for k, v in wanted.items()):
        raise ValueError(f"algorithm.rollout_correction.{key}={value!r}: {where}, and the actor's block "
                         f"{'is absent' if actor_rc is None else 'differs'}; add "
                         "'+actor_rollout_ref.actor.policy_loss.rollout_correction=${algorithm.rollout_correction}'")


def register(core_algos: Any = None) -> None:
    """Register the policy loss and the advantage estimator in verl's registries (idempotent)."""
    if core_algos is None:
        from verl.trainer.ppo import core_algos
    if core_algos.POLICY_LOSS_REGISTRY.get(LOSS_NAME) is not policy_loss:
        core_algos.register_policy_loss(LOSS_NAME)(policy_loss)
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR_NAME) is not grpo_accepted_advantage:
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(ADV_ESTIMATOR_NAME, None)  # a stale copy after a reload
        core_algos.register_adv_est(ADV_ESTIMATOR_NAME)(grpo_accepted_advantage)


def registered(core_algos: Any = None) -> bool:
    """True when verl's registries resolve both names to this library's functions."""
    if core_algos is None:
        from verl.trainer.ppo import core_algos
    return (core_algos.POLICY_LOSS_REGISTRY.get(LOSS_NAME) is policy_loss
            and core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR_NAME) is grpo_accepted_advantage)


#: The entry point that runs verl with this library's correction step (mirrors ``verl.trainer.main_ppo``).
ENTRY_POINT = "python -m rollout_correction.integrations.verl.main_ppo"
#: ``algorithm.rollout_correction.backend``: a key of the entry point's config only (``rollout_correction``
#: by default, ``verl`` keeps verl's step); the entry point removes it before verl sees the config.
BACKEND_KEY = "backend"
BACKEND_NAME = "rollout_correction"
#: Logged with value 1.0 by every correction step this library runs inside verl.
BACKEND_METRIC = f"{METRIC_PREFIX}backend/rollout_correction"


def backend_requested(rollout_corr_config: Any) -> bool:
    """True when the block says ``backend: rollout_correction`` (or has no ``backend`` key: the entry
    point's default); False for ``backend: verl``. Any other value raises, naming it."""
    value = _backend_value(rollout_corr_config)  # verl's config dataclass has no such field: None
    if value is None or str(value) == BACKEND_NAME:
        return True
    if str(value) != "verl":
        raise ValueError(f"algorithm.rollout_correction.{BACKEND_KEY}={value!r}: use {BACKEND_NAME!r} "
                         "(this library's correction step) or 'verl' (verl's own)")
    return False


def refuse_backend_key(rollout_corr_config: Any, where: str) -> None:
    """Refuse a ``backend`` key that reached verl's processes.

    :mod:`.main_ppo` removes the key before verl sees the config, so a block that still has it was
    given to verl's own entry point (``+algorithm.rollout_correction.backend=...``), where verl's own
    correction step runs and ignores it. Called by the loss and the estimator (``where`` names them).
    """
    value = _backend_value(rollout_corr_config)
    if value is None:
        return
    raise ValueError(
        f"{where}.{BACKEND_KEY}={value!r}: this key belongs to this library's entry point ({ENTRY_POINT} "
        f"<verl's overrides>, where it is written without '+'), which removes it before verl sees the config; "
        f"here verl was started by another entry point, so verl's own correction step runs and would ignore "
        f"the key. Start the run with {ENTRY_POINT}, or remove the key to keep verl's step")


#: The keys verl 0.9.1's own correction step reads (``rollout_corr_helper``), plus those its trainer
#: and losses read (bypass_mode, loss_type) and those this library's policy loss reads.
_VERL_STEP_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                   "rollout_rs_threshold", "bypass_mode", "loss_type", "rollout_opsm_delta", BACKEND_KEY, "_target_")


def refuse_keys_verls_step_ignores(rollout_corr_config: Any) -> None:
    """verl's own correction step reads five keys and ignores the rest: a setting of this library's
    step (veto, lower bounds, ``rollout_is_mode``, M2PO, ``on_nonfinite``, ``check_alignment``) that
    differs from its default is refused, naming the key and where it acts."""
    if rollout_corr_config is None or _get(rollout_corr_config, "bypass_mode", False):
        return  # bypass: every key acts in this library's loss
    defaults = RolloutCorrectionConfig()
    for key, value in settings_dict(rollout_corr_config).items():
        if key in _VERL_STEP_KEYS or value is None or value == getattr(defaults, key, None):
            continue
        raise ValueError(f"algorithm.rollout_correction.{key}={value!r}: verl's own correction step ignores it; "
                         f"it acts in this library's correction step ({ENTRY_POINT}, without "
                         f"algorithm.rollout_correction.{BACKEND_KEY}=verl)")


def _backend_value(rollout_corr_config: Any) -> Any:
    try:
        return _get(rollout_corr_config, BACKEND_KEY, None) if rollout_corr_config is not None else None
    except (AttributeError, KeyError):
        return None


#: Why the two names are not in verl's registries although verl is installed: the ``ImportError``
#: raised while registering them on import (None when they were registered, or verl is absent).
REGISTRATION_ERROR: Optional[ImportError] = None


def _selected(config: Any) -> list[str]:
    """``loss_mode=rollout_correction`` / ``adv_estimator=grpo_accepted`` where a verl config selects them."""
    out = []
    for path, name in (("actor_rollout_ref.actor.policy_loss.loss_mode", LOSS_NAME),
                       ("algorithm.adv_estimator", ADV_ESTIMATOR_NAME)):
        node = config
        for key in path.split("."):
            node = _get(node, key, None) if node is not None else None
        if node is not None and str(node) == name:
            out.append(f"{path}={name}")
    return out


def require_registration(config: Any) -> None:
    """Raise where a verl config selects this library's loss or estimator but registering them
    failed when verl loaded this plugin (the cause chained): verl would otherwise fail later, in
    its workers, with "Unsupported loss mode"."""
    chosen = _selected(config)
    if REGISTRATION_ERROR is not None and chosen:
        raise RuntimeError(
            f"{', '.join(chosen)} selects rollout-correction's names, but registering them in verl's registries "
            f"failed when this plugin was imported: {type(REGISTRATION_ERROR).__name__}: {REGISTRATION_ERROR}. "
            "verl is installed but part of it (or of what it imports) cannot be imported; fix that installation "
            "(the cause is chained below)") from REGISTRATION_ERROR


def _register_on_import() -> None:
    """verl imports this module in each of its processes (the package's ``verl.plugins`` entry
    point) and hides a plugin's exceptions at debug level: silent only when verl is not installed;
    any other import failure is logged here, with its cause, and raised by
    :func:`require_registration` where a config selects the loss."""
    global REGISTRATION_ERROR
    import importlib.util
    import logging

    if importlib.util.find_spec("verl") is None:
        return  # verl is not installed: the functions are usable on their own
    try:
        register()
    except ImportError as exc:
        REGISTRATION_ERROR = exc
        logging.getLogger(__name__).error(
            "rollout_correction: verl is installed, but registering loss_mode=%r and adv_estimator=%r in its "
            "registries failed (%s: %s); a config that selects them will fail", LOSS_NAME, ADV_ESTIMATOR_NAME,
            type(exc).__name__, exc, exc_info=exc)


_register_on_import()
