"""``rollout_correction.compat.verl`` against verl 0.9.1's real ``rollout_corr_helper``.

Each public name is called side by side with verl's function of the same name on the same
inputs; signatures, return types and values must match (k1 bounds are given to verl in its
sign convention, see docs/verl-differences.md).
"""

from __future__ import annotations

import inspect
import math
import sys

import pytest
import torch

from verl_reference import (
    assert_metrics_match,
    load_verl_algorithm_config,
    load_verl_rollout_corr_helper,
    require_verl,
    verl_equivalent_rs_threshold,
)

require_verl()

import rollout_correction.compat.verl as compat  # noqa: E402
from test_verl_parity import make_batch  # noqa: E402
from rollout_correction import Segments

VERL = load_verl_rollout_corr_helper()
VerlConfig = load_verl_algorithm_config().RolloutCorrectionConfig

# verl's public functions that the compat module re-provides (every function in its __all__
# except our weights-holder class).
PUBLIC_FUNCTIONS = [n for n in compat.__all__ if inspect.isfunction(getattr(compat, n))]
assert len(PUBLIC_FUNCTIONS) == 9 and all(inspect.isfunction(getattr(VERL, n)) for n in PUBLIC_FUNCTIONS)


def _close(a, b, rtol=2e-5, atol=1e-6):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- surface


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_signature_extends_verls(name):
    """verl's parameters, in order, with the same kinds and defaults; extras are keyword-only."""
    theirs = list(inspect.signature(getattr(VERL, name)).parameters.values())
    ours = list(inspect.signature(getattr(compat, name)).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for a, b in zip(ours, theirs):
        assert a.kind == b.kind, f"{name}({a.name}) kind"
        assert a.default == b.default, f"{name}({a.name}) default"
    for extra in ours[len(theirs):]:
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty


def test_constants_match_verl():
    assert compat.SAFETY_BOUND == VERL.SAFETY_BOUND
    assert compat.SUPPORTED_ROLLOUT_RS_OPTIONS == VERL.SUPPORTED_ROLLOUT_RS_OPTIONS
    assert compat.TOKEN_LEVEL_ROLLOUT_RS_OPTIONS == VERL.TOKEN_LEVEL_ROLLOUT_RS_OPTIONS


# ----------------------------------------------------------------------------- the pipeline

PIPELINE_SETTINGS = [
    dict(rollout_is=None),
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True),
    dict(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    dict(rollout_is="token", rollout_is_threshold=None),  # no threshold → no weights (verl)
    dict(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    dict(rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.4_2.0,0.01,0.05"),
]


@pytest.mark.parametrize("settings", PIPELINE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_rollout_correction_and_rejection_mask_matches_verl(settings):
    old, rollout, mask = make_batch(10, 24, 0.3, 1)
    holder, new_mask, metrics = compat.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)
    verl_settings = dict(settings)
    verl_settings["rollout_rs_threshold"] = verl_equivalent_rs_threshold(settings.get("rollout_rs"),
                                                                         settings.get("rollout_rs_threshold"))
    v_holder, v_mask, v_metrics = VERL.compute_rollout_correction_and_rejection_mask(
        old.double(), rollout.double(), mask, **verl_settings)
    assert (holder is None) == (v_holder is None)
    if holder is not None:
        assert type(holder) is type(v_holder)  # verl is imported here: a real DataProto
        _close(holder.batch["rollout_is_weights"], v_holder.batch["rollout_is_weights"])
    assert new_mask.dtype == mask.dtype and torch.equal(new_mask, v_mask)
    assert all(isinstance(v, float) for v in metrics.values())
    assert_metrics_match(v_metrics, metrics)


def test_weights_holder_without_verl(monkeypatch):
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verl", None)  # what Python reports for a package that is not installed
    old, rollout, mask = make_batch(3, 5, 0.1, 2)
    holder, _, _ = compat.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="token")
    assert isinstance(holder, compat.RolloutISWeights) and len(holder) == 3
    expected = torch.exp(old - rollout).clamp(max=2.0) * mask
    _close(holder.batch["rollout_is_weights"], expected)


def test_weights_holder_type_does_not_depend_on_what_was_imported_before():
    """With verl installed the holder is verl's DataProto, also in a process that never imported
    verl before the call (it used to be the light holder there)."""
    import subprocess

    code = ("import sys, torch\n"
            "from rollout_correction.compat import verl as c\n"
            "assert 'verl.protocol' not in sys.modules\n"
            "m = torch.ones(2, 3)\n"
            "h, _, _ = c.compute_rollout_correction_and_rejection_mask(-m, -m, m, rollout_is='token')\n"
            "print(type(h).__module__, type(h).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["verl.protocol", "DataProto"]


def test_rejection_without_threshold_raises_like_verl():
    old, rollout, mask = make_batch(3, 5, 0.1, 2)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        VERL.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compat.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs="token_k2")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        compat.compute_rollout_rejection_mask(old - rollout, mask, "token_k2")


# ----------------------------------------------------------------------------- weights and masks


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.3_4.0"])
@pytest.mark.parametrize("normalize", [False, True])
def test_correction_weights_match_verl(level, threshold, normalize):
    old, rollout, mask = make_batch(12, 30, 0.2, 3)
    log_ratio = old - rollout
    w, metrics = compat.compute_rollout_correction_weights(log_ratio, mask, level, threshold, normalize)
    v_w, v_metrics = VERL.compute_rollout_correction_weights(log_ratio.double(), mask, level, threshold, normalize)
    _close(w, v_w)
    assert not w.requires_grad
    assert_metrics_match(v_metrics, metrics)


@pytest.mark.parametrize("option", sorted(VERL.SUPPORTED_ROLLOUT_RS_OPTIONS))
def test_rejection_mask_matches_verl_for_every_option(option):
    old, rollout, mask = make_batch(16, 20, 0.3, 4)
    threshold = {"token_k1": "0.6_1.8", "seq_sum_k1": "0.6_1.8", "seq_mean_k1": "0.9_1.2"}.get(option, 0.03)
    new_mask, metrics = compat.compute_rollout_rejection_mask(old - rollout, mask, option, threshold)
    v_mask, v_metrics = VERL.compute_rollout_rejection_mask((old - rollout).double(), mask, option,
                                                            verl_equivalent_rs_threshold(option, threshold))
    assert 0 < int(new_mask.sum()) < int(mask.sum()), "threshold must reject some but not all"
    assert torch.equal(new_mask, v_mask)
    assert_metrics_match(v_metrics, metrics)


def test_rejection_mask_empty_batch_returns_input():
    mask = torch.zeros(0, 4)
    new_mask, metrics = compat.compute_rollout_rejection_mask(torch.zeros(0, 4), mask, "token_k2", 0.1)
    assert new_mask is mask and metrics == {}


# ----------------------------------------------------------------------------- metric helpers


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower", [None, 0.4])
def test_is_metrics_of_given_weights_match_verl(level, lower):
    old, rollout, mask = make_batch(9, 14, 0.4, 5)
    lr = (old - rollout).double()
    upper = 2.5
    if level == "token":
        for_metrics = lr
        raw = lr.clamp(-20, 20).exp() * mask
    else:
        for_metrics = (lr * mask).sum(-1, keepdim=True)
        raw = for_metrics.clamp(-20, 20).exp().expand_as(lr) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    expected = VERL.compute_is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    got = compat.compute_is_metrics(weights.float(), raw.float(), for_metrics.float(), mask, level, upper, lower)
    assert_metrics_match(expected, got)


@pytest.mark.parametrize("option", ["token_k1", "token_k3", "seq_sum_k1", "seq_mean_k2", "seq_max_k3"])
@pytest.mark.parametrize("pass_sequence_values", [True, False])
def test_rs_metrics_of_given_statistic_match_verl(option, pass_sequence_values):
    old, rollout, mask = make_batch(11, 13, 0.4, 6)
    lr = (old - rollout).double().clamp(-20, 20)
    per_token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": lr.exp() - 1 - lr}[option[-2:]]
    m = mask.double()
    n = m.sum(-1)
    is_k1 = option.endswith("k1")
    upper, lower = (math.log(1.6), math.log(0.7)) if is_k1 else (0.05, 0.0)
    if option.startswith("token"):
        level, seq, stat = "token", None, per_token
    else:
        level = "sequence"
        if option.startswith("seq_sum"):
            seq = (per_token * m).sum(-1)
        elif option.startswith("seq_mean"):
            seq = (per_token * m).sum(-1) / n
        else:
            seq = torch.where(m > 0, per_token, -torch.inf).amax(-1)
        stat = seq[:, None].expand_as(per_token)
        seq = seq if pass_sequence_values else None
    kwargs = dict(level=level, per_sequence_values=seq, rollout_rs_threshold=upper,
                  rollout_rs_threshold_lower=lower, apply_lower_threshold=is_k1)
    expected = VERL.compute_rs_metrics(option, stat, mask, n > 0, **kwargs)
    got = compat.compute_rs_metrics(option, stat.float(), mask, n > 0, **{
        **kwargs, "per_sequence_values": None if seq is None else seq.float()})
    assert set(got) == set(expected)
    assert_metrics_match(expected, got)


def test_offpolicy_metrics_match_verl_with_and_without_rollout():
    old, rollout, mask = make_batch(8, 16, 0.3, 7)
    assert_metrics_match(VERL.compute_offpolicy_metrics(old.double(), rollout.double(), mask),
                         compat.compute_offpolicy_metrics(old, rollout, mask))
    theirs = VERL.compute_offpolicy_metrics(old.double(), None, mask)
    ours = compat.compute_offpolicy_metrics(old, None, mask)
    assert set(ours) == set(theirs) == {"training_ppl", "training_log_ppl"}
    assert_metrics_match(theirs, ours)


def test_metrics_from_logprobs_match_verl():
    old, rollout, mask = make_batch(8, 16, 0.3, 8)
    theirs = VERL.compute_rollout_corr_metrics_from_logprobs(old.double(), rollout.double(), mask)
    ours = compat.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    assert all(k.startswith("rollout_corr/") for k in ours)
    assert_metrics_match(theirs, ours)


# ----------------------------------------------------------------------------- batch helpers


def _data_proto(old, rollout, mask):
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "decoupled_token_icepop", "decoupled_k3_rs", "disabled"])
@pytest.mark.parametrize("config_kind", ["verl", "dict", "ours"])
def test_add_to_batch_matches_verl(preset, config_kind):
    from rollout_correction import RolloutCorrectionConfig

    old, rollout, mask = make_batch(7, 12, 0.3, 9)
    verl_cfg = getattr(VerlConfig, preset)()
    config = {"verl": verl_cfg,
              "dict": {k: getattr(verl_cfg, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_rs",
                                                          "rollout_rs_threshold", "rollout_is_batch_normalize")},
              "ours": RolloutCorrectionConfig.from_preset(preset)}[config_kind]
    ours, metrics = compat.compute_rollout_correction_and_add_to_batch(_data_proto(old, rollout, mask), config)
    theirs, v_metrics = VERL.compute_rollout_correction_and_add_to_batch(
        _data_proto(old.double(), rollout.double(), mask), verl_cfg)
    assert torch.equal(ours.batch["response_mask"], theirs.batch["response_mask"])
    assert ("rollout_is_weights" in ours.batch.keys()) == ("rollout_is_weights" in theirs.batch.keys())
    if "rollout_is_weights" in theirs.batch.keys():
        _close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"])
    assert_metrics_match(v_metrics, metrics)


def test_add_to_batch_reads_segment_ids_from_the_batch():
    """A multi-turn user adds ``segment_ids`` to verl's DataProto; a segment block without it is refused."""
    from verl.protocol import DataProto

    from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction

    old, rollout, mask = make_batch(5, 12, 0.3, 4)
    ids = torch.arange(12).div(4, rounding_mode="floor").expand(5, 12).contiguous()
    cfg = {"rollout_is": "segment", "rollout_is_threshold": 1.5, "rollout_rs": "segment_mean_k3",
           "rollout_rs_threshold": 0.02}
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                         "segment_ids": ids})
    ours, metrics = compat.compute_rollout_correction_and_add_to_batch(batch, cfg)
    direct = compute_rollout_correction(
        old, rollout, mask, config=RolloutCorrectionConfig(**cfg), segments=Segments(ids))
    assert torch.equal(ours.batch["response_mask"], direct.response_mask)
    torch.testing.assert_close(ours.batch["rollout_is_weights"], direct.weights)
    key = "rollout_corr/rollout_is_seq_mean"
    assert metrics[key] == pytest.approx(direct.metrics_as_floats()[key])
    whole_rows = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(**cfg))
    assert not torch.equal(direct.response_mask, whole_rows.response_mask)  # the turns matter here
    with pytest.raises(ValueError, match=r"rollout_is='segment'.*segment_ids"):
        compat.compute_rollout_correction_and_add_to_batch(_data_proto(old, rollout, mask), cfg)


def test_verls_signatures_refuse_the_segment_level():
    """verl's functions have no place for segment ids: a segment setting is refused, not run per row."""
    old, rollout, mask = make_batch(3, 6, 0.3, 1)
    with pytest.raises(ValueError, match=r"rollout_is='segment'.*signature"):
        compat.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="segment")
    with pytest.raises(ValueError, match=r"rollout_is='segment'.*signature"):
        compat.compute_rollout_correction_weights(old - rollout, mask, rollout_is="segment")
    with pytest.raises(ValueError, match=r"'segment_mean_k3'.*signature"):
        compat.compute_rollout_rejection_mask(old - rollout, mask, rollout_rs="segment_mean_k3",
                                              rollout_rs_threshold=0.1)
    with pytest.raises(ValueError, match=r"'segment_max_k2' is a segment option"):
        compat.compute_rs_metrics("segment_max_k2", old - rollout, mask, mask, level="sequence",
                                  per_sequence_values=None, rollout_rs_threshold=0.1,
                                  rollout_rs_threshold_lower=0.0, apply_lower_threshold=False)


def test_apply_bypass_mode_like_verl():
    from omegaconf import OmegaConf

    old, rollout, mask = make_batch(4, 6, 0.3, 10)
    results = []
    for fn in (compat.apply_bypass_mode, VERL.apply_bypass_mode):
        batch = _data_proto(old.clone(), rollout.clone(), mask)
        loss_cfg = OmegaConf.create({"loss_mode": "vanilla"})
        OmegaConf.set_struct(loss_cfg, True)
        rc_cfg = VerlConfig.bypass_pg_is()
        assert fn(batch, rc_cfg, loss_cfg) is None
        results.append((batch, loss_cfg))
    (ours, ours_cfg), (theirs, theirs_cfg) = results
    assert torch.equal(ours.batch["old_log_probs"], theirs.batch["old_log_probs"])
    assert torch.equal(ours.batch["old_log_probs"], rollout)
    assert ours_cfg.loss_mode == theirs_cfg.loss_mode == "bypass_mode"
    assert ours_cfg.rollout_correction == theirs_cfg.rollout_correction

    plain = {"loss_mode": "vanilla"}
    compat.apply_bypass_mode(_data_proto(old, rollout, mask), {"rollout_is": "token"}, plain)
    assert plain == {"loss_mode": "bypass_mode", "rollout_correction": {"rollout_is": "token"}}

    from verl.protocol import DataProto

    no_rollout = DataProto.from_dict(tensors={"old_log_probs": old, "response_mask": mask})
    with pytest.raises(ValueError, match="rollout_log_probs"):
        compat.apply_bypass_mode(no_rollout)


# ----------------------------------------------------------------------------- one batch step, strict


def _surfaces():
    import rollout_correction.integrations.verl as adapter

    return [compat.compute_rollout_correction_and_add_to_batch, adapter.compute_rollout_correction_and_add_to_batch]


def test_both_surfaces_honour_the_token_veto():
    """The veto rejects a whole sequence holding one token with π_old/π_rollout below the threshold
    (expected mask written by hand); the drop-in and the adapter give the same mask."""
    old = torch.zeros(3, 4)
    rollout = torch.zeros(3, 4)
    rollout[1, 2] = 12.0  # ratio exp(-12) ≈ 6e-6 < 1e-4 at a valid token of row 1
    rollout[2, 3] = 12.0  # same ratio, but at row 2's padding: no veto
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float32)
    block = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_token_veto_threshold": 1e-4}
    expected = mask.clone()
    expected[1] = 0.0
    for step in _surfaces():
        out, metrics = step(_data_proto(old, rollout, mask.clone()), dict(block))
        assert torch.equal(out.batch["response_mask"], expected), step.__module__
        assert "rollout_is_weights" in out.batch.keys()


@pytest.mark.parametrize("key, hint", [("rollout_iss", "rollout_is"), ("rollout_rs_treshold", "rollout_rs_threshold")])
def test_a_misspelt_key_fails_naming_it_on_both_surfaces(key, hint):
    from rollout_correction import ConfigError

    old, rollout, mask = make_batch(4, 6, 0.3, 1)
    for step in _surfaces():
        with pytest.raises(ConfigError, match=f"{key}.*did you mean '{hint}'") as info:
            step(_data_proto(old, rollout, mask), {key: "token", "rollout_is": "token"})
        assert isinstance(info.value, ValueError)


def test_a_missing_tensor_raises_keyerror_like_verls_function():
    old, rollout, mask = make_batch(4, 6, 0.3, 2)
    from verl.protocol import DataProto

    def data():
        return DataProto.from_dict(tensors={"old_log_probs": old, "response_mask": mask})

    with pytest.raises(KeyError):
        VERL.compute_rollout_correction_and_add_to_batch(data(), VerlConfig.decoupled_token_is())
    for step in _surfaces():
        with pytest.raises(KeyError, match="rollout_log_probs"):
            step(data(), VerlConfig.decoupled_token_is())


def test_add_to_batch_emits_verls_debug_metrics_under_verls_names():
    """verl's own ``calculate_debug_metrics`` (``training/rollout_probs_diff_*`` and the Pearson
    correlation of the probabilities) on the same batch: the adapter reports the same numbers."""
    from verl.protocol import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    old, rollout, mask = make_batch(7, 12, 0.3, 11)
    rollout = rollout.clamp(max=0.0)  # probabilities (a log-prob above 0 is taken as 1 here; verl exponentiates it)
    from rollout_correction import RolloutCorrectionConfig

    # opt-in: verl's trainer logs these itself; with the option the adapter reports them too
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, mismatch_metrics=True)
    _, metrics = compat.compute_rollout_correction_and_add_to_batch(_data_proto(old, rollout, mask), config)
    data = DataProto.from_dict(tensors={"old_log_probs": old.double(), "rollout_log_probs": rollout.double(),
                                        "response_mask": mask, "responses": torch.zeros_like(mask, dtype=torch.long)})
    theirs = calculate_debug_metrics(data)
    theirs.pop("training/rollout_probs_diff_valid")
    assert_metrics_match(theirs, metrics, rtol=1e-5, atol=1e-7)
