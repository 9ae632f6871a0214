"""The core's seams for the surfaces: config coercion and lookup, the preset table, a log-ratio
batch from a precomputed log-ratio, per-option rejection metrics, the accumulator hook."""

from __future__ import annotations

import dataclasses
import inspect
import math
import types

import pytest
import torch

from rollout_correction import (ConfigError, CorrectionAccumulator, RolloutCorrectionConfig,
                                as_config, compute_rollout_correction)
from rollout_correction import config_value
from rollout_correction.primitives import LogRatioBatch, log_ratio_batch, rejection_keep, rs_metrics, rs_option_metrics
from rollout_correction.reductions import SufficientStats
from rollout_correction.vocabulary import PRESETS
from rollout_correction.primitives import importance_weights
from rollout_correction_core._src.declared import COUNTS

C = RolloutCorrectionConfig


# ------------------------------------------------------------------------------ as_config
@dataclasses.dataclass
class _ForeignConfig:  # like verl's config dataclass: our keys plus a private field
    rollout_is: str = "sequence"
    rollout_is_threshold: float = 3.0
    _mutable: bool = True


def test_as_config_reads_every_holder_the_same_way():
    expected = C(rollout_is="sequence", rollout_is_threshold=3.0)
    assert as_config(None) == C()
    assert as_config(expected) is expected
    assert as_config("decoupled_seq_is") == C(rollout_is="sequence", rollout_is_threshold=2.0)
    assert as_config({"rollout_is": "sequence", "rollout_is_threshold": 3.0}) == expected
    assert as_config(_ForeignConfig()) == expected
    assert as_config(types.SimpleNamespace(rollout_is="sequence", rollout_is_threshold=3.0)) == expected
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create({"t": 3.0, "rc": {"rollout_is": "sequence", "rollout_is_threshold": "${t}"}})
    assert as_config(node.rc) == expected  # interpolation resolved


def test_as_config_errors_say_what_to_pass():
    with pytest.raises(TypeError, match="pass a preset name, a dict of config keys"):
        as_config(3.0)
    with pytest.raises(ConfigError, match="unknown preset 'seq_is_r'.*did you mean 'seq_is_rs'"):
        as_config("seq_is_r")
    with pytest.raises(ConfigError, match="'rollout_iss'.*did you mean 'rollout_is'"):
        as_config({"rollout_iss": "token"})


def test_config_value_reads_mappings_objects_and_older_names():
    class GetOnly:  # a holder with get() but no attributes
        def get(self, key, default=None):
            return {"a": 1}.get(key, default)

    assert config_value({"a": 1}, "a") == 1
    assert config_value({"a": None}, "a", 5) is None  # present wins over the default
    assert config_value(types.SimpleNamespace(a=2), "a") == 2
    assert config_value(GetOnly(), "a") == 1
    assert config_value(GetOnly(), "b", 7) == 7
    assert config_value(None, "a", 3) == 3
    assert config_value(types.SimpleNamespace(old=4), "new", 0, aliases=("old",)) == 4
    assert config_value({"new": 1, "old": 4}, "new", 0, aliases=("old",)) == 1
    assert config_value({}, "new", 9, aliases=("old",)) == 9


# ------------------------------------------------------------------------------ presets
def test_preset_classmethods_have_the_table_arguments():
    for name, preset in PRESETS.items():
        params = inspect.signature(getattr(C, name)).parameters
        assert {p: v.default for p, v in params.items()} == dict(preset.args), name
        assert getattr(C, name).__doc__ == preset.doc
    # positional arguments follow the table's order
    assert C.seq_is_rs(5.0, 4.0).to_dict() == C.seq_is_rs(is_threshold=5.0, rs_threshold=4.0).to_dict()
    assert C.seq_is_rs(5.0, 4.0).rollout_is_threshold == 5.0


def test_preset_argument_errors_name_the_arguments():
    with pytest.raises(ConfigError, match=r"preset 'token_is'.*unexpected keyword.*'thresh'.*\{'threshold': 2.0\}"):
        C.from_preset("token_is", thresh=3.0)
    with pytest.raises(ConfigError, match="preset 'disabled'.*its arguments are none"):
        C.disabled(1.0)


def test_from_yaml_with_a_missing_file_says_so(tmp_path):
    pytest.importorskip("yaml")
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no such YAML file.*nope.yaml"):
        C.from_yaml(missing)
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  rollout_correction:\n    rollout_is: token\n", encoding="utf-8")
    assert C.from_yaml(str(path), key="algorithm.rollout_correction").rollout_is == "token"
    with pytest.raises(ConfigError, match=r"no 'rollout_corr' under algorithm.*found: \['rollout_correction'\]"):
        C.from_yaml(str(path), key="algorithm.rollout_corr")


# ------------------------------------------------------------------------------ LogRatioBatch
def _data(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    roll = (old + 0.6 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False  # an empty row
    return old, roll, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_batch_from_log_ratio_matches_the_batch_from_log_probs(level):
    old, roll, mask = _data()
    spec = C(rollout_is=level, rollout_is_threshold=1.5).is_spec
    a = importance_weights(log_ratio_batch(old, roll, mask), spec).weights
    b = importance_weights(LogRatioBatch.from_log_ratio(old - roll, mask), spec).weights
    torch.testing.assert_close(a, b)
    # by hand for one row: exp of the clamped sum / mean of its valid log-ratios, truncated at 1.5
    lr = (old - roll)[1][mask[1]]
    row = {"token": None, "sequence": lr.sum(), "geometric": lr.mean()}[level]
    if row is not None:
        assert float(b[1][mask[1]][0]) == pytest.approx(min(math.exp(float(row)), 1.5), rel=1e-5)


def test_batch_from_log_ratio_refuses_perplexity_and_names_bad_values():
    old, roll, mask = _data()
    batch = LogRatioBatch.from_log_ratio(old - roll, mask)
    with pytest.raises(ValueError, match="built from a log-ratio alone.*log_ratio_batch\\(old_log_prob"):
        batch.train_means64()
    lr = (old - roll).clone()
    lr[2, 3] = float("nan")
    mask[2, 3] = True
    with pytest.raises(ValueError, match=r"row 2, column 3.*log_ratio=nan"):
        LogRatioBatch.from_log_ratio(lr, mask, on_nonfinite="raise")
    dropped = LogRatioBatch.from_log_ratio(lr, mask)  # "reject": the row leaves every statistic
    assert not bool(dropped.row_valid[2]) and float(dropped.log_ratio[2].abs().sum()) == 0.0
    with pytest.raises(TypeError, match="log_ratio .* must be a floating-point"):
        LogRatioBatch.from_log_ratio(mask.long(), mask)



def test_batch_from_mask_counts_the_mask_alone():
    # Rows: 3 valid tokens; none; 2 valid tokens (one of them masked by a value other than 1).
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [0, 2, 0, 1]])
    batch = LogRatioBatch.from_mask(mask)
    assert batch.valid.tolist() == [[True, True, True, False], [False] * 4, [False, True, False, True]]
    assert batch.row_valid.tolist() == [True, False, True]
    assert float(batch.log_ratio.abs().sum()) == 0.0
    stats = SufficientStats()
    batch.add_counts(stats)
    assert float(stats.sum(COUNTS.n_tok)) == 5 and float(stats.sum(COUNTS.n_rows)) == 2
    assert float(stats.sum(COUNTS.n_rows_input)) == 2

# ------------------------------------------------------------------------------ rejection
def test_option_metrics_are_the_chain_metrics_of_that_option():
    old, roll, mask = _data(1, B=12, T=7)
    cfg = C(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.6_1.6,0.05")
    batch = log_ratio_batch(old, roll, mask)
    stats = SufficientStats()
    batch.add_counts(stats)
    rejection_keep(batch, cfg.rs_options, None, stats)
    chain = rs_metrics(stats, cfg.rs_options)
    for opt in cfg.rs_options:
        own = rs_option_metrics(stats, opt)
        assert own and all(k.startswith(f"rollout_rs_{opt.name}_") for k in own)
        assert own.keys() == {k for k in chain if k.startswith(f"rollout_rs_{opt.name}_")}
        for k, v in own.items():
            torch.testing.assert_close(v, chain[k])
    # the masked fraction of the token option, by hand: valid tokens with ρ outside [0.6, 1.6]
    rho = (old - roll).exp()
    outside = mask & ((rho < 0.6) | (rho > 1.6))
    got = float(rs_option_metrics(stats, cfg.rs_options[0])["rollout_rs_token_k1_masked_fraction"])
    assert got == pytest.approx(outside.sum().item() / mask.sum().item())


# ------------------------------------------------------------------------------ accumulator hook
def test_accumulator_hook_sees_each_chunk_weights_and_keep_mask():
    old, roll, mask = _data(2, B=10, T=6)
    cfg = C.decoupled_seq_is_rs(is_threshold=1.5, rs_threshold="0.4_2.5")
    seen = []
    acc = CorrectionAccumulator(cfg, on_batch=lambda batch, w, keep: seen.append((batch.n_row.shape[0], w, keep)))
    plain = CorrectionAccumulator(cfg)
    for part in (slice(0, 4), slice(4, 10)):
        acc.update(old[part], roll[part], mask[part])
        plain.update(old[part], roll[part], mask[part])
    assert [n for n, _, _ in seen] == [4, 6]
    whole = compute_rollout_correction(old, roll, mask, config=cfg)
    torch.testing.assert_close(torch.cat([w for _, w, _ in seen]), whole.weights)
    torch.testing.assert_close(torch.cat([k for _, _, k in seen]), whole.response_mask.float())
    got, ref = acc.compute(), plain.compute()
    assert got.keys() == ref.keys() == whole.metrics.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref[k])
        torch.testing.assert_close(got[k], whole.metrics[k])


def test_accumulator_hook_gets_no_weights_without_is():
    old, roll, mask = _data(3)
    seen = []
    CorrectionAccumulator("decoupled_k3_rs", on_batch=lambda b, w, k: seen.append(w)).update(old, roll, mask)
    assert seen == [None]
