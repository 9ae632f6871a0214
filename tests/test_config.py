"""RolloutCorrectionConfig: presets (table from the seeds and REFERENCES), both key generations,
validation messages, YAML / OmegaConf loading, to_dict round trips, replace."""

import dataclasses
import math

import pytest
import torch

from rollout_correction_core import ConfigError, RolloutCorrectionConfig, as_config, compute_rollout_correction
from rollout_correction_core._src.vocab import Band

C = RolloutCorrectionConfig

DEFAULTS = {
    "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_threshold_lower": None,
    "rollout_is_mode": None,
    "rollout_is_batch_normalize": False, "rollout_rs": None, "rollout_rs_threshold": None,
    "rollout_rs_threshold_lower": None, "rollout_token_veto_threshold": None, "bypass_mode": False,
    "loss_type": "ppo_clip", "on_nonfinite": "reject", "check_alignment": False, "mismatch_metrics": False,
    "rollout_opsm_delta": None, "rollout_m2po_threshold": None, "rollout_token_veto_threshold_high": None,
    "loss_denominator": None, "log_prob_floor": -1000.0, "log_prob_ceiling": 0.0, "rollout_rs_all_rejected": "warn",
    "expect_zero_atol": None, "expect_zero_action": "raise", "expected_response_length": None, "metrics": ["default"],
}

GEO = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
K3 = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
BYPASS = {"bypass_mode": True}
PG = {"bypass_mode": True, "loss_type": "reinforce"}
TOK = {"rollout_is": "token"}
SEQ = {"rollout_is": "sequence"}
ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
SEQ_TIS, TOK_TIS = ("sequence", "truncate", None, 2.0), ("token", "truncate", None, 2.0)
GEO_RS, K3_RS = ("seq_mean_k1", 0.999, 1.001), ("seq_mean_k3", None, 0.01)
VETO = {"rollout_token_veto_threshold": 1e-4}
PRIME_RL = {"bypass_mode": True, "loss_type": "ratio_pg", "loss_denominator": "valid"}

# preset -> (keys that differ from the defaults, resolved IS (level, mode, lower, upper) or None,
#            resolved RS [(option, ratio lower or None, upper)] — ratio bounds for k1, one bound for k2/k3)
PRESETS = {
    # verl 0.9.1 (REFERENCES.md: 19 presets with these RS options and thresholds)
    "decoupled_token_is": (TOK, ("token", "truncate", None, 2.0), []),
    "decoupled_seq_is": (SEQ, ("sequence", "truncate", None, 2.0), []),
    "decoupled_token_icepop": (ICEPOP, ("token", "mask", 0.5, 5.0), []),
    "decoupled_seq_is_rs": ({**SEQ, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
                            ("sequence", "truncate", None, 2.0), [("seq_sum_k1", 0.5, 2.0)]),
    "decoupled_geo_rs": (GEO, None, [("seq_mean_k1", 0.999, 1.001)]),
    "decoupled_geo_rs_seq_tis": ({**SEQ, **GEO}, SEQ_TIS, [GEO_RS]),
    "decoupled_geo_rs_token_tis": ({**TOK, **GEO}, TOK_TIS, [GEO_RS]),
    "decoupled_k3_rs": (K3, None, [("seq_mean_k3", None, 0.01)]),
    "decoupled_k3_rs_seq_tis": ({**SEQ, **K3}, SEQ_TIS, [K3_RS]),
    "decoupled_k3_rs_token_tis": ({**TOK, **K3}, TOK_TIS, [K3_RS]),
    "bypass_ppo_clip": (BYPASS, None, []),
    "bypass_ppo_clip_geo_rs": ({**BYPASS, **GEO}, None, [("seq_mean_k1", 0.999, 1.001)]),
    "bypass_ppo_clip_k3_rs": ({**BYPASS, **K3}, None, [("seq_mean_k3", None, 0.01)]),
    "bypass_pg_is": ({**PG, **SEQ}, ("sequence", "truncate", None, 2.0), []),
    "bypass_pg_token_icepop": ({**PG, **ICEPOP}, ("token", "mask", 0.5, 5.0), []),
    "bypass_pg_geo_rs": ({**PG, **GEO}, None, [("seq_mean_k1", 0.999, 1.001)]),
    "bypass_pg_geo_rs_seq_tis": ({**PG, **SEQ, **GEO}, ("sequence", "truncate", None, 2.0),
                                 [("seq_mean_k1", 0.999, 1.001)]),
    "bypass_pg_geo_rs_token_tis": ({**PG, **TOK, **GEO}, ("token", "truncate", None, 2.0),
                                   [("seq_mean_k1", 0.999, 1.001)]),
    "disabled": ({}, None, []),
    # First generation (seeds 000 §3.7 and 001 "Preset Configuration Guide")
    "token_is": (TOK, ("token", "truncate", None, 2.0), []),
    "seq_is": (SEQ, ("sequence", "truncate", None, 2.0), []),
    "seq_is_rs": ({**SEQ, "rollout_rs": "sequence", "rollout_rs_threshold": 2.0},
                  ("sequence", "truncate", None, 2.0), [("seq_sum_k1", 0.5, 2.0)]),  # lower = 1/upper
    "seq_mis": ({**SEQ, "rollout_rs": "sequence", "rollout_rs_threshold": 2.0,
                 "rollout_rs_threshold_lower": 0.0},
                ("sequence", "truncate", None, 2.0), [("seq_sum_k1", 0.0, 2.0)]),
    "geo_rs": ({"rollout_rs": "geometric", "rollout_rs_threshold": 1.001, **VETO},
               None, [("seq_mean_k1", 1 / 1.001, 1.001)]),
    "geo_mis": ({"rollout_is": "geometric", "rollout_rs": "geometric", "rollout_rs_threshold": 1.001,
                 **VETO}, ("geometric", "truncate", None, 2.0),
                [("seq_mean_k1", 1 / 1.001, 1.001)]),
    "ppo_is_bypass": ({**TOK, **BYPASS}, ("token", "truncate", None, 2.0), []),
    "pure_is": ({**PG, **SEQ}, ("sequence", "truncate", None, 2.0), []),
    "pg_is": ({**PG, **SEQ}, ("sequence", "truncate", None, 2.0), []),
    "pg_rs": ({**PG, "rollout_rs": "geometric", "rollout_rs_threshold": 1.001, **VETO},
              None, [("seq_mean_k1", 1 / 1.001, 1.001)]),
    # Methods beyond verl's presets: length-normalised weights, policy losses paired with IS weights,
    # OPSM, M2PO, TOPR.
    "decoupled_geo_is": ({"rollout_is": "geometric"}, ("geometric", "truncate", None, 2.0), []),
    "decoupled_token_is_opsm": ({**TOK, "rollout_opsm_delta": 0.05}, TOK_TIS, []),
    "decoupled_token_is_m2po": ({**TOK, "rollout_m2po_threshold": 0.04}, TOK_TIS, []),
    "bypass_topr": ({"bypass_mode": True, "loss_type": "topr"}, None, []),
    "decoupled_gspo_geo_is": ({"rollout_is": "geometric", "loss_type": "gspo"}, ("geometric", "truncate", None, 2.0),
                              []),
    "decoupled_cispo_token_is": ({**TOK, "loss_type": "cispo"}, TOK_TIS, []),
    "decoupled_dppo_tv_token_is": ({**TOK, "loss_type": "dppo_tv"}, TOK_TIS, []),
    "decoupled_dppo_kl_token_is": ({**TOK, "loss_type": "dppo_kl"}, TOK_TIS, []),
    # Probability-space gates and the two-sided veto.
    "decoupled_tv_rs_token_tis": ({**TOK, "rollout_rs": "token_tv", "rollout_rs_threshold": 0.1}, TOK_TIS,
                                  [("token_tv", None, 0.1)]),
    "decoupled_binary_kl_rs_token_tis": ({**TOK, "rollout_rs": "seq_mean_binary_kl", "rollout_rs_threshold": 0.02},
                                         TOK_TIS, [("seq_mean_binary_kl", None, 0.02)]),
    "decoupled_token_is_veto": ({**TOK, **VETO, "rollout_token_veto_threshold_high": 10.0}, TOK_TIS, []),
    # SkyRL's rollout-anchored losses and geometric band.
    "bypass_rollout_is": ({"bypass_mode": True, "loss_type": "rollout_is"}, None, []),
    "bypass_cispo": ({"bypass_mode": True, "loss_type": "cispo"}, None, []),
    "decoupled_geo_rs_wide": ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.99_1.01"}, None,
                              [("seq_mean_k1", 0.99, 1.01)]),
    # prime-rl's losses: −A·r on the tokens a probability (IPO) or log-ratio (IcePop) gate keeps
    "prime_rl_ipo": ({**PRIME_RL, "rollout_rs": "token_dp", "rollout_rs_threshold": "-0.3_0.3"}, None,
                     [("token_dp", None, 0.3)]),
    "prime_rl_icepop": ({**PRIME_RL, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.2_5.0"}, None,
                        [("token_k1", 0.2, 5.0)]),
}


def _resolved_rs(cfg):
    out = []
    for o in cfg.rs_options:
        if o.estimator == "k1":  # stat bounds on k1 = −log ρ ↔ ratio bounds [e^−upper, e^−lower]
            out.append((o.name, math.exp(-o.stat_upper), math.exp(-o.stat_lower)))
        else:
            out.append((o.name, None, o.stat_upper))
    return out


def test_preset_table_covers_every_preset():
    assert sorted(C.preset_names()) == sorted(PRESETS)
    assert len(C.preset_names()) == 45


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_has_documented_settings(name):
    changes, is_expected, rs_expected = PRESETS[name]
    cfg = getattr(C, name)()
    assert cfg.to_dict() == {**DEFAULTS, **changes}
    assert C.from_preset(name) == cfg
    if is_expected is None:
        assert cfg.is_spec is None and not cfg.is_enabled
    else:
        s = cfg.is_spec
        assert (s.level, s.mode, s.lower, s.upper) == is_expected
    got = _resolved_rs(cfg)
    assert len(got) == len(rs_expected or [])
    for (name_g, lo_g, hi_g), (name_e, lo_e, hi_e) in zip(got, rs_expected or []):
        assert name_g == name_e
        assert (lo_g is None) == (lo_e is None) and (lo_e is None or lo_g == pytest.approx(lo_e))
        assert hi_g == pytest.approx(hi_e)
    # Only the policy-gradient presets use REINFORCE (seed 000 §3.7 note); all of those are bypass.
    assert cfg.uses_pure_is == (name in {"pure_is", "pg_is", "pg_rs"} or name.startswith("bypass_pg"))


def test_presets_take_the_documented_arguments():
    assert C.token_is(threshold=3.0).rollout_is_threshold == 3.0
    assert C.seq_is_rs(is_threshold=5.0, rs_threshold=4.0).rollout_rs_threshold == 4.0
    assert _resolved_rs(C.seq_is_rs(rs_threshold=4.0))[0][1] == pytest.approx(0.25)
    assert C.geo_rs(rs_threshold=1.002, veto_threshold=1e-6).rollout_token_veto_threshold == 1e-6
    assert C.geo_rs(veto_threshold=None).rollout_token_veto_threshold is None
    assert C.decoupled_seq_is_rs(rs_threshold="0.8_1.25").rollout_rs_threshold == (0.8, 1.25)
    assert C.decoupled_token_icepop(threshold=4.0, threshold_lower=0.25).is_spec.lower == 0.25
    assert C.pure_is(threshold=5.0).is_spec.upper == 5.0
    assert C.from_preset("decoupled_k3_rs", rs_threshold=0.05).rs_options[0].stat_upper == 0.05


def test_unknown_preset_names_the_closest():
    with pytest.raises(ConfigError, match="unknown preset 'seq_is_r'.*did you mean 'seq_is_rs'"):
        C.from_preset("seq_is_r")


# ---------------------------------------------------------------------------- from_dict
@pytest.mark.parametrize("data,expected", [
    ({"bypass_old_logprob_for_rollout": True}, {"bypass_mode": True, "loss_type": "ppo_clip"}),
    ({"bypass_old_logprob_for_rollout": False, "use_pure_rollout_correction": False}, {}),
    ({"use_pure_rollout_correction": True}, {"bypass_mode": True, "loss_type": "reinforce"}),
    ({"bypass_mode": True, "use_policy_gradient": True}, {"bypass_mode": True, "loss_type": "reinforce"}),
    ({"bypass_mode": True, "loss_type": "reinforce"}, {"bypass_mode": True, "loss_type": "reinforce"}),
    ({"_target_": "verl.trainer.config.RolloutCorrectionConfig", "rollout_is": "token"},
     {"rollout_is": "token"}),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 1.001, "rollout_rs_threshold_lower": "0.999",
      "rollout_token_veto_threshold": "1e-4"},
     {"rollout_rs": "geometric", "rollout_rs_threshold": 1.001, "rollout_rs_threshold_lower": 0.999,
      "rollout_token_veto_threshold": 1e-4}),
])
def test_from_dict_accepts_both_generations(data, expected):
    assert C.from_dict(data).to_dict() == {**DEFAULTS, **expected}


def test_from_dict_none_is_the_default_config():
    assert C.from_dict(None) == C() == C.disabled()


def test_unknown_key_is_named_with_a_suggestion():
    hint = r"'rollout_is_treshold' \(did you mean 'rollout_is_threshold'\?\)"
    with pytest.raises(ConfigError, match=hint):
        C.from_dict({"rollout_is": "token", "rollout_is_treshold": 2.0})
    with pytest.raises(ValueError, match="unknown RolloutCorrectionConfig key.*'foo'"):
        C.from_dict({"foo": 1})


INVALID = [
    (dict(rollout_is="tokens"), r"rollout_is='tokens'.*'token', 'sequence', 'geometric'"),
    (dict(rollout_is="token", rollout_is_mode="cut"), r"rollout_is_mode='cut'.*'truncate', 'clip', 'mask'"),
    (dict(rollout_is_mode="cut"), r"rollout_is_mode='cut'.*'truncate', 'clip', 'mask'"),
    (dict(loss_type="ppo"), r"loss_type='ppo'.*'ppo_clip', 'reinforce'"),
    (dict(on_nonfinite="ignore"), r"on_nonfinite='ignore'.*'reject', 'raise'"),
    (dict(bypass_mode="yes"), r"bypass_mode='yes'.*true or false"),
    (dict(rollout_is_batch_normalize=1), r"rollout_is_batch_normalize=1.*true or false"),
    (dict(rollout_is="token", rollout_is_threshold=None), r"rollout_is_threshold=None.*required"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), r"rollout_is_threshold=-1.0.*> 0"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), r"rollout_is_threshold='abc'.*number"),
    (dict(rollout_is="token", rollout_is_threshold=True), r"rollout_is_threshold=True.*not a boolean"),
    (dict(rollout_is="token", rollout_is_threshold=float("nan")), r"rollout_is_threshold.*NaN"),
    (dict(rollout_is="token", rollout_is_threshold="2.0_0.5"),
     r"rollout_is_threshold.*2.0 exceeds upper bound 0.5"),
    (dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_mode="truncate"),
     r"rollout_is_mode='truncate'.*'mask'.*'clip'"),
    (dict(rollout_is="token", rollout_is_mode="clip", rollout_is_threshold_lower=3.0),
     r"rollout_is_threshold_lower=3.0.*\[0, upper=2.0\]"),
    (dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_threshold_lower=0.3),
     r"rollout_is_threshold_lower=0.3.*not both"),
    (dict(rollout_rs="seq_mean_k4", rollout_rs_threshold=0.1),
     r"rollout_rs='seq_mean_k4'.*did you mean 'seq_mean_k3'.*allowed: \[.*'token_k1'"),
    (dict(rollout_rs=3), r"rollout_rs=3.*comma-separated string"),
    (dict(rollout_rs=" , "), r"rollout_rs=.*at least one option"),
    (dict(rollout_rs="token_k1"), r"rollout_rs_threshold=None.*required when rollout_rs='token_k1'"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0"),
     r"rollout_rs_threshold\[token_k2\]='0.5_2.0'.*single upper"),
    (dict(rollout_rs="token_k3", rollout_rs_threshold=0.0), r"rollout_rs_threshold\[token_k3\]=0.0.*> 0"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="-2.0"),
     r"rollout_rs_threshold\[token_k1\]='-2.0'.*\[1/x, x\]"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2_1"),
     r"rollout_rs_threshold\[token_k1\]='2_1'.*exceeds"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0_2"),
     r"rollout_rs_threshold\[token_k1\]='0_2'.*positive"),
    (dict(rollout_rs="token,seq_sum_k1", rollout_rs_threshold=2.0), r"rollout_rs=.*cannot be chained"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
     r"rollout_rs_threshold_lower=0.5.*'lo_hi'"),
    (dict(rollout_rs_threshold_lower=0.5),
     r"rollout_rs_threshold_lower=0.5.*'token'\|'sequence'\|'geometric'"),
    (dict(rollout_rs="sequence", rollout_rs_threshold="0.5_2.0"), r"rollout_rs_threshold='0.5_2.0'.*numeric"),
    (dict(rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0),
     r"rollout_rs_threshold_lower=3.0.*\[0, upper=2.0\]"),
    (dict(rollout_token_veto_threshold=0.0), r"rollout_token_veto_threshold=0.0.*positive"),
]


@pytest.mark.parametrize("kwargs,pattern", INVALID)
def test_invalid_values_name_the_key_and_what_is_allowed(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        C(**kwargs)
    with pytest.raises(ConfigError, match=pattern):  # same message through the dict loader
        C.from_dict(kwargs)


# ---------------------------------------------------------------------------- YAML / OmegaConf
YAML_TEXT = """
trainer:
  total_epochs: 1
algorithm:
  rollout_correction:
    rollout_is: sequence
    rollout_is_threshold: 2.0
    rollout_rs: sequence
    rollout_rs_threshold: 2.0
    rollout_rs_threshold_lower: 0.5
    rollout_token_veto_threshold: 1e-4     # YAML 1.1 reads this as a string
    bypass_old_logprob_for_rollout: false
    use_pure_rollout_correction: false
"""
YAML_EXPECTED = {**DEFAULTS, "rollout_is": "sequence", "rollout_rs": "sequence", "rollout_rs_threshold": 2.0,
                 "rollout_rs_threshold_lower": 0.5, "rollout_token_veto_threshold": 1e-4}


def test_from_yaml_text_and_file(tmp_path):
    assert C.from_yaml(YAML_TEXT, key="algorithm.rollout_correction").to_dict() == YAML_EXPECTED
    path = tmp_path / "ppo.yaml"
    path.write_text(YAML_TEXT)
    assert C.from_yaml(str(path), key="algorithm.rollout_correction").to_dict() == YAML_EXPECTED
    flat = tmp_path / "rc.yaml"
    flat.write_text("rollout_is: token\nrollout_is_threshold: '0.5_5.0'\n")
    assert C.from_yaml(str(flat)) == C.decoupled_token_icepop()


def test_from_yaml_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="'rollout_rs_treshold'"):
        C.from_yaml("rollout_rs: token_k1\nrollout_rs_treshold: 2.0\n")


def test_from_omegaconf_resolves_interpolations():
    from omegaconf import OmegaConf

    root = OmegaConf.create({"cap": 3.0, "algorithm": {"rollout_correction": {
        "rollout_is": "token", "rollout_is_threshold": "${cap}", "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.5_2.0", "bypass_mode": True, "loss_type": "reinforce"}}})
    node = root.algorithm.rollout_correction
    for cfg in (C.from_omegaconf(node), C.from_dict(node)):
        assert cfg.rollout_is_threshold == 3.0 and cfg.is_spec.upper == 3.0
        assert cfg.uses_pure_is and cfg.rs_options[0].name == "token_k1"


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("rs", ["segment_mean_dp,token_k1", "token_k1,segment_mean_dp", "seq_mean_dp,seq_mean_k3"])
def test_a_shared_threshold_with_a_signed_option_round_trips(rs):
    """One threshold x shared by a signed option (dp: the band [−x, x]) and a ratio option (k1: [1/x, x];
    k3: the upper bound x) is held as given: it was held as the signed option's band "-2.0_2.0", which the
    ratio option refuses, so ``to_dict`` / ``replace`` raised."""
    cfg = C.from_dict({"rollout_rs": rs, "rollout_rs_threshold": 2.0})
    assert cfg.to_dict()["rollout_rs_threshold"] == 2.0
    again = cfg.replace(metrics="all")
    assert again.rs_options == cfg.rs_options
    dp = next(o for o in cfg.rs_options if o.estimator == "dp")
    assert (dp.stat_lower, dp.stat_upper) == (-2.0, 2.0)


@pytest.mark.parametrize("name", C.preset_names())
def test_to_dict_round_trip_for_every_preset(name):
    import yaml

    cfg = C.from_preset(name)
    for again in (C.from_dict(cfg.to_dict()), C.from_yaml(yaml.safe_dump(cfg.to_dict()))):
        assert again == cfg
        assert again.is_spec == cfg.is_spec and again.rs_options == cfg.rs_options


def test_replace_returns_a_validated_copy():
    cfg = C.decoupled_seq_is()
    new = cfg.replace(rollout_is_threshold=5.0, rollout_is_batch_normalize=True)
    assert new.is_spec.upper == 5.0 and new.is_spec.batch_normalize
    assert cfg.rollout_is_threshold == 2.0  # original untouched
    with pytest.raises(ConfigError, match="loss_type='pg'"):
        cfg.replace(loss_type="pg")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout_is = "token"


def test_mapping_style_access():
    cfg = C.geo_rs()
    assert cfg["rollout_rs"] == "geometric"
    assert cfg.get("rollout_token_veto_threshold") == 1e-4
    assert cfg.get("nope", 7) == 7
    with pytest.raises(KeyError):
        cfg["nope"]
    assert cfg.rs_enabled and not C.disabled().rs_enabled
    assert C(rollout_token_veto_threshold=1e-4).rs_enabled  # the veto alone counts as rejection


def test_a_skyrl_block_is_not_read_by_the_core():
    """SkyRL's keys are the toolkit's adapter's (rollout_correction.compat.skyrl.from_skyrl): the core
    names them as unknown keys."""
    with pytest.raises(ConfigError, match="'tis_ratio_type'"):
        C.from_dict({"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0})
