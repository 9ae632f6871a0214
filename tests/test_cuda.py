"""On a CUDA device: the same numbers as on the CPU, the compiled path too, and no host sync.

Marked ``cuda``: where ``torch.cuda.is_available()`` is False the root conftest deselects these
tests (they are neither run nor counted as skipped). Run them with ``pytest -m cuda``.

(a) Every preset's correction, and the policy loss for every ``loss_type`` × aggregation mode
    (local and global denominators, given IS weights, plain PPO; value, gradient and metrics), on
    CUDA against the same call on the CPU, fp32 and bf16, on a batch with an empty row, a NaN at a
    valid position (the row is dropped), ±inf in padding and holes in the mask.
(b) ``compile=True`` on CUDA against the same CPU reference.
(c) Under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising CUDA call raises):
    ``compute_rollout_correction`` for every preset, eager and compiled, and
    ``compute_policy_loss`` forward and backward, including the context-parallel entry points
    over a one-rank NCCL group, make no host sync; reading the metrics afterwards may.

Tolerances. Masks, and every count-based metric, must be equal: a mask differs only if a
statistic lands within float32 rounding of a threshold, which the data below never does. Values
may differ by what differs between the devices: ``exp``/``log`` are other implementations
(CUDA's libdevice is within 2 ulp of the correctly rounded value, the CPU's ``torch.exp`` within
1 ulp), and reductions sum in another order (trees of partial sums on CUDA, sequential blocks on
the CPU; under ``compile=True`` the order inductor picks). A weight is exp of a float32
log-ratio or of a float32 sum of up to T = 300 of them: with a sum of magnitude ≲ 5 and relative
rounding ≈ √T·2⁻²⁴ per ordering, the weights differ by ≲ 2e-6 relative — checked against
``W_RTOL`` = 2e-5. Metrics are float64 combinations of float32 sums (rel 1e-4, abs 1e-5; a
standard deviation within 1e-3 of the size of the values it is the spread of, since it is a
difference of sums): the tolerances the CPU tests use between the eager and the compiled pass,
which differ in the same two ways. Each comparison prints the largest difference it saw (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import math
import socket

import pytest
import torch
import torch.distributed as dist

from typing import get_args

import rollout_correction as rc
from rollout_correction import CorrectionOutput, RolloutCorrectionConfig, metrics_to_floats
from rollout_correction_core._src.config import _BYPASS_ONLY_LOSSES, RS_OPTIONS, IsLevel, LossType
from rollout_correction import Parallel

pytestmark = pytest.mark.cuda

PRESETS = RolloutCorrectionConfig.preset_names()
LOSS_TYPES = list(get_args(LossType))
BYPASS_ONLY = set(_BYPASS_ONLY_LOSSES) | {"reinforce"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
W_RTOL = 2e-5
METRIC_REL, METRIC_ABS, STD_SCALE = 1e-4, 1e-5, 1e-3
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 2e-5, 2e-5, 1e-7
#: The configurations of benchmarks/bench_gpu.py (compiled here on the benchmark's own shapes,
#: so a run of both shares inductor's on-disk cache).
COMPILED = {
    "metrics-only": {},
    "token TIS": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "seq IS + RS": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
                    "rollout_rs_threshold": "0.5_2.0"},
    "geo RS + token TIS": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k1",
                           "rollout_rs_threshold": "0.999_1.001"},
    "3 chained RS": {"rollout_rs": "token_k1,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.01,2.0"},
}


def cuda():
    return torch.device("cuda")


def make_batch(B=24, T=300, dtype=torch.float32, mask_dtype=torch.bool, seed=0, noise=0.1):
    """CPU tensors: log-probs in [−3, 0], a rollout engine off by N(0, noise²), right padding,
    an empty row, a full row, a hole, a NaN at a valid position, ±inf and NaN in padding."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3
    rollout = (old + noise * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(T // 4, T + 1, (B,), generator=gen)
    lengths[1], lengths[2] = 0, T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[3, 5:9] = False
    old[2, 7] = float("nan")
    pad = ~mask
    old = torch.where(pad & (torch.arange(T) % 3 == 0), torch.full_like(old, float("nan")), old)
    rollout = torch.where(pad & (torch.arange(T) % 3 == 1), torch.full_like(old, -float("inf")), rollout)
    return old.to(dtype), rollout.to(dtype), mask.to(mask_dtype)


def to_cuda(*tensors):
    return tuple(t.to(cuda()) if isinstance(t, torch.Tensor) else t for t in tensors)


def _std_tol(name: str, ref: dict) -> float:
    if not name.endswith("std"):
        return METRIC_ABS
    family = [abs(ref[name[:-3] + s]) for s in ("mean", "max", "min") if name[:-3] + s in ref]
    return max([METRIC_ABS] + [STD_SCALE * v for v in family])


def assert_close_metrics(got: dict, ref: dict, tag: str) -> float:
    """Same names, every value within tolerance; returns the largest relative difference."""
    assert got.keys() == ref.keys(), (tag, sorted(set(got) ^ set(ref)))
    worst = 0.0
    for k, v in ref.items():
        assert math.isfinite(got[k]), (tag, k, got[k])
        assert got[k] == pytest.approx(v, rel=METRIC_REL, abs=_std_tol(k, ref)), (tag, k, got[k], v)
        worst = max(worst, abs(got[k] - v) / max(abs(v), 1e-30) if abs(got[k] - v) > 1e-12 else 0.0)
    return worst


def assert_same_as_cpu(got: CorrectionOutput, ref: CorrectionOutput, tag: str) -> None:
    assert got.response_mask.device.type == cuda().type
    assert got.response_mask.dtype == ref.response_mask.dtype, tag
    assert torch.equal(got.response_mask.cpu(), ref.response_mask), tag
    w_rel = 0.0
    if ref.weights is None:
        assert got.weights is None, tag
    else:
        assert got.weights.device.type == cuda().type and got.weights.dtype == ref.weights.dtype, tag
        w = got.weights.cpu()
        torch.testing.assert_close(w, ref.weights, rtol=W_RTOL, atol=0, msg=lambda m: f"{tag}: {m}")
        w_rel = float(((w - ref.weights).abs() / ref.weights.abs().clamp_min(1e-30)).max())
    m_rel = assert_close_metrics(got.metrics_as_floats(), ref.metrics_as_floats(), tag)
    print(f"[cuda vs cpu] {tag}: max rel. weight diff {w_rel:.2e}, max rel. metric diff {m_rel:.2e}")


# -------------------------------------------------------------------------------- (a) numerics


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", PRESETS)
def test_correction_matches_cpu(name, dtype):
    cfg = RolloutCorrectionConfig.from_preset(name)
    batch = make_batch(dtype=DTYPES[dtype], mask_dtype=torch.bool if dtype == "fp32" else torch.float32)
    ref = rc.compute_rollout_correction(*batch, config=cfg)
    got = rc.compute_rollout_correction(*to_cuda(*batch), config=cfg)
    assert_same_as_cpu(got, ref, f"{name} {dtype}")


def test_offpolicy_metrics_match_cpu():
    batch = make_batch()
    ref = metrics_to_floats(rc.compute_offpolicy_metrics(*batch))
    got = metrics_to_floats(rc.compute_offpolicy_metrics(*to_cuda(*batch)))
    assert_close_metrics(got, ref, "offpolicy metrics")


def loss_inputs(dtype=torch.float32, seed=1):
    old, rollout, mask = make_batch(dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    log_prob = ((old.float().nan_to_num(-1.0) + 0.1 * torch.randn(old.shape, generator=gen)).to(dtype)).clamp(max=0.0)
    adv = torch.randn(old.shape[0], 1, generator=gen).expand(old.shape).contiguous()
    weights = (torch.rand(old.shape, generator=gen) + 0.5)
    return log_prob, old, rollout, adv, mask, weights


def run_loss(inputs, device, cfg, *, given_weights=False, with_rollout=True, loss_agg_mode="token-mean",
             sequence_group=None, **counts):
    log_prob, old, rollout, adv, mask, weights = (t.to(device) for t in inputs)
    log_prob = log_prob.detach().requires_grad_(True)
    extra = {"rollout_is_weights": weights} if given_weights else {}
    if with_rollout:
        extra["rollout_log_prob"] = rollout
    loss, metrics = rc.compute_policy_loss(log_prob, old, adv, mask, config=cfg, **extra,
                                           loss=rc.PolicyLoss(aggregation=rc.Aggregation(loss_agg_mode, **counts)),
                                           parallel=rc.Parallel(cp_group=sequence_group))
    loss.backward()
    return loss, log_prob.grad, metrics


def assert_loss_matches_cpu(cfg, tag, inputs, **kwargs):
    loss_ref, grad_ref, m_ref = run_loss(inputs, "cpu", cfg, **kwargs)
    loss, grad, m = run_loss(inputs, cuda(), cfg, **kwargs)
    assert loss.device.type == cuda().type and grad.device.type == cuda().type
    torch.testing.assert_close(loss.cpu(), loss_ref, rtol=LOSS_RTOL, atol=GRAD_ATOL, msg=lambda s: f"{tag}: {s}")
    torch.testing.assert_close(grad.cpu(), grad_ref, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda s: f"{tag}: {s}")
    m_rel = assert_close_metrics(metrics_to_floats(m), metrics_to_floats(m_ref), tag)
    g_diff = float((grad.cpu() - grad_ref).abs().max())
    print(f"[cuda vs cpu] loss {tag}: rel. loss diff {abs(loss.item() - loss_ref.item()) / max(abs(loss_ref.item()), 1e-30):.2e}, "
          f"max |grad diff| {g_diff:.2e}, max rel. metric diff {m_rel:.2e}")


GLOBALS = {"local": {}, "global": {"global_num_tokens": 20000, "global_num_seqs": 90, "dp_size": 4}}


@pytest.mark.parametrize("denominators", list(GLOBALS))
@pytest.mark.parametrize("agg", rc.LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_matches_cpu(loss_type, agg, denominators):
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": "sequence" if loss_type in BYPASS_ONLY else "token",
                                             "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01,
                                             "loss_type": loss_type, "bypass_mode": loss_type in BYPASS_ONLY})
    assert_loss_matches_cpu(cfg, f"{loss_type} {agg} {denominators}", loss_inputs(), loss_agg_mode=agg,
                            **GLOBALS[denominators])


@pytest.mark.parametrize("case", ["given weights", "plain PPO", "bypass PPO-clip bf16", "pure IS bf16"])
def test_policy_loss_other_paths_match_cpu(case):
    if case == "given weights":
        assert_loss_matches_cpu(RolloutCorrectionConfig.decoupled_token_is(), case, loss_inputs(), given_weights=True,
                                with_rollout=False)
    elif case == "plain PPO":
        assert_loss_matches_cpu(None, case, loss_inputs(), with_rollout=False)
    elif case == "bypass PPO-clip bf16":
        assert_loss_matches_cpu(RolloutCorrectionConfig.from_preset("bypass_ppo_clip_k3_rs"), case,
                                loss_inputs(torch.bfloat16))
    else:
        assert_loss_matches_cpu(RolloutCorrectionConfig.from_preset("pure_is"), case, loss_inputs(torch.bfloat16))


# ---------------------------------------------------------------------------------- (b) compile

BENCH_SHAPE = (256, 4096)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_matches_cpu(name, dtype):
    cfg = RolloutCorrectionConfig.from_dict(COMPILED[name])
    batch = make_batch(*BENCH_SHAPE, dtype=DTYPES[dtype], mask_dtype=torch.float32, noise=0.05)
    ref = rc.compute_rollout_correction(*batch, config=cfg)
    got = rc.compute_rollout_correction(*to_cuda(*batch), config=cfg, compile=True)
    assert_same_as_cpu(got, ref, f"compiled {name} {dtype}")


# ------------------------------------------------------------------------------------ (c) syncs


@contextlib.contextmanager
def sync_error():
    """Any synchronising CUDA call inside raises RuntimeError."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_debug_mode_catches_a_host_read():
    x = torch.ones(3, device=cuda())
    with pytest.raises(RuntimeError, match="synchroniz"), sync_error():
        x.sum().item()


@pytest.mark.parametrize("name", PRESETS)
def test_correction_does_not_sync(name):
    cfg = RolloutCorrectionConfig.from_preset(name)
    batch = to_cuda(*make_batch(dtype=torch.bfloat16, mask_dtype=torch.float32))
    rc.compute_rollout_correction(*batch, config=cfg).metrics_as_floats()  # lazy imports and initialisation
    with sync_error():
        out = rc.compute_rollout_correction(*batch, config=cfg)
        tensors = dict(out.metrics)  # derived on the device
    assert tensors and math.isfinite(out.metrics_as_floats()["rollout_corr/kl"])


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_correction_does_not_sync(name):
    cfg = RolloutCorrectionConfig.from_dict(COMPILED[name])
    batch = to_cuda(*make_batch(*BENCH_SHAPE, mask_dtype=torch.float32, noise=0.05))
    rc.compute_rollout_correction(*batch, config=cfg, compile=True).metrics_as_floats()  # compiles
    with sync_error():
        out = rc.compute_rollout_correction(*batch, config=cfg, compile=True)
        dict(out.metrics)
    assert out.metrics_as_floats()


@pytest.mark.parametrize("denominators", list(GLOBALS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_does_not_sync(loss_type, denominators):
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": "token", "rollout_rs": "token_k1,seq_mean_k3",
                                             "rollout_rs_threshold": "0.5_2.0,0.01", "loss_type": loss_type,
                                             "bypass_mode": loss_type in BYPASS_ONLY})
    inputs = to_cuda(*loss_inputs(torch.bfloat16))  # (outside the check: a host-to-device copy syncs)
    run_loss(inputs, cuda(), cfg, loss_agg_mode="seq-mean-token-mean", **GLOBALS[denominators])  # warm-up
    with sync_error():
        loss, grad, metrics = run_loss(inputs, cuda(), cfg, loss_agg_mode="seq-mean-token-mean",
                                       **GLOBALS[denominators])
        dict(metrics)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all())
    assert metrics_to_floats(metrics)


@pytest.mark.parametrize("name", ["decoupled_token_is_opsm", "decoupled_token_is_m2po"])
def test_policy_loss_with_opsm_or_m2po_does_not_sync(name):
    cfg = RolloutCorrectionConfig.from_preset(name)
    inputs = to_cuda(*loss_inputs())
    run_loss(inputs, cuda(), cfg)
    with sync_error():
        loss, grad, metrics = run_loss(inputs, cuda(), cfg)
    assert math.isfinite(loss.item()) and metrics_to_floats(metrics)


# ------------------------------------------------------------------- context parallel, one rank


@pytest.fixture(scope="module")
def nccl_group():
    """A one-rank NCCL world: the context-parallel code runs its collect pass, its real all-gather
    and its replay pass; with one rank every sequence is whole, so results equal the plain call."""
    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cuda().type == "cuda":
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:  # (a dry run of this module on the CPU)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["decoupled_seq_is_rs", "decoupled_geo_rs_token_tis", "bypass_pg_geo_rs_seq_tis",
                                  "decoupled_k3_rs_token_tis"])
def test_context_parallel_matches_and_does_not_sync(name, nccl_group):
    cfg = RolloutCorrectionConfig.from_preset(name)
    batch = to_cuda(*make_batch(mask_dtype=torch.float32))
    ref = rc.compute_rollout_correction(*batch, config=cfg)
    rc.compute_rollout_correction(*batch, config=cfg, parallel=Parallel(cp_group=nccl_group)).metrics_as_floats()  # communicator
    with sync_error():
        got = rc.compute_rollout_correction(*batch, config=cfg, parallel=Parallel(cp_group=nccl_group))
        dict(got.metrics)
    assert torch.equal(got.response_mask, ref.response_mask)
    if ref.weights is not None:
        torch.testing.assert_close(got.weights, ref.weights, rtol=W_RTOL, atol=0)
    assert_close_metrics(got.metrics_as_floats(), ref.metrics_as_floats(), f"cp {name}")


@pytest.mark.parametrize("case", ["bypass_pg_geo_rs_token_tis", "decoupled_gspo_geo_is", "bypass_topr", "given weights"])
def test_context_parallel_loss_matches_and_does_not_sync(case, nccl_group):
    given = case == "given weights"
    cfg = RolloutCorrectionConfig.decoupled_token_is() if given else RolloutCorrectionConfig.from_preset(case)
    inputs = to_cuda(*loss_inputs())
    kwargs = {"given_weights": given, "with_rollout": not given, "loss_agg_mode": "seq-mean-token-mean"}
    loss_ref, grad_ref, m_ref = run_loss(inputs, cuda(), cfg, **kwargs)
    run_loss(inputs, cuda(), cfg, sequence_group=nccl_group, **kwargs)
    with sync_error():
        loss, grad, metrics = run_loss(inputs, cuda(), cfg, sequence_group=nccl_group, **kwargs)
        dict(metrics)
    torch.testing.assert_close(loss, loss_ref, rtol=LOSS_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(grad, grad_ref, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert_close_metrics(metrics_to_floats(metrics), metrics_to_floats(m_ref), f"cp loss {case}")


# ------------------------------------------------ every rejection option, IS level and denominator

#: Thresholds tried in turn for an option; the first one its configuration accepts is used (a bound,
#: a ratio band, a signed band, a bound above 1 — each option reads one of them).
_THRESHOLDS = (0.05, "0.5_2.0", "-0.2_0.2", 2.0)


def _config_with(base: dict, key: str, value: str, threshold_key: str) -> RolloutCorrectionConfig:
    errors = []
    for threshold in _THRESHOLDS:
        try:
            return RolloutCorrectionConfig.from_dict({**base, key: value, threshold_key: threshold})
        except ValueError as exc:  # ConfigError is a ValueError
            errors.append(str(exc))
    raise AssertionError(f"no threshold accepted for {value}: {errors}")


def _segments(mask: torch.Tensor) -> dict:
    """Segment ids 0, 1, … in runs of 40 positions (the last run of a row may be short); padding 0."""
    T = mask.shape[1]
    ids = (torch.arange(T) // 40).expand(mask.shape).clone()
    ids[~mask.bool()] = 0
    return {"segments": rc.Segments(ids, count=(T + 39) // 40)}


def _check_cuda_against_cpu(cfg, tag, *, segments: bool, process_group=None):
    batch = make_batch(mask_dtype=torch.float32)
    seg = _segments(batch[2]) if segments else {}
    ref = rc.compute_rollout_correction(*batch, config=cfg, **seg)
    dev = to_cuda(*batch)
    dev_seg = {k: rc.Segments(v.ids.to(cuda()), count=v.count) for k, v in seg.items()}
    got = rc.compute_rollout_correction(
        *dev, config=cfg, **dev_seg, parallel=Parallel(dp_group=process_group))
    assert_same_as_cpu(got, ref, tag)
    with sync_error():  # the first call agreed on the layout (and may have read the host); this one may not
        again = rc.compute_rollout_correction(
            *dev, config=cfg, **dev_seg, parallel=Parallel(dp_group=process_group))
        dict(again.metrics)
    assert torch.equal(again.response_mask, got.response_mask)


@pytest.mark.parametrize("option", sorted(RS_OPTIONS))
def test_every_rejection_option_matches_cpu_and_does_not_sync(option):
    cfg = _config_with({"rollout_is": "token", "rollout_is_threshold": 2.0}, "rollout_rs", option,
                       "rollout_rs_threshold")
    _check_cuda_against_cpu(cfg, f"rs {option}", segments=option.startswith("segment"))


@pytest.mark.parametrize("level", list(get_args(IsLevel)))
def test_every_is_level_matches_cpu_and_does_not_sync(level):
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": level, "rollout_is_threshold": 2.0})
    _check_cuda_against_cpu(cfg, f"is {level}", segments=level.startswith("segment"))


@pytest.mark.parametrize("name", ["decoupled_seq_is_rs", "decoupled_token_is", "bypass_pg_geo_rs_seq_tis"])
def test_data_parallel_group_agrees_once_then_does_not_sync(name, nccl_group):
    """With a data-parallel group the first call of a layout agrees on it over the group (one
    all-reduce and one host read); later calls add no collective that reads the host."""
    _check_cuda_against_cpu(RolloutCorrectionConfig.from_preset(name), f"dp {name}", segments=False,
                            process_group=nccl_group)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_valid_loss_denominator_matches_cpu(loss_type):
    cfg = RolloutCorrectionConfig.from_dict({"rollout_is": "sequence" if loss_type in BYPASS_ONLY else "token",
                                             "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01,
                                             "loss_type": loss_type, "bypass_mode": loss_type in BYPASS_ONLY,
                                             "loss_denominator": "valid"})
    assert_loss_matches_cpu(cfg, f"{loss_type} valid", loss_inputs(), loss_agg_mode="token-mean")
