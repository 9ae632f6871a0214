"""``python -m rollout_correction.integrations.openrlhf.train_ppo_ray <OpenRLHF's flags>``.

OpenRLHF's own launcher, ``openrlhf.cli.train_ppo_ray``, run as ``__main__`` on the same command
line (its argument parser, its validation, its ``train``), with one difference: the policy actor it
creates in Ray is :func:`~.actor.policy_model_actor` of OpenRLHF's ``PolicyModelActor``, whose loss
and replay-buffer append are this library's. No OpenRLHF file is edited.

OpenRLHF's launcher takes its actor class from the name ``PolicyModelActor`` it imports from
``openrlhf.trainer.ray.ppo_actor`` and offers no option to supply another, so this launcher binds
that name to the subclass in its own process before running OpenRLHF's launcher (and restores it
after). That is the only OpenRLHF name it touches, in the process the user started with this
command; the actor processes receive the subclass from Ray.

Two options of this launcher's own, removed before OpenRLHF parses the rest:
``--rollout_correction.config CONFIG``, a preset name or a JSON mapping of this library's config
keys, replaces the mapping of OpenRLHF's correction flags (``RolloutCorrectionPolicyLoss.from_args(args,
CONFIG)``); OpenRLHF's flags must still turn the correction on, for the sampling log-probs.
``--rollout_correction.dump_dir DIR`` (off by default) makes each policy actor write its training
step's π_old and π_rollout log-probs and action masks to ``DIR`` once per step, for
``rollout-correction diagnose DIR`` (:mod:`.actor`). ``--rollout_correction.metrics default,raw``
selects the metric families of the ``rollout_corr/...`` metrics (the config's ``metrics`` key), of the
mapped flags' correction or of ``--rollout_correction.config``'s.
"""

from __future__ import annotations

import json
import runpy
import sys
from typing import Any, Optional, Sequence

__all__ = ["CONFIG_OPTION", "DUMP_OPTION", "METRICS_OPTION", "OPENRLHF_MAIN", "main", "parse_config_option",
           "parse_dump_option", "parse_metrics_option"]

CONFIG_OPTION = "--rollout_correction.config"
DUMP_OPTION = "--rollout_correction.dump_dir"
METRICS_OPTION = "--rollout_correction.metrics"
OPENRLHF_MAIN = "openrlhf.cli.train_ppo_ray"


def _pop_option(argv: Sequence[str], option: str, what: str) -> tuple[Optional[str], list[str]]:
    """(the value of ``option`` or None, the other arguments)."""
    rest, value = [], None
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == option or item.startswith(option + "="):
            if item == option:
                if i + 1 >= len(items):
                    raise SystemExit(f"{option} needs a value: {what}")
                value, i = items[i + 1], i + 2
            else:
                value, i = item.split("=", 1)[1], i + 1
            continue
        rest.append(item)
        i += 1
    return value, rest


def parse_dump_option(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """(the directory given with :data:`DUMP_OPTION` or None, the remaining arguments)."""
    return _pop_option(argv, DUMP_OPTION, "a directory")


def parse_metrics_option(argv: Sequence[str]) -> tuple[Optional[tuple[str, ...]], list[str]]:
    """(the metric families given with :data:`METRICS_OPTION`, comma-separated, or None; the other arguments)."""
    value, rest = _pop_option(argv, METRICS_OPTION, "metric families, e.g. default,raw")
    if value is None:
        return None, rest
    from rollout_correction import RolloutCorrectionConfig

    return RolloutCorrectionConfig(metrics=value).metrics, rest  # an unknown family fails here, naming it


def parse_config_option(argv: Sequence[str]) -> tuple[Any, list[str]]:
    """(the config given with :data:`CONFIG_OPTION` or None, the remaining arguments for OpenRLHF)."""
    value, rest = _pop_option(argv, CONFIG_OPTION, "a preset name or a JSON mapping")
    config = None if value is None else json.loads(value) if value.lstrip().startswith("{") else value
    if config is not None:
        from rollout_correction import as_config

        as_config(config)  # a bad key or value fails here, naming it, before Ray starts
    return config, rest


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run OpenRLHF's ``train_ppo_ray`` as ``__main__`` on ``argv`` with this library's policy actor."""
    import ray

    from . import check_openrlhf_version
    from .actor import policy_model_actor

    dump_dir, rest = parse_dump_option(sys.argv[1:] if argv is None else argv)
    metrics, rest = parse_metrics_option(rest)
    config, rest = parse_config_option(rest)
    check_openrlhf_version()
    from openrlhf.trainer.ray import ppo_actor

    openrlhf_actor = ppo_actor.PolicyModelActor
    ppo_actor.PolicyModelActor = ray.remote(num_gpus=1)(policy_model_actor(openrlhf_actor, config, dump_dir, metrics))
    saved_argv = sys.argv
    sys.argv = [OPENRLHF_MAIN, *rest]
    try:
        runpy.run_module(OPENRLHF_MAIN, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        ppo_actor.PolicyModelActor = openrlhf_actor


if __name__ == "__main__":
    main()
