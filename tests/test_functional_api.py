"""The functional API: the core's pure functions of tensors compose to exactly what the config-driven
entry points compute on every preset; no public callable of the core takes more than 10 parameters;
the 0.2 keyword forms still work in the toolkit, with a DeprecationWarning naming the new form."""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import pytest
import torch

import rollout_correction
import rollout_correction_core as core
from rollout_correction_core import (Aggregation, ClipRange, Parallel, PolicyLoss, RolloutCorrectionConfig, Segments,
                                     agg_loss, compute_offpolicy_metrics, compute_policy_loss,
                                     compute_rollout_correction, is_weights, log_ratio, policy_loss_term,
                                     rejection_mask)
from rollout_correction_core import primitives, reductions, vocabulary
from rollout_correction_core.vocabulary import PRESETS

B, T = 12, 9


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3 - 0.05
    rollout = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[3] = False  # an empty row
    return old, rollout, mask


def _callables():
    for module in (core, primitives, reductions, vocabulary):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj):
                # a dataclass's constructor is its record of named fields; an exception takes a message
                if not dataclasses.is_dataclass(obj) and not issubclass(obj, BaseException):
                    yield f"{module.__name__}.{name}", obj
                for attr, member in vars(obj).items():
                    if attr.startswith("_") or not callable(getattr(obj, attr, None)):
                        continue
                    fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                    if inspect.isfunction(fn):
                        yield f"{module.__name__}.{name}.{attr}", fn


def test_no_public_callable_of_the_core_takes_more_than_ten_parameters():
    seen, wide = 0, []
    for name, fn in _callables():
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
        seen += 1
        if len(params) > 10:
            wide.append(f"{name}: {len(params)}")
    assert seen > 100  # the walk reached the root and the three seams
    assert not wide, wide


def _composed(old, rollout, mask, cfg: RolloutCorrectionConfig):
    """(weights, keep) from the functional pieces, as the config resolves them."""
    spec = cfg.is_spec
    weights = None if spec is None else is_weights(old, rollout, mask, spec.level, spec.mode, spec.upper, spec.lower)
    keep = mask.float()
    if cfg.rs_options and cfg.rollout_rs_threshold_lower is None:
        threshold = cfg.rollout_rs_threshold
        if cfg.rollout_rs_threshold_lower is not None:  # verl's first-generation lower bound: the band [lo, hi]
            threshold = vocabulary.Band(cfg.rollout_rs_threshold_lower, threshold)
        keep = rejection_mask(old, rollout, mask, cfg.rollout_rs, threshold)
    if cfg.rollout_token_veto_threshold is not None:  # a row with one token's ρ below C leaves the loss
        vetoed = ((old - rollout < math.log(cfg.rollout_token_veto_threshold)) & mask).any(-1, keepdim=True)
        keep = keep * ~vetoed
    return weights, keep


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_functional_pieces_compose_to_the_config_path_on_every_preset(name):
    old, rollout, mask = _inputs()
    cfg = RolloutCorrectionConfig.from_preset(name)
    out = compute_rollout_correction(old, rollout, mask, config=cfg)
    weights, keep = _composed(old, rollout, mask, cfg)
    if weights is None:
        assert out.weights is None
    else:
        assert torch.equal(out.weights, weights)
    # M2PO thresholds the batch as a whole, and verl's first-generation lower ratio bound
    # (rollout_rs_threshold_lower) has no rejection_mask form: the config path only
    if cfg.rollout_m2po_threshold is None and cfg.rollout_rs_threshold_lower is None:
        assert torch.equal(out.response_mask.float(), keep)
    metrics = out.metrics_as_floats()
    for key, value in rollout_correction.metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask)).items():
        assert metrics[key] == value, key


def test_log_ratio_is_the_clamped_difference_on_valid_tokens():
    old, rollout, mask = _inputs()
    old[0, 0], rollout[0, 0] = -1.0, -41.0  # a log-ratio of 40: clamped to +20
    expected = torch.where(mask, (old - rollout).clamp(-20, 20), 0.0)
    assert torch.equal(log_ratio(old, rollout, mask), expected)
    old[1, 0] = 0.5  # no probability: its row is 0, as a non-finite one's
    assert torch.equal(log_ratio(old, rollout, mask)[1], torch.zeros_like(old[1]))
    with pytest.raises(ValueError, match="shape"):
        log_ratio(old, rollout[:, :4], mask)


def test_is_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    rollout = torch.tensor([[-0.5, -1.0, -1.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tok = is_weights(old, rollout, mask, "token", "truncate", 2.0)
    assert torch.allclose(tok, torch.tensor([[math.exp(0.5), 1.0, math.exp(-1.0)], [1.0, 2.0, 0.0]]))
    seq = is_weights(old, rollout, mask, "sequence", "truncate", 2.0)  # ρ = e^{-0.5} and e^{1} → 2
    assert torch.allclose(seq, torch.tensor([[math.exp(-0.5)] * 3, [2.0, 2.0, 0.0]]))
    ids = torch.tensor([[0, 0, 1], [0, 1, 0]])
    seg = is_weights(old, rollout, mask, "segment", "truncate", 10.0, segments=Segments(ids))
    assert torch.allclose(seg, torch.tensor([[math.exp(0.5)] * 2 + [math.exp(-1.0)], [1.0, math.e, 0.0]]))


def test_rejection_mask_by_hand():
    old = torch.tensor([[0.0, -0.05, 0.0], [0.0, -2.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    # token_k1 with band [0.9, 1.1]: −log ρ within [−log 1.1, −log 0.9]; ρ = e^{-2} is out
    keep = rejection_mask(old, rollout, mask, "token_k1", "0.9_1.1")
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]))
    keep = rejection_mask(old, rollout, mask, "seq_max_k2", 0.5)  # ½ (log ρ)² = 2 > 0.5: row 1 out
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("loss_type", ["ppo_clip", "cispo", "dppo_tv", "dppo_kl", "gspo"])
def test_policy_loss_terms_compose_to_compute_policy_loss(loss_type):
    old, rollout, mask = _inputs(3)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(B, T, generator=g)
    lp = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                  rollout_rs_threshold=0.05, loss_type=loss_type)
    settings = PolicyLoss(ClipRange(0.2, 0.28, 3.0), Aggregation("seq-mean-token-mean"))
    a = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(a, old, adv, mask, config=cfg, rollout_log_prob=rollout, loss=settings)
    loss.backward()
    weights, keep = _composed(old, rollout, mask, cfg)
    b = lp.clone().requires_grad_(True)
    term, _, _ = policy_loss_term(b, old, adv, keep, weights, loss_type=loss_type, clip=settings.clip)
    composed = agg_loss(term, keep, settings.aggregation)
    composed.backward()
    if loss_type == "gspo":  # its sequence ratio is summed in float64 by the entry point
        torch.testing.assert_close(composed, loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(composed, loss)
        assert torch.equal(b.grad, a.grad)


def test_policy_loss_term_checks_its_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss_term(x, x, x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        policy_loss_term(x, x, x, torch.ones(2, 3), loss_type="ppo")


def test_parallel_is_required_as_an_object():
    old, rollout, mask = _inputs()
    with pytest.raises(TypeError, match=r"Parallel\(dp_group=group\)"):
        compute_rollout_correction(old, rollout, mask, parallel=object())


def test_the_toolkit_accepts_the_0_2_keywords_with_a_deprecation_warning():
    old, rollout, mask = _inputs()
    cfg = RolloutCorrectionConfig.from_preset("decoupled_geo_rs_token_tis")
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    new = rollout_correction.compute_rollout_correction(old, rollout, mask, config=cfg, parallel=Parallel())
    with pytest.warns(DeprecationWarning, match=r"parallel=Parallel\(dp_group=..., cp_group=...\)"):
        was = rollout_correction.compute_rollout_correction(old, rollout, mask, config=cfg, process_group=None)
    assert torch.equal(was.weights, new.weights) and was.metrics_as_floats() == new.metrics_as_floats()
    settings = PolicyLoss(ClipRange(0.1, 0.3, 2.0), Aggregation("seq-mean-token-sum-norm", scale_factor=7.0))
    new_loss, new_m = rollout_correction.compute_policy_loss(old, old, adv, mask, config=cfg, rollout_log_prob=rollout,
                                                            loss=settings)
    with pytest.warns(DeprecationWarning, match=r"loss=PolicyLoss"):
        old_loss, old_m = rollout_correction.compute_policy_loss(
            old, old, adv, mask, config=cfg, rollout_log_prob=rollout, clip_ratio_low=0.1, clip_ratio_high=0.3,
            clip_ratio_c=2.0, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7.0)
    assert torch.equal(old_loss, new_loss)
    assert rollout_correction.metrics_to_floats(old_m) == rollout_correction.metrics_to_floats(new_m)
    with pytest.warns(DeprecationWarning, match=r"aggregation=Aggregation"):
        assert torch.equal(rollout_correction.agg_loss(adv, mask, loss_agg_mode="token-sum"),
                           agg_loss(adv, mask, Aggregation("token-sum")))
    with pytest.warns(DeprecationWarning, match=r"clip=ClipRange"):
        assert all(torch.equal(x, y) for x, y in zip(rollout_correction.ppo_clip_loss(old, rollout, adv, clip_ratio_c=5.0),
                                                      core.ppo_clip_loss(old, rollout, adv, ClipRange(dual=5.0))))
    with pytest.warns(DeprecationWarning, match="segments=Segments"):
        rollout_correction.compute_rollout_correction(old, rollout, mask, config="decoupled_token_is",
                                                      segment_ids=torch.zeros(B, T, dtype=torch.long))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="max_segments.*without segment_ids"):
        rollout_correction.compute_rollout_correction(old, rollout, mask, config="decoupled_token_is", max_segments=3)
    acc = rollout_correction.OffPolicyAccumulator()
    acc.update(old, rollout, mask)
    with pytest.warns(DeprecationWarning, match="parallel="):
        assert acc.compute(process_group=None).keys() == acc.compute().keys()
    with pytest.raises(TypeError, match="not both"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        rollout_correction.compute_rollout_correction(old, rollout, mask, parallel=Parallel(), process_group=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'proces_group'"):
        rollout_correction.compute_rollout_correction(old, rollout, mask, proces_group=None)


@pytest.mark.parametrize("name", ["compute_rollout_correction", "compute_rollout_correction_packed",
                                  "compute_offpolicy_metrics", "compute_policy_loss", "agg_loss", "ppo_clip_loss"])
def test_the_toolkit_entry_points_take_every_parameter_of_the_core(name):
    """The toolkit's wrapper of an entry point accepts each of the core's parameters by name, in the same kind
    (the packed entry point is the toolkit's own, ``rollout_correction.packed``)."""
    import rollout_correction.packed

    wrapped = rollout_correction.packed if name.endswith("_packed") else core
    core_params = inspect.signature(getattr(wrapped, name)).parameters
    wrapper = inspect.signature(getattr(rollout_correction, name)).parameters
    assert [p for p in core_params if p not in wrapper] == []
    assert {p: wrapper[p].kind for p in core_params} == {p: q.kind for p, q in core_params.items()}


def test_the_core_takes_no_0_2_keyword():
    old, rollout, mask = _inputs()
    with pytest.raises(TypeError):
        core.compute_rollout_correction(old, rollout, mask, process_group=None)
    with pytest.raises(TypeError):
        core.compute_policy_loss(old, old, old, mask, loss_agg_mode="token-mean")
