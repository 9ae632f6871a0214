"""SkyRL 0.4.0's own code, loaded for the tests from its unpacked wheel.

SkyRL's wheel declares Python ≥ 3.12 and its ``skyrl.backends`` package ``__init__`` fails on older
Pythons (a pydantic model with ``typing.TypedDict``), so CI downloads the wheel without installing it
and unpacks it (``.ci/run``; the directory is ``$ROLLOUT_CORRECTION_SKYRL_SOURCE``, by default
``.ci/.skyrl/0.4.0``). The files on the tested path are executed unmodified from it:

* ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` (the five correction
  functions) and ``torch_utils.py`` (``safe_exp_delta``, ``masked_mean``);
* ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (``PolicyLossRegistry``, SkyRL's policy losses,
  each calling ``apply_off_policy_correction``, ``apply_loss_reduction_to_advantages_minibatch``);
* ``skyrl/train/config`` (``AlgorithmConfig``, ``OffPolicyCorrectionConfig``, SkyRL's config
  classes built from its dotted keys by ``from_dict_config``).

Stand-ins: the three ``__init__`` files above ``utils`` (``skyrl.backends`` imports the Tinker
backend) are bare packages over the real directories. CI installs what the files import
(``jaxtyping``, ``loguru``, ``skyrl-gym``, ``ray``, ``omegaconf``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Optional

import pytest

SKYRL_VERSION = "0.4.0"
_SOURCE = "ROLLOUT_CORRECTION_SKYRL_SOURCE"
UTILS = "skyrl.backends.skyrl_train.utils"
CORRECTION = UTILS + ".off_policy_correction_utils"
PPO_UTILS = UTILS + ".ppo_utils"


def source_root() -> Path:
    """The unpacked wheel (the directory holding ``skyrl/``)."""
    default = Path(__file__).resolve().parents[1] / ".ci" / ".skyrl" / SKYRL_VERSION
    root = Path(os.environ.get(_SOURCE) or default)
    if not (root / "skyrl" / "__init__.py").is_file():
        pytest.skip(f"SkyRL {SKYRL_VERSION}'s unpacked wheel is not at {root}; .ci/run downloads it "
                    f"(pip download --no-deps skyrl=={SKYRL_VERSION}) and sets {_SOURCE}")
    text = (root / "skyrl" / "__init__.py").read_text()
    assert f'__version__ = "{SKYRL_VERSION}"' in text, f"{root} is not SkyRL {SKYRL_VERSION}"
    return root


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _packages(root: Path) -> None:
    """``skyrl`` itself (its ``__init__`` sets the version) and bare packages down to ``utils``."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import skyrl  # noqa: F401

    for name in ("skyrl.backends", "skyrl.backends.skyrl_train", UTILS):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")))]
            sys.modules[name] = package


def correction_module() -> types.ModuleType:
    """SkyRL's own ``off_policy_correction_utils`` (under a private name; ``torch_utils`` under its own)."""
    root = source_root()
    _packages(root)
    utils = root.joinpath(*UTILS.split("."))
    if UTILS + ".torch_utils" not in sys.modules:
        _load(UTILS + ".torch_utils", utils / "torch_utils.py")
    return _load("skyrl_reference_off_policy_correction_utils", utils / "off_policy_correction_utils.py")


def ppo_utils(correction: Optional[types.ModuleType] = None, name: str = PPO_UTILS) -> types.ModuleType:
    """A fresh load of SkyRL's ``ppo_utils`` (its own registry, its losses registered) whose
    ``from ...off_policy_correction_utils import apply_off_policy_correction`` binds ``correction``
    (SkyRL's own module when None)."""
    correction = correction or correction_module()
    root = source_root()
    previous = sys.modules.get(CORRECTION)
    sys.modules[CORRECTION] = correction
    try:
        return _load(name, root.joinpath(*UTILS.split(".")) / "ppo_utils.py")
    finally:
        if previous is None:
            sys.modules.pop(CORRECTION, None)
        else:
            sys.modules[CORRECTION] = previous


def algorithm_config(lines: list[str]):
    """SkyRL's ``AlgorithmConfig`` from ``trainer.algorithm.<key>=<value>`` lines, built by SkyRL's
    config system (OmegaConf dot-list → ``AlgorithmConfig.from_dict_config``)."""
    from omegaconf import OmegaConf

    source_root()
    from skyrl.train.config import AlgorithmConfig

    prefix = "trainer.algorithm."
    assert all(line.startswith(prefix) for line in lines), lines
    return AlgorithmConfig.from_dict_config(OmegaConf.from_dotlist([line[len(prefix):] for line in lines]))
