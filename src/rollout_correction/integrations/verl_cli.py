"""``rollout-correction verl-check``: does ``import verl`` load this library's plugin here?

verl logs a plugin that fails to import at DEBUG only, so a broken install would silently leave
verl's own correction step in place. This command imports verl the way each verl process does
and reports whether the plugin loaded and installed its dispatcher (exit 0) or why not (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys

PLUGIN = "rollout_correction.integrations.verl"


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
    if not plugin.plugin_active():
        print("verl-check: the plugin loaded but verl's correction step is not dispatched", file=sys.stderr)
        return 1
    print(f"verl-check: active in verl {verl.__version__}: +algorithm.rollout_correction.backend="
          f"{plugin.BACKEND_NAME} routes the correction step here; loss_mode={plugin.LOSS_NAME} and "
          f"adv_estimator={plugin.ADV_ESTIMATOR_NAME} are registered")
    return 0
