"""The drop-in raises, for each bad argument, an exception of the type verl 0.9.1 raises (or a subclass).

Code written against verl (``except ValueError``, ``except KeyError`` …) must keep working when the
import is swapped. Each case calls verl's real function (tests/verl_reference.py) and the drop-in on
the same bad input and compares the types; the drop-in's message is this library's own.
"""

from __future__ import annotations

import pytest
import torch

from verl_reference import load_verl_rollout_corr_helper, require_verl

require_verl()

import rollout_correction.compat.verl as ours  # noqa: E402
from rollout_correction import ConfigError, MissingSettingError, ShapeMismatchError  # noqa: E402

VERL = load_verl_rollout_corr_helper()


def _verl(name):
    """verl's own function (installing this library leaves it in place)."""
    return getattr(VERL, name)


B, T = 4, 5
_gen = torch.Generator().manual_seed(0)
OLD = -torch.rand(B, T, generator=_gen)
ROLLOUT = OLD + 0.1 * torch.randn(B, T, generator=_gen)
MASK = torch.ones(B, T)
LOG_RATIO = OLD - ROLLOUT


def _proto(drop=None):
    from verl.protocol import DataProto

    tensors = {"old_log_probs": OLD.clone(), "rollout_log_probs": ROLLOUT.clone(), "response_mask": MASK.clone()}
    tensors.pop(drop, None)
    return DataProto.from_dict(tensors=tensors)


TOKEN_IS = {"rollout_is": "token", "rollout_is_threshold": 2.0}
MASKS = "compute_rollout_correction_and_rejection_mask"
CASES = {
    # function, positional arguments (a callable so every call gets fresh objects), keyword arguments
    "unknown IS level": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_is": "tokn", "rollout_is_threshold": 2.0}),
    "unknown RS option": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_rs": "seq_foo", "rollout_rs_threshold": 0.1}),
    "RS without threshold": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_rs": "token_k1", "rollout_rs_threshold": None}),
    "RS threshold not a number": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_rs": "token_k1", "rollout_rs_threshold": "abc"}),
    "RS band reversed": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}),
    "RS threshold negative": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": -1.0}),
    "IS threshold negative": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_is": "token", "rollout_is_threshold": -2.0}),
    "IS threshold not a number": (MASKS, lambda: (OLD, ROLLOUT, MASK), {"rollout_is": "token", "rollout_is_threshold": "x"}),
    "log-prob shapes differ": (MASKS, lambda: (OLD, ROLLOUT[:, :3], MASK), TOKEN_IS),
    "mask shape differs": (MASKS, lambda: (OLD, ROLLOUT, MASK[:, :2]), TOKEN_IS),
    "weights: unknown level": ("compute_rollout_correction_weights", lambda: (LOG_RATIO, MASK),
                               {"rollout_is": "tokn", "rollout_is_threshold": 2.0}),
    "weights: threshold None": ("compute_rollout_correction_weights", lambda: (LOG_RATIO, MASK),
                                {"rollout_is": "token", "rollout_is_threshold": None}),
    "rejection: unknown option": ("compute_rollout_rejection_mask", lambda: (LOG_RATIO, MASK),
                                  {"rollout_rs": "bad", "rollout_rs_threshold": 0.1}),
    "rejection: empty option": ("compute_rollout_rejection_mask", lambda: (LOG_RATIO, MASK),
                                {"rollout_rs": "", "rollout_rs_threshold": 0.1}),
    "rejection: threshold None": ("compute_rollout_rejection_mask", lambda: (LOG_RATIO, MASK),
                                  {"rollout_rs": "token_k1", "rollout_rs_threshold": None}),
    "rejection: more thresholds than options": ("compute_rollout_rejection_mask", lambda: (LOG_RATIO, MASK),
                                                {"rollout_rs": "token_k1,seq_mean_k3",
                                                 "rollout_rs_threshold": "0.5_2.0,0.1,0.3"}),
    "batch: config None": ("compute_rollout_correction_and_add_to_batch", lambda: (_proto(), None), {}),
    "batch: config a list": ("compute_rollout_correction_and_add_to_batch", lambda: (_proto(), [1, 2]), {}),
    "batch: batch None": ("compute_rollout_correction_and_add_to_batch", lambda: (None, dict(TOKEN_IS)), {}),
    "batch: old_log_probs missing": ("compute_rollout_correction_and_add_to_batch",
                                     lambda: (_proto("old_log_probs"), dict(TOKEN_IS)), {}),
    "batch: rollout_log_probs missing": ("compute_rollout_correction_and_add_to_batch",
                                         lambda: (_proto("rollout_log_probs"), dict(TOKEN_IS)), {}),
    "batch: response_mask missing": ("compute_rollout_correction_and_add_to_batch",
                                     lambda: (_proto("response_mask"), dict(TOKEN_IS)), {}),
    "batch: unknown IS level": ("compute_rollout_correction_and_add_to_batch",
                                lambda: (_proto(), {"rollout_is": "tokn", "rollout_is_threshold": 2.0}), {}),
    "batch: RS without threshold": ("compute_rollout_correction_and_add_to_batch",
                                    lambda: (_proto(), {"rollout_rs": "token_k1"}), {}),
    "IS metrics: unknown level": ("compute_is_metrics", lambda: (torch.ones(B, T), LOG_RATIO, MASK, "tokn", 2.0), {}),
    "IS metrics: threshold None": ("compute_is_metrics", lambda: (torch.ones(B, T), LOG_RATIO, MASK, "token", None), {}),
    "RS metrics: bad call": ("compute_rs_metrics", lambda: (MASK, LOG_RATIO, MASK, "bad", 0.1), {}),
    "bypass without rollout log-probs": ("apply_bypass_mode", lambda: (_proto("rollout_log_probs"), {"bypass_mode": True}), {}),
    "off-policy metrics: shapes differ": ("compute_offpolicy_metrics", lambda: (OLD, ROLLOUT[:, :2], MASK), {}),
}


def _raised(fn, args, kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return exc
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_same_exception_type_as_verl(case):
    name, args, kwargs = CASES[case]
    theirs = _raised(_verl(name), args(), kwargs)
    assert theirs is not None, f"verl accepts this input; the case belongs elsewhere: {case}"
    mine = _raised(getattr(ours, name), args(), kwargs)
    assert mine is not None, f"the drop-in accepted what verl refuses ({type(theirs).__name__}: {theirs})"
    assert isinstance(mine, type(theirs)), (f"verl raises {type(theirs).__name__}, the drop-in "
                                            f"{type(mine).__name__}: {mine}")


def test_our_errors_keep_their_own_types_and_messages():
    with pytest.raises(ours.ConfigBlockError, match="is None") as info:
        ours.compute_rollout_correction_and_add_to_batch(_proto(), None)
    assert all(isinstance(info.value, t) for t in (ConfigError, TypeError, AttributeError))
    with pytest.raises(MissingSettingError, match="rollout_is_threshold=None is invalid: required when"):
        ours.compute_rollout_correction_weights(LOG_RATIO, MASK, rollout_is="token", rollout_is_threshold=None)
    with pytest.raises(ShapeMismatchError, match="shape mismatch"):
        ours.compute_offpolicy_metrics(OLD, ROLLOUT[:, :2], MASK)


def test_a_null_is_threshold_is_refused_where_verl_silently_drops_the_weights():
    # verl returns no rollout_is_weights at all for rollout_is=token with a null threshold;
    # the drop-in refuses the block instead (docs/verl-differences.md)
    config = {"rollout_is": "token", "rollout_is_threshold": None}
    batch, _ = _verl("compute_rollout_correction_and_add_to_batch")(_proto(), config)
    assert "rollout_is_weights" not in batch.batch.keys()
    with pytest.raises(MissingSettingError, match="required when rollout_is='token'"):
        ours.compute_rollout_correction_and_add_to_batch(_proto(), config)
