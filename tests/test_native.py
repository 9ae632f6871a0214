"""The fused CPU kernels (rollout_correction.native): built for real with the system compiler, checked
against the ATen pass and against values computed independently in float64; the fallback when
they cannot be built, and the switch."""

import math

import pytest
import torch

import rollout_correction.correction as correction
from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction, native
from rollout_correction.logratio import LogRatioBatch

from conftest import assert_same_correction


@pytest.fixture
def fused(monkeypatch):
    """The kernels, required: a failed build fails the test instead of testing the ATen pass."""
    monkeypatch.setenv(native.ENV, "1")
    assert native.library() is not None
    return native


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty build cache and no loaded library, restored afterwards."""
    saved = dict(native._state)
    native._state.clear()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    yield tmp_path
    native._state.clear()
    native._state.update(saved)


def _inputs(B=9, T=37, dtype=torch.float32, seed=0, mask_dtype=torch.bool):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    roll = old + 0.3 * torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    roll[~valid] = float("nan")  # padding may hold anything
    return old.to(dtype), roll.to(dtype), valid.to(mask_dtype)


def _aten_batch(monkeypatch, old, roll, mask, **kw):
    with monkeypatch.context() as m:
        m.setenv(native.ENV, "0")
        batch = LogRatioBatch(old, roll, mask, **kw)
        batch.ratio, batch.k3  # computed while the switch is off
        return batch


def test_status_and_the_switch(fused, monkeypatch):
    assert native.status().startswith("native CPU kernels: in use (")
    old, roll, mask = _inputs()
    assert LogRatioBatch(old, roll, mask).native
    monkeypatch.setenv(native.ENV, "0")
    assert not LogRatioBatch(old, roll, mask).native
    assert "off" in native.status()
    monkeypatch.setenv(native.ENV, "sometimes")
    with pytest.raises(ValueError, match="ROLLOUT_CORRECTION_NATIVE='sometimes'"):
        native.library()


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 37, 513, 1100])
def test_pass_equals_the_aten_pass(fused, monkeypatch, dtypes, T):
    old, roll, mask = _inputs(T=T)
    old, roll = old.to(dtypes[0]), roll.to(dtypes[1])
    old[2, 0] = float("nan")  # row 2 has a valid token at 0 unless empty: dropped
    a = _aten_batch(monkeypatch, old, roll, mask)
    n = LogRatioBatch(old, roll, mask)
    assert n.native and not a.native
    assert torch.equal(n.mask, a.mask)
    assert torch.equal(n.log_ratio, a.log_ratio)  # a subtraction and a mask: exact
    assert torch.equal(n.bad_rows, a.bad_rows)
    assert torch.equal(n.row_valid, a.row_valid) and torch.equal(n.n_row, a.n_row)
    # exp differs from torch.exp in the last bit at most (polynomial vs libm / SLEEF)
    torch.testing.assert_close(n.ratio, a.ratio, rtol=2.5e-7, atol=0)
    torch.testing.assert_close(n.k3, a.k3, rtol=0, atol=5e-7 * float(a.ratio.max().clamp_min(1)))
    torch.testing.assert_close(n.row_sums, a.row_sums, rtol=2e-6, atol=2e-5)


def test_exp_within_two_ulp_of_float64(fused):
    # Every float32 log-ratio step of 2^-12 over the whole safety range, against exp in float64
    lr = torch.arange(-20 * 4096, 20 * 4096 + 1, dtype=torch.float64).div_(4096).float().reshape(1, -1)
    zero = torch.zeros_like(lr)
    batch = LogRatioBatch(lr, zero, torch.ones_like(lr, dtype=torch.bool))
    exact = lr.double().exp()
    ulp = (exact.float().nextafter(torch.tensor(math.inf)) - exact.float()).double()
    err = ((batch.ratio.double() - exact).abs() / ulp).max().item()
    assert err <= 2.0, err
    assert batch.ratio[0, 20 * 4096].item() == 1.0  # exp(0) is exactly 1: k3 = 0 on identical policies


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16,
                                        torch.bfloat16, torch.float32, torch.float64])
def test_every_mask_dtype_means_nonzero(fused, monkeypatch, mask_dtype):
    old, roll, mask = _inputs(mask_dtype=mask_dtype)
    if mask_dtype.is_floating_point:
        mask[0, 0] = -0.0  # zero: not valid
        mask[1, 0] = float("nan")  # non-zero: valid (like mask != 0)
        mask[1, 1] = -2.5
    else:
        mask[0, 0] = 0
        mask[1, 0] = 3 if mask_dtype != torch.bool else True
    roll[1, :2] = old[1, :2] - 0.1
    expected = (mask != 0).float()
    batch = LogRatioBatch(old, roll, mask)
    assert batch.native
    assert torch.equal(batch.mask, expected)
    assert torch.equal(batch.n_row, expected.sum(-1))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("preset", ["disabled", "decoupled_token_is", "decoupled_seq_is"])
def test_final_mask_written_by_the_pass_in_the_callers_dtype(fused, monkeypatch, mask_dtype, preset):
    # Without rejection the pass writes the final mask itself: 1 / 0 of the input's dtype, the
    # dropped row (NaN at a valid token) all 0, also across blocks.
    old, roll, mask = _inputs(B=12, T=29, seed=2, mask_dtype=mask_dtype)
    mask[4] = 1
    old[4, 3] = float("nan")
    for block in (None, 29 * 5):
        if block is not None:
            monkeypatch.setattr(correction, "NATIVE_BLOCK_TOKENS", block)
        ours = compute_rollout_correction(old, roll, mask, preset)
        with monkeypatch.context() as m:
            m.setenv(native.ENV, "0")
            aten = compute_rollout_correction(old, roll, mask, preset)
        assert ours.response_mask.dtype == mask_dtype
        assert torch.equal(ours.response_mask, aten.response_mask)
        assert not ours.response_mask[4].any() and ours.response_mask[:4].bool().equal(mask[:4] != 0)


def test_rows_with_a_stride_and_results_independent_of_threads_and_blocks(fused, monkeypatch):
    old, roll, mask = _inputs(B=40, T=300)
    wide_old = torch.zeros(40, 512)
    wide_old[:, :300] = old
    strided = wide_old[:, :300]  # rows 512 elements apart
    assert strided.stride(0) == 512
    one = LogRatioBatch(old, roll, mask)
    two = LogRatioBatch(strided, roll, mask)
    monkeypatch.setattr(native, "MIN_TOKENS_PER_THREAD", 1)
    torch.set_num_threads(4)
    try:
        threaded = LogRatioBatch(old, roll, mask)
    finally:
        torch.set_num_threads(1)
    rows = LogRatioBatch(old[7:19], roll[7:19], mask[7:19])  # a block of rows
    for other in (two, threaded):
        for name in ("mask", "log_ratio", "ratio", "k3", "row_sums"):
            assert torch.equal(getattr(other, name), getattr(one, name)), name
    for name in ("mask", "log_ratio", "ratio", "k3"):
        assert torch.equal(getattr(rows, name), getattr(one, name)[7:19]), name
    assert torch.equal(rows.row_sums, one.row_sums[:, 7:19])


def test_nonfinite_rows_dropped_and_raised_like_the_aten_pass(fused, monkeypatch):
    old, roll, mask = _inputs(B=4, T=20)
    mask[:] = True
    roll = torch.where(roll.isnan(), old - 0.1, roll)  # the padding becomes valid: finite values
    old[1, 3] = float("inf")
    roll[2, 5] = float("nan")
    roll[3, 0] = old[3, 0] - 1e31  # finite, but |log ρ| ≥ 1e30 counts as non-finite
    batch = LogRatioBatch(old, roll, mask)
    assert batch.bad_rows.tolist() == [False, True, True, True]
    assert batch.n_row.tolist() == [20.0, 0.0, 0.0, 0.0]
    assert batch.n_row_input.tolist() == [20.0] * 4
    assert torch.count_nonzero(batch.ratio[1:]) == 0 and torch.count_nonzero(batch.log_ratio[1:]) == 0
    assert torch.count_nonzero(batch.row_sums[1:, 1:]) == 0
    with pytest.raises(ValueError, match=r"row 1, column 3"):
        LogRatioBatch(old, roll, mask, on_nonfinite="raise")


PRESETS = ["disabled", "decoupled_token_is", "decoupled_seq_is_rs", "decoupled_token_icepop", "geo_mis",
           "decoupled_k3_rs_token_tis", "seq_is_rs", "decoupled_geo_rs", "decoupled_k3_rs",
           "decoupled_geo_rs_token_tis"]
EXTRA = [{"rollout_is": "token", "rollout_is_mode": "clip", "rollout_is_threshold": "0.5_2.0"},
         {"rollout_rs": "token_k1,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.01,2.0"},
         {"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "0.02,0.05"},
         {"rollout_rs": "seq_max_k3,seq_sum_k2", "rollout_rs_threshold": "0.08,0.5"},
         {"rollout_is": "token", "rollout_token_veto_threshold": 0.2},
         {"rollout_rs": "token_k1", "rollout_rs_threshold": "1.02_3.0"}]  # a band without ρ = 1 (k1 = 0)


@pytest.mark.parametrize("settings", PRESETS + EXTRA, ids=lambda s: s if isinstance(s, str) else ",".join(map(str, s.values())))
def test_correction_equals_the_aten_pass(fused, monkeypatch, settings):
    cfg = (RolloutCorrectionConfig.from_preset(settings) if isinstance(settings, str)
           else RolloutCorrectionConfig.from_dict(settings))
    old, roll, mask = _inputs(B=24, T=61, seed=3)
    old[5, 1] = float("nan")
    ours = compute_rollout_correction(old, roll, mask, cfg)
    monkeypatch.setenv(native.ENV, "0")
    aten = compute_rollout_correction(old, roll, mask, cfg)
    assert_same_correction(ours, aten, weights_rtol=5e-7, rel=2e-5, abs=2e-6)


def test_token_options_against_their_definitions(fused):
    # token_k1 "0.5_2.0" keeps tokens with 0.5 ≤ ρ ≤ 2; token_k2 0.02 keeps ½ (log ρ)² ≤ 0.02
    ratios = [1.0, 2.5, 0.4, 1.9, 0.6, 1.3]
    lr = torch.tensor([ratios]).log()
    old, roll = lr.clone(), torch.zeros_like(lr)
    mask = torch.tensor([[True] * 5 + [False]])
    for spec, threshold, keep in [
        ("token_k1", "0.5_2.0", [r <= 2.0 and r >= 0.5 for r in ratios[:5]]),
        ("token_k2", 0.02, [0.5 * math.log(r) ** 2 <= 0.02 for r in ratios[:5]]),
    ]:
        out = compute_rollout_correction(old, roll, mask, {"rollout_rs": spec, "rollout_rs_threshold": threshold})
        assert out.response_mask[0, :5].tolist() == keep and not out.response_mask[0, 5]
        m = out.metrics_as_floats()
        assert m[f"rollout_corr/rollout_rs_{spec}_masked_fraction"] == pytest.approx(keep.count(False) / 5)
    # every valid ρ > 1: k1 = −log ρ < 0 on every valid token, so the padding (k1 = 0) must not
    # count in the maximum
    lr = torch.tensor([[1.5, 2.5, 1.2, 1.9, 1.0, 1.0]]).log()
    out = compute_rollout_correction(lr, torch.zeros_like(lr), torch.tensor([[True] * 4 + [False] * 2]),
                                     {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_3.0"})
    m = out.metrics_as_floats()
    assert m["rollout_corr/rollout_rs_token_k1_max"] == pytest.approx(-math.log(1.2), rel=1e-6)
    assert m["rollout_corr/rollout_rs_token_k1_min"] == pytest.approx(-math.log(2.5), rel=1e-6)


def test_fallback_without_a_compiler(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    monkeypatch.setenv(native.ENV, "auto")
    old, roll, mask = _inputs()
    batch = LogRatioBatch(old, roll, mask)
    assert not batch.native
    assert "unavailable" in native.status() and "no-such-compiler" in native.status()
    out = compute_rollout_correction(old, roll, mask, "decoupled_token_is")
    monkeypatch.setenv(native.ENV, "0")
    off = compute_rollout_correction(old, roll, mask, "decoupled_token_is")
    assert torch.equal(out.weights, off.weights) and out.metrics_as_floats() == off.metrics_as_floats()
    native._state.clear()
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(RuntimeError, match="ROLLOUT_CORRECTION_NATIVE=1 but the native CPU kernels are unavailable"):
        native.library()


def test_build_is_cached(monkeypatch, fresh_build):
    monkeypatch.setenv(native.ENV, "1")
    native.library()
    built = sorted((fresh_build / "native").glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native._state.clear()
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))  # the cached library needs no compiler run…
    with pytest.raises(RuntimeError):  # …but the cache key includes the compiler: another CC builds anew
        native.library()
    monkeypatch.delenv("CC")
    native._state.clear()
    assert native.library() is not None
    assert [p.stat().st_mtime_ns for p in (fresh_build / "native").glob("kernels-*.so")] == [stamp]


def test_inputs_the_kernels_do_not_take_use_the_aten_pass(fused):
    old, roll, mask = _inputs()
    assert not LogRatioBatch(old.double(), roll.double(), mask).native  # float64 log-probs
    assert not LogRatioBatch(old.half(), roll.half(), mask).native
    assert not LogRatioBatch(old.t().contiguous().t(), roll, mask).native  # columns not contiguous
    grad = old.clone().requires_grad_()
    assert not native.enabled_for(grad, roll, mask)  # autograd may need the ATen graph
    with torch.no_grad():
        assert native.enabled_for(grad, roll, mask)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_batches(fused, monkeypatch, shape):
    old, roll = torch.zeros(shape), torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    out = compute_rollout_correction(old, roll, mask, "decoupled_k3_rs_token_tis")
    monkeypatch.setenv(native.ENV, "0")
    ref = compute_rollout_correction(old, roll, mask, "decoupled_k3_rs_token_tis")
    assert out.weights.shape == shape and out.response_mask.shape == shape
    assert out.metrics_as_floats() == ref.metrics_as_floats()


def test_blocks_of_the_fused_pass(fused, monkeypatch):
    # The fused pass walks the batch in larger blocks; a block boundary must not change anything.
    old, roll, mask = _inputs(B=50, T=33, seed=5)
    cfg = RolloutCorrectionConfig.from_preset("decoupled_k3_rs_token_tis").replace(rollout_is_batch_normalize=True)
    whole = compute_rollout_correction(old, roll, mask, cfg)
    monkeypatch.setattr(correction, "NATIVE_BLOCK_TOKENS", 33 * 7)
    blocked = compute_rollout_correction(old, roll, mask, cfg)
    assert torch.equal(whole.weights, blocked.weights)
    # per-row values are identical; the float64 block totals are added in another order (abs: the
    # std of values that are all equal is the square root of a float64 cancellation, ~1e-10)
    assert_same_correction(blocked, whole, weights_rtol=0, rel=1e-9, abs=1e-9)


def test_cli_reports_and_fails_without_a_compiler(monkeypatch, fresh_build, capsys):
    from rollout_correction import cli

    monkeypatch.setenv(native.ENV, "auto")
    assert cli.main(["native"]) == 0
    assert "native CPU kernels: in use (" + str(fresh_build) in capsys.readouterr().out
    native._state.clear()
    monkeypatch.setenv(native.CACHE_ENV, str(fresh_build / "other"))
    monkeypatch.setenv("CC", "/no/such/cc")
    assert cli.main(["native"]) == 1
    out = capsys.readouterr().out
    assert "unavailable" in out and "/no/such/cc" in out and "Install a C compiler" in out
    monkeypatch.setenv(native.ENV, "0")
    assert cli.main(["native"]) == 0
    assert "off (ROLLOUT_CORRECTION_NATIVE=0)" in capsys.readouterr().out


def test_a_library_others_can_write_is_neither_loaded_nor_built_into(monkeypatch, fresh_build):
    monkeypatch.setenv(native.ENV, "1")
    native.library()
    (built,) = (fresh_build / "native").glob("kernels-*.so")
    assert built.stat().st_mode & 0o077 == 0  # the library is the user's alone
    native._state.clear()
    built.chmod(0o777)  # writable by anyone: it might have been replaced
    (fresh_build / "native").chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by other users"):
        native.library()  # not loaded, and not rebuilt in a folder others can write
    (fresh_build / "native").chmod(0o700)
    native._state.clear()
    assert native.library() is not None  # rebuilt in place of the suspicious file
    assert built.stat().st_mode & 0o077 == 0


# ---- property: the two passes agree on arbitrary batches and configurations -----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPTIONS = ["token_k1", "seq_sum_k1", "seq_mean_k1", "token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


@st.composite
def _cases(draw):
    B, T = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    n = B * T
    lr = draw(st.lists(st.one_of(st.floats(-3.0, 3.0, width=32), st.sampled_from([-30.0, -21.0, 0.0, 21.0, 30.0])),
                       min_size=n, max_size=n))
    roll = draw(st.lists(st.floats(-6.0, 0.0, width=32), min_size=n, max_size=n))
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    roll = torch.tensor(roll).view(B, T)
    mask = torch.tensor(valid).view(B, T)
    old = torch.where(mask, roll + torch.tensor(lr).view(B, T), torch.tensor(float("nan")))
    if draw(st.booleans()):  # a non-finite value at a valid token drops its row
        b, t = draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))
        mask[b, t] = True
        old[b, t] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.float32, torch.int64]))
    settings_ = {}
    if draw(st.booleans()):
        settings_["rollout_is"] = draw(st.sampled_from(["token", "sequence", "geometric"]))
        hi = draw(st.floats(1.05, 5.0))
        kind = draw(st.sampled_from(["truncate", "mask", "clip"]))
        lo = draw(st.floats(0.05, 0.95))
        settings_["rollout_is_threshold"] = hi if kind == "truncate" else f"{lo:.3f}_{hi:.3f}"
        if kind == "clip":
            settings_["rollout_is_mode"] = "clip"
        settings_["rollout_is_batch_normalize"] = draw(st.booleans())
    options = draw(st.lists(st.sampled_from(_OPTIONS), min_size=0, max_size=3, unique=True))
    if options:
        settings_["rollout_rs"] = ",".join(options)
        settings_["rollout_rs_threshold"] = ",".join(
            f"{draw(st.floats(0.1, 0.99)):.3f}_{draw(st.floats(1.01, 8.0)):.3f}" if o.endswith("k1")
            else f"{draw(st.floats(0.001, 2.0)):.4f}" for o in options)
    if draw(st.booleans()):
        settings_["rollout_token_veto_threshold"] = draw(st.floats(1e-4, 0.5))
    return old.to(dtype), roll.to(dtype), mask.to(mask_dtype), settings_


@settings(max_examples=200, deadline=None)
@given(_cases())
def test_property_both_passes_agree(case):
    old, roll, mask, settings_ = case
    import os

    cfg = RolloutCorrectionConfig.from_dict(settings_)
    saved = os.environ.get(native.ENV)
    try:
        os.environ[native.ENV] = "1"
        ours = compute_rollout_correction(old, roll, mask, cfg)
        os.environ[native.ENV] = "0"
        aten = compute_rollout_correction(old, roll, mask, cfg)
    finally:
        os.environ.pop(native.ENV) if saved is None else os.environ.__setitem__(native.ENV, saved)
    # masks and counts exactly; weights to a few float32 ulp (exp, then the normalisation factor);
    # metrics to float32 rounding of sums taken in another order. A std's error scales with the
    # values (up to e^20 ≈ 5e8, ulp 32): e.g. two sequence sums of k3 that differ by 38 — ATen's
    # running float32 sum rounds twice, to a difference of 64; the fused pass adds in float64 and
    # rounds once, to 32.
    assert_same_correction(ours, aten, weights_rtol=4e-6, rel=1e-4, abs=1e-5, std_scale=1e-3)


def test_posix_threads_build(monkeypatch, fresh_build):
    # A compiler without OpenMP: rows are split over POSIX threads (when PyTorch's own pool is not
    # OpenMP, whose spinning workers would starve them), with the same bits as one thread.
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setattr(native, "VARIANTS", (("-march=native",), ()))
    native.library()
    assert "POSIX threads" in native.status()
    old, roll, mask = _inputs(B=40, T=300, seed=4)
    one = LogRatioBatch(old, roll, mask)
    monkeypatch.setattr(native, "MIN_TOKENS_PER_THREAD", 1)
    monkeypatch.setitem(native._state, "torch_openmp", False)
    assert native._threads(40 * 300) == 1  # torch.set_num_threads(1) in conftest
    torch.set_num_threads(4)
    try:
        assert native._threads(40 * 300) == 4
        threaded = LogRatioBatch(old, roll, mask)
        monkeypatch.setitem(native._state, "torch_openmp", True)
        assert native._threads(40 * 300) == 1  # PyTorch's pool is OpenMP: stay on one thread
    finally:
        torch.set_num_threads(1)
    for name in ("mask", "log_ratio", "ratio", "k3", "row_sums"):
        assert torch.equal(getattr(threaded, name), getattr(one, name)), name
