"""The correction and the loss never wait for the device, and have static shapes.

A ``TorchDispatchMode`` sees every ATen operation of the call: no ``_local_scalar_dense``
(``.item()``, ``float(t)``, ``bool(t)``), no operation whose output shape depends on the data
(``nonzero``, ``masked_select``, boolean indexing, …), and no ``Tensor.tolist``/``numpy`` (host
reads the dispatcher does not see). Reading the metrics as floats then costs exactly one host read.
Such a call can be captured in a CUDA graph and never stalls the stream.

On the CPU, where a host read costs no device sync, the pass reads each block's bounds once and
skips the work they fix (``_host_value``; ``tests/test_host_shortcuts.py`` checks that the bits are
those of the arithmetic path). On a device it reads nothing: the tests below run the device's path
(``device_path``), and ``test_the_cpu_reads_once_per_block`` counts the CPU's reads.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout_correction as rc
from rollout_correction_core._src import correction as correction_module
from rollout_correction_core._src import logratio
from rollout_correction_core._src.metrics import Metrics, metrics_to_floats
from rollout_correction import ClipRange, PolicyLoss


DYNAMIC = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
           "repeat_interleave", "masked_scatter", "argwhere"}


class Watch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.dynamic: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops += 1
        if name in ("_local_scalar_dense", "is_nonzero", "item"):
            self.syncs.append(name)
        if name in DYNAMIC or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.dynamic.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watched():
    """A Watch that also counts Tensor.tolist / Tensor.numpy as host reads."""
    watch = Watch()
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name):
        def read(self, *args, **kwargs):
            watch.syncs.append(name)
            return saved[name](self, *args, **kwargs)

        return read

    for name in saved:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with watch:
            yield watch
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


CONFIGS = {
    "metrics-only": {},
    "token TIS": {"rollout_is": "token"},
    "sequence TIS": {"rollout_is": "sequence"},
    "geometric clip": {"rollout_is": "geometric", "rollout_is_threshold": "0.8_1.2"},
    "IcePop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "batch-norm TIS": {"rollout_is": "token", "rollout_is_batch_normalize": True},
    "seq batch-norm": {"rollout_is": "sequence", "rollout_is_batch_normalize": True},
    "seq IS + seq_sum_k1": {"rollout_is": "sequence", "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
    "geometric RS": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "k3 RS + TIS": {"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "3 chained RS": {"rollout_rs": "token_k1,seq_mean_k3,seq_max_k2", "rollout_rs_threshold": "0.5_2.0,0.01,2.0"},
    "veto": {"rollout_is": "token", "rollout_token_veto_threshold": 1e-3},
    "probability gates": {"rollout_rs": "token_tv,seq_max_binary_kl", "rollout_rs_threshold": "0.1,0.05",
                          "rollout_token_veto_threshold_high": 10.0},
    "Δp bands + segment_geometric": {"rollout_is": "segment_geometric", "rollout_rs": "token_dp,seq_mean_dp,segment_sum_dp",
                                     "rollout_rs_threshold": "-0.3_0.3,-0.05_0.05,-0.5_0.5"},
    "KPop + log-prob error": {"rollout_rs": "token_kpop,seq_mean_kpop,seq_logprob_error",
                              "rollout_rs_threshold": "0.1,0.02,1.3"},
    "prefix-min IS": {"rollout_is": "prefix_min", "rollout_is_threshold": 1.5},
}


def _inputs(B=12, T=20, seed=0, bad=True):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3
    rollout = (old + 0.3 * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[1] = 0  # an empty row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if bad:
        lengths[2] = T
        mask[2] = True
        old[2, 4] = float("nan")  # a dropped row
        rollout[3, -1] = float("inf")  # non-finite padding (row 3 is shorter than T unless drawn so)
        mask[3, -1] = False
    return old, rollout, mask


@pytest.fixture(autouse=True)
def device_path(monkeypatch):
    """What a device runs: no value read by the host (``_host_value`` returns None off the CPU)."""
    monkeypatch.setattr(logratio, "_host_value", lambda x, read: None)


def test_the_cpu_reads_once_per_block(monkeypatch):
    monkeypatch.undo()  # the CPU's own path
    monkeypatch.setattr(correction_module, "BLOCK_TOKENS", 50)  # 12 rows of 20 tokens: blocks of 2 rows
    old, rollout, mask = _inputs()
    cfg = rc.RolloutCorrectionConfig.from_dict(CONFIGS["3 chained RS"])
    rc.compute_rollout_correction(old, rollout, mask, config=cfg)
    with watched() as call:
        rc.compute_rollout_correction(old, rollout, mask, config=cfg)
    # per block, in one read: the least and largest log ρ (its largest |log ρ|) and log-prob of either
    # side (engine sentinels; no probability above 0)
    assert call.syncs == ["tolist"] * 6 and call.dynamic == []


@pytest.fixture(params=[False, True], ids=["one block", "blocked"])
def blocked(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(correction_module, "BLOCK_TOKENS", 50)  # blocks of 2 rows
    return request.param


@pytest.mark.parametrize("name", list(CONFIGS))
def test_correction_has_no_sync_and_no_dynamic_shape(name, blocked):
    cfg = rc.RolloutCorrectionConfig.from_dict(CONFIGS[name])
    old, rollout, mask = _inputs()
    rc.compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats()  # lazy imports
    with watched() as call:
        out = rc.compute_rollout_correction(old, rollout, mask, config=cfg)
    assert call.syncs == [] and call.dynamic == [], (call.syncs, call.dynamic)
    with watched() as read:
        floats = out.metrics_as_floats()
    assert read.syncs == ["tolist"] and read.dynamic == []
    assert floats and all(isinstance(v, float) and math.isfinite(v) for v in floats.values())
    assert floats["rollout_corr/nonfinite_seq_fraction"] == pytest.approx(1 / 11)  # row 2 of 11 non-empty


@pytest.mark.parametrize("name", list(CONFIGS))
def test_floats_derived_on_host_equal_the_lazy_tensors(name, blocked):
    """The float64 host derivation and the on-device tensor derivation are the same formulas."""
    cfg = rc.RolloutCorrectionConfig.from_dict(CONFIGS[name])
    out = rc.compute_rollout_correction(*_inputs(seed=3), config=cfg)
    floats = out.metrics_as_floats()
    with watched() as derive:
        tensors = dict(out.metrics)
    assert derive.syncs == []  # tensors are derived on the device
    assert floats.keys() == tensors.keys()
    for k, v in tensors.items():
        assert float(v) == pytest.approx(floats[k], rel=1e-12, abs=1e-15), k


def test_blocked_and_unblocked_metrics_agree(monkeypatch):
    cfg = rc.RolloutCorrectionConfig.from_dict(CONFIGS["3 chained RS"] | {"rollout_is": "token"})
    old, rollout, mask = _inputs(seed=5)
    whole = rc.compute_rollout_correction(old, rollout, mask, config=cfg)
    monkeypatch.setattr(correction_module, "BLOCK_TOKENS", 41)  # blocks of 2 rows, the last of 2
    split = rc.compute_rollout_correction(old, rollout, mask, config=cfg)
    torch.testing.assert_close(split.weights, whole.weights)
    torch.testing.assert_close(split.response_mask, whole.response_mask)
    a, b = whole.metrics_as_floats(), split.metrics_as_floats()
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), k


LOSS_CASES = {
    "bypass PPO-clip, 3 chained RS": (True, CONFIGS["3 chained RS"] | {"bypass_mode": True, "loss_type": "ppo_clip"}),
    "bypass REINFORCE, sequence TIS": (True, {"rollout_is": "sequence", "bypass_mode": True, "loss_type": "reinforce"}),
    "decoupled token TIS": (True, {"rollout_is": "token"}),
    "decoupled, given weights": (False, {"rollout_is": "token"}),
    "rollout-IS, rejected tokens counted": (True, CONFIGS["KPop + log-prob error"] | {
        "bypass_mode": True, "loss_type": "rollout_is", "loss_denominator": "valid"}),
}


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_policy_loss_has_no_sync_and_one_read(case):
    with_rollout, settings = LOSS_CASES[case]
    cfg = rc.RolloutCorrectionConfig.from_dict(settings)
    old, rollout, mask = _inputs(seed=7)
    gen = torch.Generator().manual_seed(8)
    log_prob = (old + 0.1 * torch.randn(old.shape, generator=gen)).clamp(max=0.0).requires_grad_(True)
    adv = torch.randn(old.shape, generator=gen)
    kwargs = {"rollout_log_prob": rollout} if with_rollout else {"rollout_is_weights": torch.rand(old.shape) + 0.5}
    rc.compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
    with watched() as call:
        loss, metrics = rc.compute_policy_loss(log_prob, old, adv, mask, config=cfg, **kwargs)
    assert call.syncs == [] and call.dynamic == [], (call.syncs, call.dynamic)
    with watched() as read:
        floats = metrics_to_floats(metrics)
    assert read.syncs == ["tolist"]
    # the same values as the tensors, and the actor metrics by hand
    tensors = {k: float(v) for k, v in metrics.items()}
    assert floats.keys() == tensors.keys()
    for k in floats:
        assert floats[k] == pytest.approx(tensors[k], rel=1e-12, abs=1e-15), k
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
    assert floats["actor/nonfinite_seq_fraction"] == pytest.approx(1 / 11)


def test_actor_metrics_by_hand():
    old, rollout, mask = _inputs(seed=9, bad=False)
    gen = torch.Generator().manual_seed(10)
    log_prob = (old + 0.5 * torch.randn(old.shape, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    adv = torch.randn(old.shape, generator=gen)
    _, metrics = rc.compute_policy_loss(
        log_prob, old, adv, mask, config=rc.RolloutCorrectionConfig.disabled(),
        loss=PolicyLoss(clip=ClipRange(low=0.2, high=0.2, dual=3.0)))
    floats = metrics_to_floats(metrics)
    ratio = (log_prob - old).exp()
    clipped = (-adv * ratio.clamp(0.8, 1.2)) > (-adv * ratio)
    n = mask.sum().item()
    assert floats["actor/ppo_kl"] == pytest.approx(((old - log_prob)[mask]).double().sum().item() / n, rel=1e-9)
    assert floats["actor/pg_clipfrac"] == pytest.approx(clipped[mask].sum().item() / n, rel=1e-12)
    assert floats["actor/nonfinite_seq_fraction"] == 0.0


def test_metrics_mapping_is_lazy_and_mutable():
    cfg = rc.RolloutCorrectionConfig.from_dict(CONFIGS["token TIS"])
    out = rc.compute_rollout_correction(*_inputs(seed=11), config=cfg)
    m = out.metrics
    assert isinstance(m, Metrics)
    with watched() as listing:
        keys = list(m)
    assert listing.syncs == []  # names come from the config; listing them derives nothing
    with watched() as again:
        assert list(m) == keys
    assert again.ops == 0
    assert "rollout_corr/rollout_is_mean" in keys and "rollout_corr/kl" in keys
    m["extra/value"] = torch.tensor(2.5)
    m["extra/float"] = 1.5
    del m["rollout_corr/kl"]
    floats = m.as_floats()
    assert floats["extra/value"] == 2.5 and floats["extra/float"] == 1.5 and "rollout_corr/kl" not in floats
    assert list(floats) == list(m) and len(m) == len(keys) + 1
    combined = Metrics()
    combined.update(m)
    assert combined.as_floats() == floats
