"""The correction and the losses run on the ``meta`` device: no stray device, no host read.

A meta tensor has a shape and a dtype but no data, so every operation that needs a value on the
host raises (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, data-dependent Python
branching, operations whose output shape depends on the data), and so does mixing in a tensor
created without ``device=`` (it lands on the CPU). A call that completes on meta inputs therefore
creates every tensor on its inputs' device and reads nothing back — what a GPU trainer needs —
and its outputs must come back on meta with the shapes and dtypes of a real call.

Covered, through the public API only (``rollout_correction`` names, presets by name):

* ``compute_rollout_correction`` for every preset (fp32 and bf16 log-probs, bool and float
  masks), with a ``process_group``, and ``compute_offpolicy_metrics``; the metric names equal a
  CPU call's;
* ``compute_policy_loss`` for every preset, every ``loss_type`` × aggregation mode with local
  and global denominators (Python numbers and meta tensors), decoupled with given IS weights,
  plain PPO, backward included; ``agg_loss`` in every mode;
* the context-parallel entry points (``sequence_group=``) — the collect pass, the exchange and
  the replay pass — over a world of two ranks of PyTorch's ``fake`` process-group backend, whose
  collectives accept meta tensors and move no data (values are meaningless, shapes and devices
  are real), with and without a data-parallel ``process_group``.
* segment ids (``segment_ids=`` on the device): segment IS and the ``segment_*`` options in the
  correction and the loss, on whole and on split rows.

Metrics are read as tensors only (``dict(metrics)`` derives them lazily); reading them as floats
is the one sync by design and cannot run on meta. ``compile=True`` is not covered (inductor
generates no code for meta tensors); the compiled path is checked on CUDA in ``test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rollout_correction as rc
from rollout_correction import RolloutCorrectionConfig
from rollout_correction import Aggregation, Parallel, PolicyLoss, Segments

META = torch.device("meta")
B, T = 5, 12
PRESETS = RolloutCorrectionConfig.preset_names()
LOSS_TYPES = ["ppo_clip", "reinforce", "gspo", "cispo", "dppo_tv", "dppo_kl", "topr", "rollout_is"]
BYPASS_ONLY = {"reinforce", "topr", "rollout_is"}  # REINFORCE is the bypass (pure IS) loss; TOPR is bypass-only


def meta(dtype=torch.float32, shape=(B, T), requires_grad=False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META, requires_grad=requires_grad)


def cpu_batch(dtype=torch.float32, mask_dtype=torch.bool, shape=(B, T)):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(shape, generator=gen) * 3
    rollout = (old + 0.2 * torch.randn(shape, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(shape, generator=gen) < 0.8
    return old.to(dtype), rollout.to(dtype), mask.to(mask_dtype)


def assert_meta(t: torch.Tensor, shape, dtype) -> None:
    assert t.device == META, t.device
    assert tuple(t.shape) == tuple(shape), (tuple(t.shape), shape)
    assert t.dtype == dtype, (t.dtype, dtype)


def assert_meta_metrics(metrics, prefixes=("rollout_corr/",)) -> dict:
    tensors = dict(metrics)  # derives every metric tensor (lazily, on the device)
    assert tensors
    for name, value in tensors.items():
        assert name.startswith(prefixes), name
        assert isinstance(value, torch.Tensor) and value.device == META and value.dim() == 0, name
    return tensors


def preset(name: str, **overrides) -> RolloutCorrectionConfig:
    cfg = RolloutCorrectionConfig.from_preset(name)
    return RolloutCorrectionConfig.from_dict(cfg.to_dict() | overrides) if overrides else cfg


# ------------------------------------------------------------------------------------ correction


@pytest.mark.parametrize("dtype,mask_dtype", [(torch.float32, torch.bool), (torch.bfloat16, torch.float32)],
                         ids=["fp32-bool", "bf16-float"])
@pytest.mark.parametrize("name", PRESETS)
def test_correction_every_preset(name, dtype, mask_dtype):
    cfg = preset(name)
    out = rc.compute_rollout_correction(meta(dtype), meta(dtype), meta(mask_dtype), config=cfg)
    if cfg.rollout_is is None:
        assert out.weights is None
    else:
        assert_meta(out.weights, (B, T), torch.float32)
    assert_meta(out.response_mask, (B, T), mask_dtype)
    names = assert_meta_metrics(out.metrics).keys()
    cpu = rc.compute_rollout_correction(*cpu_batch(dtype, mask_dtype), config=cfg)
    assert names == dict(cpu.metrics).keys()


@pytest.mark.parametrize("name", ["decoupled_seq_is_rs", "decoupled_token_is_m2po", "bypass_pg_geo_rs_token_tis"])
def test_correction_with_process_group(name, fake_world):
    cfg = preset(name, rollout_is_batch_normalize=True) if preset(name).rollout_is else preset(name)
    out = rc.compute_rollout_correction(
        meta(), meta(), meta(torch.bool), config=cfg, parallel=Parallel(dp_group=fake_world))
    assert_meta(out.response_mask, (B, T), torch.bool)
    assert_meta_metrics(out.metrics)


def test_offpolicy_metrics():
    metrics = rc.compute_offpolicy_metrics(meta(torch.bfloat16), meta(torch.bfloat16), meta(torch.bool))
    names = assert_meta_metrics(metrics).keys()
    assert names == rc.compute_offpolicy_metrics(*cpu_batch()).keys()


# ------------------------------------------------------------------------------------------ losses


def _check_loss(loss, metrics, log_prob) -> None:
    assert_meta(loss, (), torch.float32)
    assert_meta_metrics(metrics, prefixes=("rollout_corr/", "actor/"))
    loss.backward()
    assert_meta(log_prob.grad, log_prob.shape, log_prob.dtype)


@pytest.mark.parametrize("name", PRESETS)
def test_policy_loss_every_preset(name):
    log_prob = meta(requires_grad=True)
    loss, metrics = rc.compute_policy_loss(log_prob, meta(), meta(), meta(torch.bool), config=preset(name),
                                           rollout_log_prob=meta())
    _check_loss(loss, metrics, log_prob)


GLOBALS = {
    "local": {},
    "global numbers": {"global_num_tokens": 1000, "global_num_seqs": 40, "dp_size": 4},
    "global tensors": {"global_num_tokens": torch.empty((), device=META),
                       "global_num_seqs": torch.empty((), dtype=torch.long, device=META), "dp_size": 4},
}


@pytest.mark.parametrize("denominators", list(GLOBALS))
@pytest.mark.parametrize("agg", rc.LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_types_and_aggregations(loss_type, agg, denominators):
    settings = {"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01,
                "loss_type": loss_type, "bypass_mode": loss_type in BYPASS_ONLY}
    log_prob = meta(torch.bfloat16, requires_grad=True)
    loss, metrics = rc.compute_policy_loss(
        log_prob, meta(torch.bfloat16), meta(), meta(torch.float32),
        config=RolloutCorrectionConfig.from_dict(settings), rollout_log_prob=meta(torch.bfloat16),
        loss=PolicyLoss(aggregation=Aggregation(agg, **GLOBALS[denominators])))
    _check_loss(loss, metrics, log_prob)


@pytest.mark.parametrize("case", ["given weights", "plain PPO", "bypass, old_log_prob is rollout"])
def test_policy_loss_other_inputs(case):
    log_prob = meta(requires_grad=True)
    if case == "given weights":  # decoupled, the trainer computed the weights earlier
        loss, metrics = rc.compute_policy_loss(log_prob, meta(), meta(), meta(torch.bool), config=preset("decoupled_token_is"),
                                               rollout_is_weights=meta())
    elif case == "plain PPO":
        loss, metrics = rc.compute_policy_loss(log_prob, meta(), meta(), meta(torch.bool), config=None)
    else:
        loss, metrics = rc.compute_policy_loss(log_prob, meta(), meta(), meta(torch.bool), config=preset("bypass_pg_is"))
    _check_loss(loss, metrics, log_prob)


@pytest.mark.parametrize("agg", rc.LOSS_AGG_MODES)
def test_agg_loss(agg):
    loss_mat = meta(requires_grad=True)
    loss = rc.agg_loss(loss_mat, meta(torch.bool), aggregation=Aggregation(agg))
    assert_meta(loss, (), torch.float32)
    loss.backward()
    assert_meta(loss_mat.grad, (B, T), torch.float32)


# -------------------------------------------------------------------------------- context parallel


@pytest.fixture(scope="module")
def fake_world():
    """A two-rank world of PyTorch's ``fake`` backend (this process is rank 0): collectives accept
    any tensor, meta included, and communicate nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# OPSM and M2PO need whole sequences in compute_policy_loss (documented ValueError).
CP_LOSS_PRESETS = [n for n in PRESETS if preset(n).rollout_opsm_delta is None and preset(n).rollout_m2po_threshold is None]
T_LOCAL = 7  # this rank's slice of every sequence


@pytest.mark.parametrize("with_dp", [False, True], ids=["cp only", "cp + dp group"])
@pytest.mark.parametrize("name", PRESETS)
def test_context_parallel_correction(name, with_dp, fake_world):
    cfg = preset(name)
    out = rc.compute_rollout_correction(
        meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.float32, (B, T_LOCAL)), config=cfg,
        parallel=Parallel(dp_group=fake_world if with_dp else None, cp_group=fake_world))
    if cfg.rollout_is is not None:
        assert_meta(out.weights, (B, T_LOCAL), torch.float32)
    assert_meta(out.response_mask, (B, T_LOCAL), torch.float32)
    assert_meta_metrics(out.metrics)


@pytest.mark.parametrize("name", CP_LOSS_PRESETS)
def test_context_parallel_loss_every_preset(name, fake_world):
    log_prob = meta(shape=(B, T_LOCAL), requires_grad=True)
    loss, metrics = rc.compute_policy_loss(
        log_prob, meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.bool, (B, T_LOCAL)),
        config=preset(name), rollout_log_prob=meta(shape=(B, T_LOCAL)),
        parallel=Parallel(cp_group=fake_world))
    _check_loss(loss, metrics, log_prob)


@pytest.mark.parametrize("agg", rc.LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_context_parallel_loss_types_and_aggregations(loss_type, agg, fake_world):
    settings = {"rollout_is": "sequence", "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,2.0",
                "loss_type": loss_type, "bypass_mode": loss_type in BYPASS_ONLY}
    log_prob = meta(shape=(B, T_LOCAL), requires_grad=True)
    loss, metrics = rc.compute_policy_loss(
        log_prob, meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.bool, (B, T_LOCAL)),
        config=RolloutCorrectionConfig.from_dict(settings), rollout_log_prob=meta(shape=(B, T_LOCAL)),
        parallel=Parallel(dp_group=fake_world, cp_group=fake_world),
        loss=PolicyLoss(
            aggregation=Aggregation(
                agg, global_num_tokens=1000, global_num_seqs=40, dp_size=2, scale_factor=float(T))))
    _check_loss(loss, metrics, log_prob)


def test_context_parallel_loss_given_weights(fake_world):
    log_prob = meta(shape=(B, T_LOCAL), requires_grad=True)
    loss, metrics = rc.compute_policy_loss(
        log_prob, meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.bool, (B, T_LOCAL)),
        config=preset("decoupled_token_is"), rollout_is_weights=meta(shape=(B, T_LOCAL)),
        parallel=Parallel(cp_group=fake_world))
    _check_loss(loss, metrics, log_prob)


@pytest.mark.parametrize("agg", rc.LOSS_AGG_MODES)
def test_context_parallel_agg_loss(agg, fake_world):
    loss_mat = meta(shape=(B, T_LOCAL), requires_grad=True)
    loss = rc.agg_loss(
        loss_mat, meta(torch.bool, (B, T_LOCAL)), parallel=Parallel(cp_group=fake_world),
        aggregation=Aggregation(agg, scale_factor=float(T)))
    assert_meta(loss, (), torch.float32)
    loss.backward()
    assert_meta(loss_mat.grad, (B, T_LOCAL), torch.float32)


def test_context_parallel_offpolicy_metrics(fake_world):
    metrics = rc.compute_offpolicy_metrics(
        meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.bool, (B, T_LOCAL)),
        parallel=Parallel(cp_group=fake_world))
    assert_meta_metrics(metrics)


# ------------------------------------------------------------------------------------- segments

SEGMENT_SETTINGS = {"rollout_is": "segment", "rollout_is_threshold": "0.5_2.0", "rollout_is_batch_normalize": True,
                    "rollout_rs": "token_k1,segment_sum_k1,segment_mean_k3,segment_max_tv",
                    "rollout_rs_threshold": "0.5_2.0,0.5_2.0,0.01,0.2"}


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_segments_correction_and_loss(ids_dtype, fake_world):
    """Segment ids on the device: the (B, S) scatter and gather read nothing back (the value check
    of the ids runs on CPU tensors only); whole rows, with a process group, and split rows."""
    cfg = RolloutCorrectionConfig.from_dict(SEGMENT_SETTINGS)
    ids = meta(ids_dtype)
    out = rc.compute_rollout_correction(
        meta(), meta(), meta(torch.bool), config=cfg, parallel=Parallel(dp_group=fake_world),
        segments=Segments(ids, count=4))
    assert_meta(out.weights, (B, T), torch.float32)
    names = assert_meta_metrics(out.metrics).keys()
    old, rollout, mask = cpu_batch()
    cpu_ids = torch.arange(T).div(3, rounding_mode="floor").expand(B, T)
    cpu = rc.compute_rollout_correction(old, rollout, mask, config=cfg, segments=Segments(cpu_ids))
    assert names == dict(cpu.metrics).keys()
    split = rc.compute_rollout_correction(
        meta(shape=(B, T_LOCAL)), meta(shape=(B, T_LOCAL)), meta(torch.float32, (B, T_LOCAL)), config=cfg,
        parallel=Parallel(dp_group=fake_world, cp_group=fake_world),
        segments=Segments(meta(ids_dtype, (B, T_LOCAL)), count=4))
    assert_meta(split.response_mask, (B, T_LOCAL), torch.float32)
    assert_meta_metrics(split.metrics)
    bypass = RolloutCorrectionConfig.from_dict(SEGMENT_SETTINGS | {"bypass_mode": True, "loss_type": "reinforce"})
    for shape, group in (((B, T), None), ((B, T_LOCAL), fake_world)):
        log_prob = meta(shape=shape, requires_grad=True)
        loss, metrics = rc.compute_policy_loss(
            log_prob, None, meta(shape=shape), meta(torch.bool, shape), config=bypass,
            rollout_log_prob=meta(shape=shape), parallel=Parallel(cp_group=group),
            segments=Segments(meta(ids_dtype, shape), count=4),
            loss=PolicyLoss(aggregation=Aggregation("seq-mean-token-mean")))
        _check_loss(loss, metrics, log_prob)
