"""verl 0.9.1's rollout-correction helper from its own source files, without verl's dependencies.

``tests/verl_reference.py`` imports the installed verl package, which pulls in tensordict, Ray
(or a stand-in), omegaconf, transformers and much more through ``verl/__init__.py``. Where only
the verl wheel is installed (a GPU machine without network access, say), this module runs the two
files the computation lives in, unmodified, from the installed package:

* ``verl/trainer/ppo/rollout_corr_helper.py``  (IS weights, rejection masks, metrics)
* ``verl/utils/torch_functional.py``           (``masked_mean``, ``masked_sum``, …)

Their other imports are given small stand-ins while the two files load, and removed from
``sys.modules`` afterwards:

* ``verl.protocol.DataProto``: the helper wraps the weights with ``DataProto.from_dict(tensors=…)``
  on return; the stand-in keeps the tensors in ``.batch`` (verl builds a TensorDict there, host
  work of a few tens of microseconds that this leaves out of verl's timings — in verl's favour);
* ``verl.trainer.config.algorithm.RolloutCorrectionConfig`` and
  ``verl.workers.config.actor.PolicyLossConfig``: type annotations only;
* ``verl.utils.device``: ``get_device_name`` / ``get_torch_device``, used by functions of
  ``torch_functional`` the helper does not call;
* ``tensordict.TensorDict`` and ``transformers.PreTrainedTokenizer``, only when those packages are
  not installed: annotations and ``isinstance`` checks in functions the helper does not call.

Nothing of verl's package ``__init__`` runs. The result equals :func:`verl_reference.
load_verl_rollout_corr_helper` on the same inputs (weights, masks and metrics are computed by the
same code).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import torch

VERL_VERSION = "0.9.1"

_PACKAGES = ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.trainer.config", "verl.workers",
             "verl.workers.config")


class _DataProto:
    """Stand-in for ``verl.protocol.DataProto``: holds the tensors in ``.batch``."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict, **_kwargs) -> "_DataProto":
        return cls(dict(tensors))


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def verl_root() -> Path:
    """The installed ``verl`` package folder (its ``__init__`` is not run)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"verl is not installed (pip install --no-deps verl=={VERL_VERSION})")
    version = importlib.metadata.version("verl")
    if version != VERL_VERSION:
        raise ImportError(f"verl {version} is installed, the comparison needs {VERL_VERSION}")
    return Path(list(spec.submodule_search_locations)[0])


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_rollout_corr_helper() -> types.ModuleType:
    """verl 0.9.1's ``rollout_corr_helper`` module, executed from the installed file."""
    root = verl_root()
    stand_ins = {name: _module(name, __path__=[str(root.joinpath(*name.split(".")[1:]))]) for name in _PACKAGES}
    stand_ins["verl.protocol"] = _module("verl.protocol", DataProto=_DataProto)
    stand_ins["verl.trainer.config.algorithm"] = _module("verl.trainer.config.algorithm",
                                                         RolloutCorrectionConfig=type("RolloutCorrectionConfig", (), {}))
    stand_ins["verl.workers.config.actor"] = _module("verl.workers.config.actor",
                                                     PolicyLossConfig=type("PolicyLossConfig", (), {}))
    stand_ins["verl.utils.device"] = _module(
        "verl.utils.device", get_device_name=lambda: "cuda" if torch.cuda.is_available() else "cpu",
        get_torch_device=lambda: torch.cuda)
    if not _importable("tensordict"):
        stand_ins["tensordict"] = _module("tensordict", TensorDict=type("TensorDict", (), {}))
    if not _importable("transformers"):
        stand_ins["transformers"] = _module("transformers", PreTrainedTokenizer=type("PreTrainedTokenizer", (), {}))
    loaded = ("verl.utils.torch_functional", "verl.trainer.ppo.rollout_corr_helper")
    saved = {name: sys.modules.get(name) for name in [*stand_ins, *loaded]}
    try:
        sys.modules.update(stand_ins)
        functional = _exec_file(loaded[0], root / "utils" / "torch_functional.py")
        stand_ins["verl.utils"].torch_functional = functional
        return _exec_file(loaded[1], root / "trainer" / "ppo" / "rollout_corr_helper.py")
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def weights_of(result) -> "torch.Tensor | None":
    """The (B, T) weights in the helper's first return value (a real or stand-in DataProto)."""
    proto = result[0]
    return None if proto is None else proto.batch["rollout_is_weights"]
