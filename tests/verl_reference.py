"""Load verl 0.9.1's real rollout-correction and policy-loss modules for side-by-side checks.

The comparison tests and benchmarks run the *installed* verl 0.9.1 files, unmodified:

* ``verl/trainer/ppo/rollout_corr_helper.py``  (IS weights, rejection masks, metrics)
* ``verl/trainer/ppo/core_algos.py``           (``compute_policy_loss_vanilla``, ``agg_loss``, ...)
* ``verl/utils/torch_functional.py``           (``masked_mean`` etc. — the real one, not a copy)

Install (what CI runs)::

    pip install --no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3
    pip install numpy packaging omegaconf transformers codetiming orjson cloudpickle

verl's ``protocol.py`` imports ``ray`` at module level but only uses it for
``ray.ObjectRef`` / ``ray.get`` on remote futures, which the numerics never touch.
Installing Ray (hundreds of MB) just for that is too heavy, so when ``ray`` is not
importable a light stand-in module is placed in ``sys.modules`` *only while verl is
being imported* and removed afterwards (verl keeps its own reference; nothing else in
the test session can see it). Its ``get`` raises if ever called. That is the only
stand-in: tensordict, omegaconf, transformers and verl's own utilities are real.

Use::

    from verl_reference import load_verl_rollout_corr_helper, load_verl_core_algos, verl_available
    helper = load_verl_rollout_corr_helper()   # raises VerlUnavailable with the pip line if missing
    if verl_available(): ...                    # no exception, no skip

Test modules that compare against verl call :func:`require_verl` at import time so a
missing install fails loudly in CI instead of silently skipping.

Comparison helpers shared by those tests and ``benchmarks/bench_vs_verl.py``:
:func:`verl_equivalent_rs_threshold` (our k1 ratio bounds spelled in verl's sign convention)
and :func:`assert_metrics_match`.
"""

from __future__ import annotations

import functools
import math
import importlib
import importlib.metadata
import sys
import types

VERL_VERSION = "0.9.1"

INSTALL_HINT = (
    "pip install --no-deps verl==0.9.1 tensordict==0.15.3 pyvers==0.2.3 && "
    "pip install numpy packaging omegaconf transformers codetiming orjson cloudpickle"
)


class VerlUnavailable(RuntimeError):
    """verl 0.9.1 (or one of the small real packages it imports) is not installed."""


def _ray_stand_in() -> types.ModuleType:
    """A module with the two names verl.protocol references at import time."""
    ray = types.ModuleType("ray")
    ray.__doc__ = "Stand-in for ray: verl's numerics never use it (see tests/verl_reference.py)."

    class ObjectRef:  # only used in isinstance checks / annotations
        pass

    def get(*_args, **_kwargs):
        raise RuntimeError("ray is not installed; the stand-in cannot resolve remote objects")

    ray.ObjectRef = ObjectRef
    ray.get = get
    ray.__rollout_correction_stand_in__ = True
    return ray


def _ray_importable() -> bool:
    try:
        importlib.import_module("ray")
    except ImportError:
        return False
    return True


def ray_or_stand_in() -> None:
    """For a fresh process about to ``import verl``: the stand-in only where ray is not installed."""
    if not _ray_importable():
        sys.modules["ray"] = _ray_stand_in()


@functools.lru_cache(maxsize=None)
def _import(module_name: str) -> types.ModuleType:
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError as exc:
        raise VerlUnavailable(f"verl is not installed; run: {INSTALL_HINT}") from exc
    if version != VERL_VERSION:
        raise VerlUnavailable(f"verl {version} is installed, the comparison needs {VERL_VERSION}: {INSTALL_HINT}")

    inserted = False
    if "verl" not in sys.modules and not _ray_importable():
        sys.modules["ray"] = _ray_stand_in()
        inserted = True
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise VerlUnavailable(f"importing {module_name} failed ({exc}); run: {INSTALL_HINT}") from exc
    finally:
        if inserted and getattr(sys.modules.get("ray"), "__rollout_correction_stand_in__", False):
            del sys.modules["ray"]


def load_verl_rollout_corr_helper() -> types.ModuleType:
    """verl 0.9.1's real ``verl.trainer.ppo.rollout_corr_helper`` module."""
    return _import("verl.trainer.ppo.rollout_corr_helper")


def load_verl_core_algos() -> types.ModuleType:
    """verl 0.9.1's real ``verl.trainer.ppo.core_algos`` module."""
    return _import("verl.trainer.ppo.core_algos")


def load_verl_torch_functional() -> types.ModuleType:
    """verl 0.9.1's real ``verl.utils.torch_functional`` module."""
    return _import("verl.utils.torch_functional")


def load_verl_algorithm_config() -> types.ModuleType:
    """verl 0.9.1's ``verl.trainer.config.algorithm`` (``RolloutCorrectionConfig`` and its presets)."""
    return _import("verl.trainer.config.algorithm")


def verl_unavailable_reason() -> str | None:
    """None when verl 0.9.1 loads; otherwise a message with the install line."""
    try:
        load_verl_rollout_corr_helper()
        load_verl_core_algos()
    except VerlUnavailable as exc:
        return str(exc)
    return None


def verl_available() -> bool:
    """True when verl 0.9.1's helper and core_algos load (never raises, never skips)."""
    return verl_unavailable_reason() is None


def require_verl() -> None:
    """Raise :class:`VerlUnavailable` (with the pip line) unless verl 0.9.1 loads."""
    reason = verl_unavailable_reason()
    if reason is not None:
        raise VerlUnavailable(reason)


# ----------------------------------------------------------------------------- comparison helpers


def _k1_bounds(spec: str) -> tuple[float, float]:
    if "_" in spec:
        lo, hi = spec.split("_", 1)
        return float(lo), float(hi)
    hi = float(spec)
    return 1.0 / hi, hi


def verl_equivalent_rs_threshold(rollout_rs, threshold):
    """verl spelling of our RS thresholds: k1 ratio bounds "lo_hi" become "(1/hi)_(1/lo)".

    verl accepts a sequence iff log lo ≤ −log ρ_agg ≤ log hi, i.e. 1/hi ≤ ρ_agg ≤ 1/lo; giving
    it the reciprocal-swapped band makes it accept exactly lo ≤ ρ_agg ≤ hi, our semantics.
    """
    if rollout_rs is None or threshold is None:
        return threshold
    options = [o.strip() for o in rollout_rs.split(",") if o.strip()]
    specs = [s.strip() for s in str(threshold).split(",")] if isinstance(threshold, str) else [str(threshold)]
    if len(specs) == 1:
        specs = specs * len(options)
    out = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            lo, hi = _k1_bounds(spec)
            out.append(f"{1.0 / hi!r}_{1.0 / lo!r}")
        else:
            out.append(spec)
    return ",".join(out)


def assert_metrics_match(verl_metrics: dict, our_metrics: dict, rtol=2e-5, atol=1e-6, context=""):
    """Every metric verl reports exists in ours and agrees to the tolerance (all listed on failure)."""
    missing = sorted(set(verl_metrics) - set(our_metrics))
    assert not missing, f"{context}: metrics verl reports but we do not: {missing}"
    bad = []
    for key, expected in verl_metrics.items():
        got = our_metrics[key]
        if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol):
            bad.append(f"{key}: verl={expected!r} ours={got!r}")
    assert not bad, f"{context}: metric mismatches:\n  " + "\n  ".join(bad)
