"""Metric families: a call computes the families its config selects (the ``metrics`` key), a family
not selected takes no slot in the reduction, and selecting every family gives the numbers of commit
a50a7b9 (before the families existed) on the fixed reference cases of ``tools/reference_cases.py``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollout_correction import (ConfigError, RolloutCorrectionConfig, compute_offpolicy_metrics,
                                compute_rollout_correction, metrics_to_floats)
from rollout_correction_core._src.config import METRIC_FAMILIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reference_cases as rcs  # noqa: E402

P = "rollout_corr/"
REFERENCE = json.loads((Path(__file__).parent / "reference_cases.json").read_text())
#: The bits of a float32 row sum depend on the vector width the CPU kernels use (and on torch's kernels).
RECORDING_PLATFORM = (REFERENCE["torch"], REFERENCE["cpu_capability"]) == (
    torch.__version__, torch.backends.cpu.get_cpu_capability())
CASES = {name: (keys, adv) for name, keys, adv in rcs.CASES}

#: Each opt-in family's metrics and statistics (slot names), written out by hand.
OPT_IN = {
    "raw": ({"rollout_is_raw_mean", "rollout_is_seq_raw_mean"}, {"op.sum_rho", "op.rho_seq"}),
    "chi2": ({"chi2_token_sn", "chi2_seq_sn"}, {"op.sum_rho", "op.rho_seq", "op.sum_rho2", "op.rho2_seq"}),
    "mismatch": ({"prob_abs_diff_mean", "prob_abs_diff_max", "prob_abs_diff_std", "prob_pearson", "log_prob_pearson",
                  "js_divergence", "log_prob_abs_diff_seq_mean", "log_prob_abs_diff_max", "log_prob_abs_diff_gt1",
                  "log_prob_abs_diff_gt2"},
                 {f"mm.{n}" for n in "q p qq pp qp lq lp lqlq lplp lqlp d dd js gt1 gt2 a_seq d_max a_max".split()}),
    "sentinel": ({"sentinel_token_fraction"}, {"n_sentinel", "n_tok_input"}),
    "expect_zero": ({"max_abs_log_ratio"}, {"ez.max_abs"}),
    "detail": ({"rollout_is_seq_raw_ess", "rollout_is_seq_log_mean", "rollout_is_seq_collapsed_fraction"},
               {"is.raw_sum", "is.raw_sum2", "is.log_sum", "is.collapsed"}),
    "ratio_bands": ({"ratio_band_tight_fraction", "ratio_band_1pct_fraction", "ratio_band_5pct_fraction"},
                    {"band.tight", "band.pct1", "band.pct5"}),
}
#: Metrics of a decision: reported whatever is selected.
ALWAYS = {"nonfinite_seq_fraction"}


def test_the_reference_cases_cover_every_preset_and_family():
    assert len(REFERENCE["cases"]) == len(rcs.CASES) * len(rcs.SEEDS) == 448
    assert {name for name, _, _ in rcs.CASES} >= set(RolloutCorrectionConfig.preset_names())
    names = set().union(*REFERENCE["metrics"].values())
    for family, (metrics, _) in OPT_IN.items():  # today's numbers of every opt-in family are recorded
        assert {P + m for m in metrics} <= names, family


def test_every_family_gives_the_recorded_bits():
    """Weights, mask and every metric the reference recorded, bit for bit (float64 bits of each
    metric, bytes of the weights and the mask); "all" adds max_abs_log_ratio (expect_zero) where
    the reference had no expect-zero mode. The bits are those of the recording platform (torch
    version and CPU vector width, which orders float32 sums); elsewhere the names are compared."""
    for row in REFERENCE["cases"]:
        keys, adv = CASES[row["case"]]
        weights, mask, metrics = rcs.run_case(rcs.config_of(keys, metrics="all"), row["seed"], adv)
        names = REFERENCE["metrics"][row["case"]]
        assert set(names) <= set(metrics), row["case"]
        assert set(metrics) - set(names) <= {P + "max_abs_log_ratio"}, row["case"]
        if RECORDING_PLATFORM:
            assert rcs.digest(weights, mask, metrics, names) == row["digest"], (row["case"], row["seed"])


def _slots(out) -> set[str]:
    stats = out.metrics._sources[0][0]  # the call's reduced statistics
    names_s, names_m, _ = stats.packed_vector()
    return {n.lstrip("-") for n in [*names_s, *names_m]}


@pytest.mark.parametrize("case", ["decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs_token_tis", "segment IS",
                                  "segments", "advantages", "expect zero", "veto both sides", "alignment", "no floor"])
def test_a_selection_computes_its_families_with_the_bits_of_all(case):
    """For every family alone, none, default with each other one: the metrics are those of the
    families selected (and the decisions'), each with the bits of "all"; weights and mask never
    change; an opt-in family adds exactly its statistics to the reduction."""
    keys, adv = CASES[case]
    w_all, m_all, everything = rcs.run_case(rcs.config_of(keys, metrics="all"), 3, adv)
    names = {k[len(P):] for k in everything}
    opt_in = set().union(*(m for m, _ in OPT_IN.values()))
    decisions = ALWAYS | ({"max_abs_log_ratio"} if "expect_zero_atol" in keys else set()) | \
        {n for n in names if n.startswith("alignment_")}
    default = names - opt_in - decisions
    none = None
    for selection in ([], ["default"], *([f] for f in OPT_IN), *(["default", f] for f in OPT_IN)):
        cfg = rcs.config_of(keys, metrics=selection).replace(mismatch_metrics=False)
        w, m, metrics = rcs.run_case(cfg, 3, adv)
        assert (w is None) == (w_all is None) and (w is None or torch.equal(w, w_all)) and torch.equal(m, m_all)
        expected = decisions | set().union(*(OPT_IN[f][0] for f in selection if f in OPT_IN)) & names
        expected |= default if "default" in selection else set()
        assert {k[len(P):] for k in metrics} == expected, selection
        assert all(metrics[k] == everything[k] for k in metrics), selection
        old, rollout, mask, segments, advantages = rcs.case_batch(3)
        out = compute_rollout_correction(old, rollout, mask, config=cfg, segments=segments if cfg.uses_segments else None,
                                         advantages=advantages if adv else None)
        if selection == []:
            none = _slots(out)
        elif len(selection) == 1 and selection[0] in OPT_IN:
            family, level = selection[0], cfg.rollout_is
            applies = {"detail": level not in (None, "token", "prefix_min"), "sentinel": cfg.log_prob_floor is not None}
            wanted = OPT_IN[family][1] if applies.get(family, True) else set()
            if family == "detail" and str(cfg.rollout_is).startswith("segment"):
                wanted = wanted | {"is.units"}  # its denominator: the valid segments
            assert _slots(out) - none == wanted - none, selection


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"metrics.*unknown family 'mismach' \(did you mean 'mismatch'\?\).*"
                                          r"known families: \['all', 'default', 'raw', 'chi2', 'mismatch'"):
        RolloutCorrectionConfig(metrics=["default", "mismach"])
    with pytest.raises(ConfigError, match="metrics"):
        RolloutCorrectionConfig(metrics=7)
    with pytest.raises(ConfigError, match="unknown family"):
        compute_offpolicy_metrics(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), metrics=["chi3"])


def test_the_metrics_key_loads_from_a_list_a_string_yaml_and_omegaconf():
    from omegaconf import OmegaConf

    expected = ("default", "raw", "chi2")
    assert RolloutCorrectionConfig(metrics=["default", "raw", "chi2"]).metrics == expected
    assert RolloutCorrectionConfig.from_dict({"metrics": "default, raw,chi2"}).metrics == expected
    assert RolloutCorrectionConfig.from_yaml(textwrap.dedent("""
        rollout_is: token
        metrics: [default, raw, chi2]
    """)).metrics == expected
    node = OmegaConf.create({"rollout_correction": {"metrics": ["default", "raw", "chi2"]}})
    assert RolloutCorrectionConfig.from_omegaconf(node.rollout_correction).metrics == expected
    assert RolloutCorrectionConfig(metrics="all").metrics == tuple(METRIC_FAMILIES)
    assert RolloutCorrectionConfig().metrics == ("default",) and RolloutCorrectionConfig(metrics=[]).metrics == ()
    cfg = RolloutCorrectionConfig(metrics=["raw"])
    assert cfg.to_dict()["metrics"] == ["raw"] and RolloutCorrectionConfig.from_dict(cfg.to_dict()) == cfg
    assert RolloutCorrectionConfig(metrics=["raw"]) != RolloutCorrectionConfig()  # a compiled pass per selection


def test_mismatch_metrics_is_the_switch_of_the_mismatch_family():
    old, rollout, mask, _, _ = rcs.case_batch(2)
    by_key = compute_rollout_correction(old, rollout, mask, config={"mismatch_metrics": True}).metrics_as_floats()
    by_name = compute_rollout_correction(old, rollout, mask,
                                         config={"metrics": ["default", "mismatch"]}).metrics_as_floats()
    assert by_key == by_name and P + "prob_pearson" in by_key
    assert RolloutCorrectionConfig(mismatch_metrics=True).families == {"default", "mismatch"}
    plain = metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask, mismatch_metrics=True))
    assert plain == metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask, metrics=["default", "mismatch"]))


def test_no_family_leaves_the_decisions():
    """metrics=[]: weights, masks, batch normalisation and the all-rejected check as with every family."""
    old, rollout, mask, _, _ = rcs.case_batch(0)
    for keys in ({"rollout_is": "token", "rollout_is_batch_normalize": True},
                 {"rollout_is": "sequence", "rollout_is_batch_normalize": True},
                 {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999999_1.000001",
                  "rollout_rs_all_rejected": "raise"}):
        cfg = RolloutCorrectionConfig.from_dict(keys)
        if "rollout_rs" in keys:
            with pytest.raises(ValueError, match="rejection dropped all"):
                compute_rollout_correction(old, rollout, mask, config=cfg.replace(metrics=[]))
            continue
        full = compute_rollout_correction(old, rollout, mask, config=cfg.replace(metrics="all"))
        bare = compute_rollout_correction(old, rollout, mask, config=cfg.replace(metrics=[]))
        assert torch.equal(bare.weights, full.weights) and torch.equal(bare.response_mask, full.response_mask)
        assert set(bare.metrics_as_floats()) == {P + "nonfinite_seq_fraction"}


def test_split_rows_reduce_only_the_selected_families_values_of_dropped_rows():
    """With rows split across a group, a batch reduces what a dropped row keeps (the sentinel count, the
    largest gap) before dropping its rows, and only for the families read from the rows: with none
    selected, no partial is exchanged for them and no operation computes them."""
    from rollout_correction_core.primitives import log_ratio_batch
    from rollout_correction_core.reductions import RowExchange

    nan = float("nan")
    old = torch.tensor([[-1.0, -5000.0, -1.0], [-0.5, nan, -2.0]])
    rollout = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.0, -2.25]])
    mask = torch.ones(2, 3)

    def collected(families):
        rows = RowExchange(object(), families=families)  # the collect pass: partials recorded, nothing sent
        return rows, log_ratio_batch(old, rollout, mask, rows=rows)

    rows_none, none = collected(())
    rows_both, both = collected(("sentinel", "expect_zero"))
    assert len(rows_both._parts) == len(rows_none._parts) + 2
    assert none.sentinel_row is None and none.gap_row is None
    # row 0: one sentinel (−5000 ≤ the floor), largest gap |−5000 − (−1)|; row 1: a NaN, no sentinel, gap 1e30
    assert both.sentinel_row.tolist() == [1.0, 0.0]
    assert both.gap_row.tolist() == [4999.0, float(torch.tensor(1e30))]  # 1e30 in float32
    assert both.bad_rows.tolist() == [True, True]  # both rows dropped, their values kept
