"""Names 0.3.0 removed without a deprecation release, back until 0.4 (docs/api.md, "Deprecation";
CHANGELOG, Unreleased, *Fixed*): each warns with a ``DeprecationWarning`` that names its replacement
and the release that removes it, at the line that used it, and computes what it computed in 0.2.

pyproject's ``filterwarnings`` turns a warning matching "is deprecated since 0.3" into an error, so
that the library's own code cannot use a deprecated name unnoticed; ``pytest.warns`` records the
warning instead, and the first test checks that every alias's message matches that pattern."""

from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from rollout_correction_core.primitives import LogRatioBatch, log_ratio_batch
from rollout_correction_core.reductions import Family, HostStats, SufficientStats, seq_summary

ROOT = Path(__file__).resolve().parents[1]


def _deprecation(match: str):
    return pytest.warns(DeprecationWarning, match=match)


def _one_warning(record, replacement: str) -> str:
    """The message of the one DeprecationWarning in ``record``, raised at this file's line (stacklevel)
    and naming ``replacement`` and the release that removes the name."""
    (w,) = [w for w in record if issubclass(w.category, DeprecationWarning)]
    message = str(w.message)
    assert w.filename == __file__, (w.filename, message)
    assert replacement in message and "removed in 0.4" in message, message
    return message


def test_every_alias_message_is_one_the_suite_turns_into_an_error():
    """The messages match pyproject's filterwarnings pattern: a use by the library itself fails a test."""
    (pattern,) = [f.split(":")[1] for f in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
                  ["ini_options"]["filterwarnings"] if f.startswith("error:")]
    stats = SufficientStats()
    messages = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stats.add_sum("alias.pattern_sum", torch.ones(2))
        stats.add_max("alias.pattern_max", torch.ones(2))
        stats.add_min("alias.pattern_min", torch.ones(2))
        stats.sum("alias.pattern_sum")
        batch = log_ratio_batch(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
        batch.row_sum64, batch.row_means64  # noqa: B018
        seq_summary(HostStats({"k_sum": 0.0, "k_sum2": 0.0}, {"k_max": 0.0, "-k_min": 0.0}), "k", 0.0, 1.0)
        from rollout_correction.vocabulary import SKYRL_KEYS, from_skyrl  # noqa: F401
        messages = [str(w.message) for w in record]
    assert len(messages) == 9
    for message in messages:
        assert re.match(pattern, message), message
    with pytest.raises(DeprecationWarning):  # what the suite's filter does with it
        stats.add_sum("alias.pattern_sum", torch.ones(2))


def test_add_sum_add_max_add_min_record_by_name_as_in_0_2():
    """``add_sum(name, x, rows=, weight=)`` / ``add_max`` / ``add_min``: sums, weighted sums and the
    extremes of the kept elements, read back by name (``sum``/``max``/``min(name)``, deprecated too)."""
    x = torch.tensor([[1.0, -2.0, 4.0], [0.5, 3.0, -1.0]])
    rows = torch.tensor([[True, True, False], [True, False, True]])
    weight = torch.tensor([[2.0, 1.0, 1.0], [4.0, 1.0, 3.0]])
    stats = SufficientStats()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stats.add_sum("alias.total", x)
        stats.add_sum("alias.kept", x, rows=rows)
        stats.add_sum("alias.weighted", x, rows=rows, weight=weight)
        stats.add_max("alias.peak", x, rows=rows)
        stats.add_min("alias.low", x, rows=rows)
        stats.add_max("alias.low", x)  # a maximum and a minimum may share a name, as in 0.2
    assert len(record) == 6
    _one_warning(record[:1], "SufficientStats.add(stat, ...)")
    with _deprecation(r"SufficientStats\.sum\(name\).*removed in 0\.4.*SufficientStats\.sum\(stat\)") as read:
        total = stats.sum("alias.total")
    _one_warning(read, "SufficientStats.sum(stat)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = [stats.sum("alias.kept"), stats.sum("alias.weighted"), stats.max("alias.peak"), stats.min("alias.low"),
               stats.max("alias.low")]
    # by hand: kept elements 1, −2, 0.5, −1; weighted 2·1 + 1·(−2) + 4·0.5 + 3·(−1)
    assert [float(v) for v in [total] + got] == [5.5, -1.5, -1.0, 1.0, -2.0, 4.0]
    assert total.dtype == torch.float64


def test_add_sum_of_a_declared_name_fills_its_declared_slot():
    """A name the library declares (``n_tok`` of the counts) is that statistic: the same value as ``add``."""
    from rollout_correction_core._src.declared import COUNTS

    x = torch.tensor([3.0, 4.0])
    new, old = SufficientStats(), SufficientStats()
    new.add(COUNTS.n_tok, x)
    with _deprecation("add_sum"):
        old.add_sum("n_tok", x)
    assert old.packed_vector()[0] == new.packed_vector()[0] == ["n_tok"]
    assert torch.equal(old.packed_vector()[2], new.packed_vector()[2])
    assert float(old.sum(COUNTS.n_tok)) == 7.0


def test_statistics_recorded_by_name_merge_across_chunks():
    """Two chunks recorded by name merge into the statistics of the whole, as in 0.2."""
    a, b, whole = SufficientStats(), SufficientStats(), SufficientStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for stats, x in ((a, torch.tensor([1.0, 5.0])), (b, torch.tensor([-3.0])), (whole, torch.tensor([1.0, 5.0, -3.0]))):
            stats.add_sum("alias.chunk_sum", x)
            stats.add_max("alias.chunk_max", x)
        a.merge(b)
        assert (float(a.sum("alias.chunk_sum")), float(a.max("alias.chunk_max"))) == (3.0, 5.0)
        assert (float(whole.sum("alias.chunk_sum")), float(whole.max("alias.chunk_max"))) == (3.0, 5.0)


def test_host_stats_read_by_name_with_a_warning():
    host = HostStats({"alias.h": 2.5}, {"alias.h": 7.0, "-alias.h": 1.0})
    with _deprecation(r"HostStats\.sum\(name\)") as record:
        assert host.sum("alias.h") == 2.5
    _one_warning(record, "HostStats.sum(stat)")
    with _deprecation(r"HostStats\.min\(name\)"):
        assert host.min("alias.h") == -1.0


def test_seq_summary_by_key_reads_the_key_statistics():
    """0.2's ``seq_summary(stats, key, n_rows, center)``: the per-row values recorded as ``<key>_sum``,
    ``_sum2``, ``_max`` and ``_min``. Rows 1, 2, 6 around center 1: mean 3, std √7, max deviation 5."""
    values = torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64)
    stats = SufficientStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        stats.add_sum("alias.row_sum", values)
        stats.add_sum("alias.row_sum2", values * values)
        stats.add_max("alias.row_max", values)
        stats.add_min("alias.row_min", values)
    with _deprecation(r"seq_summary\(stats, key, \.\.\.\)") as record:
        got = seq_summary(stats, "alias.row", 3.0, 1.0)
    _one_warning(record, "seq_summary(stats, family, ...)")
    expected = {"mean": 3.0, "std": 7.0 ** 0.5, "max": 6.0, "min": 1.0, "max_deviation": 5.0}
    assert {k: float(v) for k, v in got.items()} == pytest.approx(expected, rel=1e-12)
    # the same statistics declared as a Family, through the current form
    family = Family("alias.fam.", sums="seq_sum seq_sum2", maxes="seq_max", mins="seq_min")
    declared = SufficientStats()
    for stat, v in ((family.seq_sum, values), (family.seq_sum2, values * values), (family.seq_max, values),
                    (family.seq_min, values)):
        declared.add(stat, v)
    assert {k: float(v) for k, v in seq_summary(declared, family, 3.0, 1.0).items()} == pytest.approx(expected)


def test_log_ratio_batch_row_sum64_and_row_means64():
    """``row_sum64``: (B,) float64 Σ_t log ρ_t; ``row_means64``: (2, B) float64 mean log ρ and mean
    log π_train per row (0 for an empty row), None for a batch built from a log-ratio alone."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, -3.0, -2.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    batch = log_ratio_batch(old, rollout, mask)
    with _deprecation(r"LogRatioBatch\.row_sum64") as record:
        row_sum64 = batch.row_sum64
    _one_warning(record, "LogRatioBatch.row_sum")
    assert row_sum64.dtype == torch.float64 and row_sum64.tolist() == [-0.5, 1.25, 0.0]
    with _deprecation(r"LogRatioBatch\.row_means64") as record:
        means = batch.row_means64
    _one_warning(record, "LogRatioBatch.train_means64()")
    assert means.dtype == torch.float64 and means.shape == (2, 3)
    assert means.tolist() == [[-0.25, 1.25 / 3, 0.0], [-1.5, -4.25 / 3, 0.0]]
    assert torch.equal(means, batch.train_means64())
    with _deprecation("row_means64"):
        assert LogRatioBatch.from_log_ratio(old - rollout, mask).row_means64 is None


def test_skyrl_keys_under_their_former_names():
    """``rollout_correction.vocabulary.SKYRL_KEYS`` / ``from_skyrl`` are the SkyRL adapter's objects,
    with a warning at the importing line; ``from_skyrl`` translates a SkyRL block as in 0.2."""
    from rollout_correction.compat import skyrl

    with _deprecation(r"rollout_correction\.vocabulary\.SKYRL_KEYS") as record:
        from rollout_correction.vocabulary import SKYRL_KEYS
    _one_warning(record, "rollout_correction.compat.skyrl.SKYRL_KEYS")
    import rollout_correction.vocabulary as vocabulary

    with _deprecation(r"rollout_correction\.vocabulary\.from_skyrl") as record:
        from_skyrl = vocabulary.from_skyrl
    _one_warning(record, "rollout_correction.compat.skyrl.from_skyrl")
    assert SKYRL_KEYS is skyrl.SKYRL_KEYS and from_skyrl is skyrl.from_skyrl
    assert SKYRL_KEYS["token_tis_ratio_clip_high"] == 2.0
    got = from_skyrl({"tis_ratio_type": "token", "outlier_token_is_threshold_low": 1e-4})
    assert got["rollout_is"] == "token" and got["rollout_is_threshold"] == 2.0
    assert got["rollout_token_veto_threshold"] == 1e-4
    assert "SKYRL_KEYS" not in vocabulary.__all__
    with pytest.raises(AttributeError, match="no attribute 'SKYRL'"):
        vocabulary.SKYRL  # noqa: B018
