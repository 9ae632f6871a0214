"""Gate replay ("Total Router Recall", prime-rl #3509 / #3523): ``record_routing`` records each
router's gate values in fp32, ``replay_routing(..., gates="recorded")`` replays them with the router
frozen. On tiny Mixtral, Qwen3-MoE and OLMoE models built from their transformers configs (the
models of tests/test_moe.py).
"""

from __future__ import annotations

import pytest
import torch

from rollout_correction import ConfigError
from rollout_correction.moe import (GATE_SOURCES, RoutingMismatchError, RoutingRecord, record_routing, replay_routing,
                                    routing_agreement)
from test_moe import ARCHS, EXPERTS, LAYERS, TOP_K, VOCAB, Probe, build

pytest.importorskip("transformers")

P = "rollout_corr/"


def _tokens(seed=0, rows=3, length=9):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _perturb_routers(model, seed=1, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(scale * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_record_holds_the_gates_the_experts_received(arch):
    model = build(arch)
    tokens = _tokens()
    probe = Probe(model)
    with torch.no_grad(), record_routing(model) as rec, probe:
        model(tokens)
    record = rec.record
    assert record.gates.dtype == torch.float32 and record.gates.shape == (3, 9, LAYERS, TOP_K)
    for layer, call in enumerate(probe.calls):
        assert torch.equal(record.experts[:, :, layer].reshape(-1, TOP_K), call["index"].long())
        assert torch.equal(record.gates[:, :, layer].reshape(-1, TOP_K), call["weights"].float())


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_ids_and_gates_reproduces_the_recording_forward_bit_for_bit(arch):
    model = build(arch)
    tokens = _tokens(1)
    with torch.no_grad(), record_routing(model) as rec:
        recorded = model(tokens).logits
    _perturb_routers(model)  # the trainer's routers drift from the engine's (prime-rl #3524: a bf16 downcast)
    with torch.no_grad():
        with replay_routing(model, rec.record, gates="recorded"):
            both = model(tokens).logits
        with replay_routing(model, rec.record):  # ids alone: the gates come from the perturbed routers
            ids_only = model(tokens).logits
    assert torch.equal(both, recorded)
    assert not torch.equal(ids_only, recorded)
    assert (ids_only - recorded).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_norm"])
def test_recorded_gates_freeze_the_router(arch):
    model = build(arch)
    tokens = _tokens(2)
    with torch.no_grad(), record_routing(model) as rec:
        model(tokens)
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    for gates, frozen in (("recorded", True), ("recomputed", False)):
        model.zero_grad(set_to_none=True)
        with replay_routing(model, rec.record, gates=gates):
            model(tokens).logits.logsumexp(-1).mean().backward()
        grads = [p.grad for p in routers]
        if frozen:
            assert all(g is None or not g.any() for g in grads)
        else:
            assert all(g is not None and g.abs().sum() > 0 for g in grads)
        other = [p.grad for n, p in model.named_parameters() if "experts" in n]
        assert any(g is not None and g.abs().sum() > 0 for g in other)  # the rest of the model still learns


def test_unreplayed_positions_keep_the_routers_own_choice_and_gates():
    model = build("mixtral")
    tokens = _tokens(3)
    with torch.no_grad(), record_routing(model) as rec:
        model(tokens)
    _perturb_routers(model)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1] = False  # row 1 is not replayed
    probe = Probe(model)
    with torch.no_grad(), record_routing(model) as own, probe:
        model(tokens)
    probe = Probe(model)
    with torch.no_grad(), replay_routing(model, rec.record, mask, gates="recorded"), probe:
        model(tokens)
    for layer, call in enumerate(probe.calls):
        idx, w = call["index"].long().reshape(3, 9, TOP_K), call["weights"].float().reshape(3, 9, TOP_K)
        assert torch.equal(idx[1], own.record.experts[1, :, layer]) and torch.equal(w[1], own.record.gates[1, :, layer])
        assert torch.equal(idx[0], rec.record.experts[0, :, layer]) and torch.equal(w[0], rec.record.gates[0, :, layer])


def test_the_gates_follow_the_record_through_slicing_packing_and_stacking():
    model = build("olmoe")
    tokens = _tokens(4)
    with torch.no_grad(), record_routing(model) as rec:
        model(tokens)
    r = rec.record
    assert torch.equal(r[1:].gates, r.gates[1:])
    assert torch.equal(RoutingRecord.cat([r[:1], r[1:]]).gates, r.gates)
    attention = torch.ones(3, 9)
    attention[0, 6:] = 0
    packed = r.pack(attention)
    assert packed.gates.shape == (1, int(attention.sum()), LAYERS, TOP_K)
    back = packed.unpack(attention)
    assert torch.equal(back.gates[attention.bool()], r.gates[attention.bool()])
    assert torch.equal(r.positions_slice(2, 5).gates, r.gates[:, 2:5])
    assert RoutingRecord.cat([r, RoutingRecord.from_experts(r.experts)]).gates is None


def test_generation_records_gates_across_the_kv_cache():
    model = build("mixtral")
    prompt = _tokens(5, rows=2, length=4)
    with torch.no_grad(), record_routing(model) as rec:
        out = model(prompt, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        model(nxt, past_key_values=out.past_key_values, use_cache=True)
    teacher = torch.cat([prompt, nxt], 1)
    with torch.no_grad(), record_routing(model) as forced:
        model(teacher)
    assert rec.record.gates.shape == forced.record.gates.shape == (2, 5, LAYERS, TOP_K)
    torch.testing.assert_close(rec.record.gates, forced.record.gates, rtol=1e-5, atol=1e-6)


def test_routing_agreement_reports_the_gate_difference():
    experts = torch.tensor([[[[0, 1], [2, 3]], [[1, 4], [0, 5]]]])  # (1, 2, 2, 2)
    g = torch.tensor([[[[0.6, 0.4], [0.7, 0.3]], [[0.5, 0.5], [0.9, 0.1]]]])
    other_experts = experts.clone()
    other_experts[0, 1, 1] = torch.tensor([5, 2])  # token 1, layer 1 routed differently: not compared
    other_gates = torch.tensor([[[[0.4, 0.6], [0.7, 0.3]], [[0.45, 0.55], [0.8, 0.2]]]])
    other_experts[0, 0, 0] = torch.tensor([1, 0])  # the same set in another order: gates aligned by expert
    a = RoutingRecord.from_experts(experts, gates=g)
    b = RoutingRecord.from_experts(other_experts, gates=other_gates)
    m = {k: float(v) for k, v in routing_agreement(a, b).items()}
    # pairs routed alike: (t0, l0) experts {0, 1}: a gives 0→0.6, 1→0.4; b gives 1→0.4, 0→0.6 → 0;
    # (t0, l1): 0; (t1, l0): |0.5 − 0.45| and |0.5 − 0.55| → 0.05
    assert m[P + "routing_gate_abs_diff"] == pytest.approx((0.0 + 0.0 + 0.05) / 3, rel=1e-6)
    assert m[P + "routing_match"] == pytest.approx(0.75)
    assert routing_agreement(a, a)[P + "routing_gate_abs_diff"] == 0.0
    assert P + "routing_gate_abs_diff" not in routing_agreement(a, RoutingRecord.from_experts(experts))


def test_bad_gate_options_and_records_without_gates():
    model = build("mixtral")
    tokens = _tokens(6)
    with torch.no_grad(), record_routing(model) as rec:
        model(tokens)
    with pytest.raises(ConfigError, match=r"gates='engine' is invalid; choose one of \['recomputed', 'recorded'\]"):
        with replay_routing(model, rec.record, gates="engine"):
            pass
    assert GATE_SOURCES == ("recomputed", "recorded")
    ids_only = RoutingRecord.from_experts(rec.record.experts)
    with pytest.raises(RoutingMismatchError, match=r"record passed as `record` \(\(rows, positions, layers, top_k\) = "
                                                   r"\(3, 9, 2, 2\), holding expert ids only\) holds no gate values"):
        with replay_routing(model, ids_only, gates="recorded"):
            pass
    with pytest.raises(RoutingMismatchError, match="gates must be float32"):
        RoutingRecord(rec.record.experts, rec.record.valid, gates=rec.record.gates[..., :1])
    assert EXPERTS > TOP_K
