"""The eager pass walks large batches in blocks of rows; the result must not depend on it."""

import pytest
import torch

import rollout_correction_core._src.correction as correction
from conftest import assert_same_correction
from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction


CONFIGS = ["disabled", "decoupled_token_is", "decoupled_seq_is_rs", "decoupled_token_icepop", "geo_mis",
           "decoupled_k3_rs_token_tis", "seq_is_rs"]


def _batch(B=13, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    roll = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[4] = False  # an empty row inside a block
    old[6, 2] = float("nan")  # a dropped row
    roll[~mask] = float("nan")  # padding may hold anything
    return old, roll, mask


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("block_tokens", [1, 14, 20])  # 1 row, 2 rows, 2 rows + remainder
def test_blocked_pass_equals_one_block(monkeypatch, name, block_tokens):
    old, roll, mask = _batch()
    cfg = RolloutCorrectionConfig.from_preset(name).replace(rollout_is_batch_normalize=name != "disabled"
                                                           and RolloutCorrectionConfig.from_preset(name).rollout_is is not None)
    whole = compute_rollout_correction(old, roll, mask, config=cfg)
    monkeypatch.setattr(correction, "BLOCK_TOKENS", block_tokens)
    blocked = compute_rollout_correction(old, roll, mask, config=cfg)
    assert blocked.response_mask.dtype == mask.dtype
    assert_same_correction(blocked, whole, weights_rtol=1e-6, rel=1e-9, abs=1e-12)


def test_blocked_pass_reports_the_global_row_of_a_nonfinite_value(monkeypatch):
    old, roll, mask = _batch()
    monkeypatch.setattr(correction, "BLOCK_TOKENS", 14)  # blocks of 2 rows: row 6 is in the 4th block
    cfg = RolloutCorrectionConfig(on_nonfinite="raise")
    with pytest.raises(ValueError, match=r"row 6, column 2"):
        compute_rollout_correction(old, roll, mask, config=cfg)


def test_compiled_passes_share_one_function_in_a_bounded_cache(monkeypatch):
    """compile=True keeps one compiled pass per config, the COMPILE_CACHE_SIZE most recent, and every
    one of them compiles the same function (no copy of a code object per config). ``torch.compile``
    is recorded here, not run: what is checked is what the cache hands it and keeps."""
    compiled = []

    def record(fn):
        compiled.append(fn)
        return fn

    monkeypatch.setattr(correction.torch, "compile", record)
    monkeypatch.setattr(correction, "COMPILE_CACHE_SIZE", 2)
    monkeypatch.setattr(correction, "_COMPILED", correction.OrderedDict())
    g = torch.Generator().manual_seed(0)
    old, rollout = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    configs = [RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=c) for c in (1.5, 2.0, 3.0)]
    for cfg in configs + configs[2:]:
        got = compute_rollout_correction(old, rollout, mask, config=cfg, compile=True)
        eager = compute_rollout_correction(old, rollout, mask, config=cfg)
        torch.testing.assert_close(got.weights, eager.weights, rtol=0, atol=0)
    assert len(compiled) == 3  # the repeated last config reused its pass
    assert len({fn.__code__ for fn in compiled}) == 1
    assert list(correction._COMPILED) == configs[1:]  # bounded: the oldest config dropped
    compute_rollout_correction(old, rollout, mask, config=configs[0], compile=True)
    assert len(compiled) == 4 and list(correction._COMPILED) == [configs[2], configs[0]]
