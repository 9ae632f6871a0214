"""``rollout-correction verl-check``: what installing this library changed in verl here (two names).

verl logs a plugin that fails to import at DEBUG only, so a broken install would silently leave the
``rollout_correction`` loss and the ``grpo_accepted`` estimator unknown to verl. This command imports
verl the way each verl process does and reports whether the plugin loaded and registered both names
in verl's registries, and that verl's correction step is still verl's own (exit 0), or why not (exit 1).
This library's correction step runs only under its entry point
(``python -m rollout_correction.integrations.verl.main_ppo``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

PLUGIN = "rollout_correction.integrations.verl"
_STEP = "compute_rollout_correction_and_add_to_batch"
_VERL_MODULES = ("verl.trainer.ppo.rollout_corr_helper", "verl.trainer.ppo.v1.trainer_base")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    try:
        import verl
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        print(f"verl-check: `import verl` fails here: {exc!r}", file=sys.stderr)
        return 1
    if PLUGIN not in sys.modules:
        try:
            importlib.import_module(PLUGIN)
            why = ("verl did not load the 'verl.plugins' entry point (is VERL_USE_EXTERNAL_PLUGINS set? "
                   "is the package installed with pip, not only on PYTHONPATH?)")
        except Exception as exc:  # noqa: BLE001
            why = f"the plugin fails to import: {exc!r}"
        print(f"verl-check: NOT active in verl {verl.__version__}: {why}", file=sys.stderr)
        return 1
    plugin = sys.modules[PLUGIN]
    if not plugin.registered():
        print("verl-check: the plugin loaded but verl's registries do not resolve "
              f"loss_mode={plugin.LOSS_NAME} / adv_estimator={plugin.ADV_ESTIMATOR_NAME} to it", file=sys.stderr)
        return 1
    for name in _VERL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # the V1 trainer needs TransferQueue; the helper alone is enough to check
            continue
        step = getattr(module, _STEP)
        if step.__module__ != _VERL_MODULES[0]:
            print(f"verl-check: {name}.{_STEP} is {step.__module__}.{step.__qualname__}, not verl's own: "
                  "something in this process replaced it", file=sys.stderr)
            return 1
    print(f"verl-check: active in verl {verl.__version__}: loss_mode={plugin.LOSS_NAME} and "
          f"adv_estimator={plugin.ADV_ESTIMATOR_NAME} are registered; verl's correction step is verl's own "
          f"(this library's runs under {plugin.ENTRY_POINT})")
    return 0
