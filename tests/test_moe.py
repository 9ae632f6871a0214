"""Routing record / replay and routing agreement on tiny Mixtral, Qwen3-MoE and OLMoE models built
from their transformers configs.

What the library's hooks do is checked from the outside: the tests put their own forward hooks on
each layer's ``experts`` module (what it is asked to compute: ``top_k_index``, ``top_k_weights``)
and on each router (its input), and compute the architecture's gate formula themselves.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction import METRIC_PREFIX
from rollout_correction.moe import (
    RoutingMismatchError,
    RoutingRecord,
    UnsupportedModelError,
    record_routing,
    replay_routing,
    routing_agreement,
    routing_confidence,
    routing_mask_from_response,
)

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 40, 32, 2, 6, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              num_experts_per_tok=TOP_K, experts_implementation="eager", pad_token_id=None, eos_token_id=None,
              bos_token_id=None)


def build(arch: str, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=EXPERTS, **COMMON))
    elif arch.startswith("qwen3_moe"):
        cfg = transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=32, decoder_sparse_step=1,
                                          mlp_only_layers=[], norm_topk_prob=arch.endswith("norm"), **COMMON)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=EXPERTS, **COMMON))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # routers that actually discriminate between experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.to(dtype)


# The architecture's own gate formula over a set of experts, written out per model:
# Mixtral always renormalises the top-k softmax probabilities; Qwen3-MoE renormalises when
# norm_topk_prob is set; OLMoE's default config does not.
RENORMALISES = {"mixtral": True, "qwen3_moe": False, "qwen3_moe_norm": True, "olmoe": False}
ARCHS = list(RENORMALISES)


def expected_gates(router_input: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, arch: str):
    probs = torch.softmax((router_input.reshape(-1, HIDDEN) @ weight.T).float(), dim=-1)
    g = probs.gather(-1, experts)
    return g / g.sum(-1, keepdim=True) if RENORMALISES[arch] else g


class Probe:
    """The test's own hooks: router inputs and what each ``experts`` module is asked to compute."""

    def __init__(self, model):
        self.layers = [layer.mlp for layer in model.model.layers]
        self.calls: list[dict] = []
        self.handles = []

    def __enter__(self):
        for i, mlp in enumerate(self.layers):
            self.handles.append(mlp.gate.register_forward_pre_hook(
                lambda m, args, i=i: self.calls.append({"layer": i, "router_input": args[0].detach()})))
            self.handles.append(mlp.experts.register_forward_pre_hook(
                lambda m, args, i=i: self.calls[-1].update(index=args[1].detach(), weights=args[2])))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def random_record(rows: int, positions: int, seed: int = 0) -> torch.Tensor:
    """(rows, positions, LAYERS, TOP_K) distinct random experts per set."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, positions, LAYERS, EXPERTS, generator=g)
    return scores.topk(TOP_K, dim=-1).indices


def tokens(rows: int = 4, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Replay


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_selects_recorded_experts_with_the_architectures_gates(arch):
    model = build(arch)
    x = tokens()
    experts = random_record(*x.shape)
    with replay_routing(model, RoutingRecord.from_experts(experts)), Probe(model) as probe:
        model(x)
    assert len(probe.calls) == LAYERS
    for call in probe.calls:
        l = call["layer"]
        want = experts[:, :, l].reshape(-1, TOP_K)
        assert torch.equal(call["index"].long(), want)
        gates = expected_gates(call["router_input"], model.model.layers[l].mlp.gate.weight, want, arch)
        torch.testing.assert_close(call["weights"].float(), gates.to(call["weights"].dtype).float(),
                                   rtol=1e-5, atol=1e-6)
    # the recorded sets differ from what the routers choose on their own (the test is not vacuous)
    with record_routing(model) as own:
        model(x)
    assert not torch.equal(own.record.experts.sort(-1).values, experts.sort(-1).values)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_reach_the_router_under_replay(arch):
    model = build(arch)
    x = tokens()
    record = RoutingRecord.from_experts(random_record(*x.shape, seed=3))
    with replay_routing(model, record):
        logits = model(x).logits
    torch.log_softmax(logits, -1)[..., 0].sum().backward()
    for layer in model.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_norm"])
def test_router_gradient_equals_the_gate_formulas_gradient(arch):
    """d loss / d router weight under replay equals the gradient of the architecture's formula
    (computed here by the test, through its own copy of the layer-0 MoE block)."""
    model = build(arch, dtype=torch.float64)
    mlp = model.model.layers[0].mlp
    h = torch.randn(5, 3, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    experts = random_record(5, 3, seed=4)[:, :, 0]
    record = RoutingRecord.from_experts(experts.unsqueeze(2))

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = mlp

        def forward(self, input_ids=None, inputs_embeds=None):
            return self.mlp(inputs_embeds)

    one = One()
    with replay_routing(one, record):
        out = one(inputs_embeds=h)
    (out ** 2).sum().backward()
    got = mlp.gate.weight.grad.clone()
    mlp.gate.weight.grad = None
    w = mlp.gate.weight
    flat = h.reshape(-1, HIDDEN)
    gates = expected_gates(flat, w, experts.reshape(-1, TOP_K), arch)
    ref = mlp.experts(flat, experts.reshape(-1, TOP_K), gates)
    (ref ** 2).sum().backward()
    torch.testing.assert_close(got, mlp.gate.weight.grad)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_r2_replay_of_the_own_first_pass_reproduces_it(arch):
    model = build(arch)
    x = tokens()
    with record_routing(model) as first:
        ref = model(x).logits
    with replay_routing(model, first.record):
        again = model(x).logits
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


def test_micro_batches_replay_row_slices_of_the_record():
    model = build("qwen3_moe")
    x = tokens(rows=6)
    record = RoutingRecord.from_experts(random_record(6, x.shape[1], seed=7))
    with replay_routing(model, record):
        whole = model(x).logits
    parts = []
    for sl in (slice(0, 2), slice(2, 6)):
        with replay_routing(model, record[sl]):
            parts.append(model(x[sl]).logits)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)


def test_positions_not_valid_keep_the_routers_own_choice():
    model = build("mixtral")
    x = tokens()
    experts = random_record(*x.shape, seed=2)
    valid = torch.zeros(x.shape, dtype=torch.bool)
    valid[:, :4] = True
    with record_routing(model) as own:
        model(x)
    with replay_routing(model, RoutingRecord.from_experts(experts, valid)), Probe(model) as probe:
        model(x)
    first = probe.calls[0]["index"].reshape(*x.shape, TOP_K).long()
    assert torch.equal(first[:, :4], experts[:, :4, 0])
    assert torch.equal(first[:, 4:], own.record.experts[:, 4:, 0])  # layer 0's input is unchanged there


# ---------------------------------------------------------------------------------------------
# Record


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe"])
def test_kv_cache_generation_records_the_full_forwards_experts(arch):
    """float64, so that the prompt forward and the teacher-forced forward cannot round differently."""
    model = build(arch, dtype=torch.float64).eval()
    prompt = tokens(rows=3, length=5, seed=5)
    with record_routing(model) as gen:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    full_tokens = out[:, :-1]  # the last sampled token is never fed to the model
    with record_routing(model) as full:
        model(full_tokens)
    assert gen.record.experts.shape == (3, 10, LAYERS, TOP_K)
    assert torch.equal(gen.record.experts.sort(-1).values, full.record.experts.sort(-1).values)
    # and replaying the generation's record reproduces the full forward exactly
    with replay_routing(model, gen.record):
        replayed = model(full_tokens).logits
    torch.testing.assert_close(replayed, model(full_tokens).logits, rtol=0, atol=1e-12)


def test_kv_cache_replay_follows_the_cache_position():
    """Replay during generation uses positions [cache length, cache length + S)."""
    model = build("olmoe").eval()
    prompt = tokens(rows=2, length=4, seed=6)
    experts = random_record(2, 7, seed=8)
    with replay_routing(model, RoutingRecord.from_experts(experts)), Probe(model) as probe:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    layer0 = [c["index"].long() for c in probe.calls if c["layer"] == 0]
    assert torch.equal(layer0[0], experts[:, :4, 0].reshape(-1, TOP_K))
    for step, idx in enumerate(layer0[1:]):
        assert torch.equal(idx, experts[:, 4 + step, 0])


def test_padded_and_packed_layouts_record_the_same_routing():
    """Two sequences right-padded in a batch, and the same two packed into one row with
    position_ids restarting at each sequence: the recorded experts of the real tokens agree."""
    model = build("qwen3_moe", dtype=torch.float64).eval()
    a, b = tokens(1, 7, seed=1)[0], tokens(1, 4, seed=2)[0]
    padded = torch.zeros(2, 7, dtype=torch.long)
    padded[0], padded[1, :4] = a, b
    mask = torch.zeros(2, 7, dtype=torch.long)
    mask[0], mask[1, :4] = 1, 1
    with record_routing(model) as pad_rec:
        model(padded, attention_mask=mask)
    packed_ids = torch.cat([a, b]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(7), torch.arange(4)]).unsqueeze(0)
    # one row, each token attending within its own sequence (block-diagonal causal mask)
    seq = torch.cat([torch.zeros(7), torch.ones(4)])
    causal = torch.tril(torch.ones(11, 11, dtype=torch.bool)) & (seq[:, None] == seq[None, :])
    with record_routing(model) as pack_rec:
        model(packed_ids, position_ids=position_ids, attention_mask=causal[None, None])
    packed = pad_rec.record.pack(mask)
    assert packed.experts.shape == (1, 11, LAYERS, TOP_K)
    assert torch.equal(packed.experts.sort(-1).values, pack_rec.record.experts.sort(-1).values)
    back = pack_rec.record.unpack(mask)
    assert torch.equal(back.valid, mask.bool())
    assert torch.equal(back.experts[mask.bool()].sort(-1).values, pad_rec.record.experts[mask.bool()].sort(-1).values)


def test_fresh_forwards_stack_rows_and_record_holds_the_routers_own_choice_under_replay():
    model = build("mixtral")
    x = tokens(rows=4)
    with record_routing(model) as both:
        model(x[:2])
        model(x[2:])
    with record_routing(model) as once:
        model(x)
    assert torch.equal(both.record.experts, once.record.experts)
    with record_routing(model) as own, replay_routing(model, RoutingRecord.from_experts(random_record(4, 9))):
        model(x)
    # layer 0 sees the same input whatever is replayed: its own choice is the unreplayed one
    assert torch.equal(own.record.experts[:, :, 0], once.record.experts[:, :, 0])


# ---------------------------------------------------------------------------------------------
# Refusals


def test_mismatched_records_are_refused():
    model = build("mixtral")
    x = tokens(rows=4, length=9)
    cases = {
        "rows": (RoutingRecord.from_experts(random_record(3, 9)), "3"),
        "positions": (RoutingRecord.from_experts(random_record(4, 8)), "positions"),
    }
    for what, (record, needle) in cases.items():
        with pytest.raises(RoutingMismatchError, match=needle):
            with replay_routing(model, record):
                model(x)
    one_layer = random_record(4, 9)[:, :, :1]
    with pytest.raises(RoutingMismatchError, match="1 layers.*2 routers"):
        with replay_routing(model, RoutingRecord.from_experts(one_layer)):
            pass
    three = torch.randint(0, EXPERTS, (4, 9, LAYERS, 3))
    with pytest.raises(RoutingMismatchError, match="top_k = 3"):
        with replay_routing(model, RoutingRecord.from_experts(three)):
            pass
    outside = random_record(4, 9)
    outside[0, 0, 0, 0] = EXPERTS
    with pytest.raises(RoutingMismatchError, match="outside"):
        with replay_routing(model, RoutingRecord.from_experts(outside)):
            pass
    with pytest.raises(RoutingMismatchError, match="rows, positions, layers, top_k"):
        RoutingRecord.from_experts(torch.zeros(4, 9, 2, dtype=torch.long))
    with pytest.raises(RoutingMismatchError, match="integer"):
        RoutingRecord(torch.zeros(4, 9, 2, 2), torch.ones(4, 9, dtype=torch.bool))


def test_models_without_conventional_routers_are_refused_by_name():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*'llama'"):
        with record_routing(llama):
            pass

    class SigmoidRouter(torch.nn.Module):  # DeepSeek-style scores: not the softmax convention
        def __init__(self):
            super().__init__()
            self.top_k, self.weight = 2, torch.nn.Parameter(torch.randn(4, 8))

        def forward(self, h):
            logits = h @ self.weight.T
            s, i = torch.sigmoid(logits).topk(2, dim=-1)
            return logits, s, i

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = SigmoidRouter()

    with pytest.raises(UnsupportedModelError, match="Toy: router router .*softmax"):
        with replay_routing(Toy(), RoutingRecord.from_experts(torch.zeros(1, 1, 1, 2, dtype=torch.long))):
            pass


def test_routers_are_found_by_structure_and_the_config_not_by_class_name():
    """A softmax top-k router named ``Gate`` is found; a module shaped like a router whose expert count,
    top-k or width disagrees with the model's config is not; the transformers routers still are."""

    class Gate(torch.nn.Module):  # no "Router" in the name
        def __init__(self, experts=4, hidden=8, top_k=2):
            super().__init__()
            self.top_k, self.weight = top_k, torch.nn.Parameter(torch.randn(experts, hidden))

        def forward(self, h):
            logits = h @ self.weight.T
            p = torch.softmax(logits.float(), dim=-1)
            s, i = p.topk(self.top_k, dim=-1)
            return logits, s / s.sum(-1, keepdim=True), i

    class Toy(torch.nn.Module):
        def __init__(self, config=None, **gate):
            super().__init__()
            self.gate = Gate(**gate)
            if config is not None:
                self.config = config

    from rollout_correction.moe import find_routers

    (r,) = find_routers(Toy())
    assert (r.name, r.top_k, r.num_experts, r.renormalize) == ("gate", 2, 4, True)
    cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, hidden_size=8)
    assert [x.name for x in find_routers(Toy(cfg))] == ["gate"]
    for wrong in (dict(experts=6), dict(top_k=3), dict(hidden=16)):  # disagrees with the config
        with pytest.raises(UnsupportedModelError, match="has no top-k router modules"):
            find_routers(Toy(cfg, **wrong))
    with pytest.raises(UnsupportedModelError, match="has no top-k router modules"):
        find_routers(Toy(experts=2, top_k=2))  # as many "experts" as chosen: nothing to route
    model = build("mixtral")
    names = [x.name for x in find_routers(model)]
    assert names == [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]
    assert {type(x.module).__name__ for x in find_routers(model)} != {"Gate"}


# ---------------------------------------------------------------------------------------------
# Agreement


def test_agreement_matches_hand_computed_values():
    # 2 rows × 2 positions × 2 layers × top-2; row 1 position 1 is masked out.
    a = torch.tensor([[[[0, 1], [2, 3]], [[0, 2], [1, 3]]],
                      [[[4, 5], [0, 1]], [[1, 2], [3, 4]]]])
    b = torch.tensor([[[[1, 0], [2, 4]], [[0, 2], [1, 3]]],      # (match, overlap ½) | (match, match)
                      [[[3, 2], [1, 0]], [[5, 0], [5, 0]]]])     # (overlap 0, match) | masked
    mask = torch.tensor([[1, 1], [1, 0]])
    m = routing_agreement(a, b, mask)
    P = METRIC_PREFIX
    # kept tokens: (0,0), (0,1), (1,0); layer 0: match, match, miss; layer 1: miss, match, match
    assert m[P + "routing_tokens"].item() == 3
    assert m[P + "routing_match_layer0"].item() == pytest.approx(2 / 3)
    assert m[P + "routing_match_layer1"].item() == pytest.approx(2 / 3)
    assert m[P + "routing_match"].item() == pytest.approx(4 / 6)
    assert m[P + "routing_overlap_layer0"].item() == pytest.approx((1 + 1 + 0) / 3)
    assert m[P + "routing_overlap_layer1"].item() == pytest.approx((0.5 + 1 + 1) / 3)
    assert m[P + "routing_overlap"].item() == pytest.approx(4.5 / 6)
    assert m[P + "routing_token_differs"].item() == pytest.approx(2 / 3)
    # identical records; an empty selection gives zeros, not NaN
    same = routing_agreement(a, a)
    assert same[P + "routing_match"].item() == 1.0 and same[P + "routing_token_differs"].item() == 0.0
    empty = routing_agreement(a, b, torch.zeros(2, 2))
    assert all(v.item() == 0.0 for v in empty.values())
    with pytest.raises(RoutingMismatchError, match="differ in shape"):
        routing_agreement(a, b[:1])
    with pytest.raises(RoutingMismatchError, match="mask must be"):
        routing_agreement(a, b, torch.ones(3, 2))


def test_routing_confidence_by_hand():
    # 2 rows × 2 positions × 2 layers; row 1 position 1 is masked out, row 0 position 1 not recorded by the trainer.
    experts = torch.zeros(2, 2, 2, 2, dtype=torch.long)
    experts[..., 1] = 1
    engine = RoutingRecord(experts, torch.ones(2, 2, dtype=torch.bool),
                           torch.tensor([[[0.9, 0.5], [0.1, 0.1]], [[0.7, 0.3], [0.2, 0.2]]]))
    trainer = RoutingRecord(experts, torch.tensor([[True, False], [True, True]]),
                            torch.tensor([[[0.8, 0.6], [0.9, 0.9]], [[0.5, 0.7], [0.4, 0.4]]]))
    m = routing_confidence(engine, trainer, torch.tensor([[1, 1], [1, 0]]))
    P = METRIC_PREFIX
    # kept tokens: (0, 0) and (1, 0), two layers each
    assert m[P + "routing_confidence_engine"].item() == pytest.approx((0.9 + 0.5 + 0.7 + 0.3) / 4)
    assert m[P + "routing_confidence_trainer"].item() == pytest.approx((0.8 + 0.6 + 0.5 + 0.7) / 4)
    assert m[P + "routing_confidence_diff"].item() == pytest.approx(0.05, abs=1e-6)
    empty = routing_confidence(engine, trainer, torch.zeros(2, 2))
    assert all(v.item() == 0.0 for v in empty.values())
    with pytest.raises(RoutingMismatchError, match="the engine record has no topk_mass"):
        routing_confidence(RoutingRecord.from_experts(experts), trainer)
    with pytest.raises(RoutingMismatchError, match="differ in shape"):
        routing_confidence(engine, trainer[:1])
    with pytest.raises(RoutingMismatchError, match="topk_mass must be"):
        RoutingRecord(experts, torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2))


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_recorded_topk_mass_is_the_routers_probability_of_its_choice(arch):
    model = build(arch)
    x = tokens()
    with record_routing(model) as rec, Probe(model) as probe:
        model(x)
    record = rec.record
    for call in probe.calls:
        l = call["layer"]
        probs = torch.softmax(call["router_input"].reshape(-1, HIDDEN) @ model.model.layers[l].mlp.gate.weight.T, -1)
        want = probs.topk(TOP_K, -1).values.sum(-1).reshape(x.shape)
        torch.testing.assert_close(record.topk_mass[:, :, l], want, rtol=1e-5, atol=1e-6)
    assert bool((record.topk_mass > TOP_K / EXPERTS).all()) and bool((record.topk_mass <= 1 + 1e-6).all())
    # slicing, packing and stacking carry the mass along with the experts
    assert torch.equal(record[1:3].topk_mass, record.topk_mass[1:3])
    both = RoutingRecord.cat([record[:2], record[2:]])
    assert torch.equal(both.topk_mass, record.topk_mass)
    mask = torch.ones(x.shape, dtype=torch.bool)
    mask[0, -3:] = False
    assert torch.equal(record.pack(mask).unpack(mask).topk_mass[mask], record.topk_mass[mask])


def test_padded_positions_are_never_replayed():
    """A record whose padded positions hold verl's zero fill (expert 0 twice) and say valid: under
    the forward's attention mask, or an explicit mask, those positions keep the router's own choice."""
    model = build("mixtral")
    x = tokens(rows=3, length=8)
    attention = torch.ones(3, 8, dtype=torch.long)
    attention[1, 5:] = 0  # right padding
    attention[2, :2] = 0  # left padding
    experts = random_record(3, 8, seed=4)
    experts[attention == 0] = 0
    record = RoutingRecord.from_experts(experts)  # every position claims to be valid
    assert bool(record.valid.all())
    with record_routing(model) as own:
        model(x, attention_mask=attention)
    pads = attention == 0
    assert torch.equal(own.record.valid, ~pads)  # the record of a padded forward marks its padding
    with replay_routing(model, record), Probe(model) as probe:
        model(x, attention_mask=attention)
    used = probe.calls[0]["index"].reshape(3, 8, TOP_K).long()
    assert torch.equal(used[~pads], experts[~pads][:, 0])
    assert torch.equal(used[pads], own.record.experts[pads][:, 0])  # the router's own choice
    assert not bool((used[pads] == 0).all(-1).any())  # no padded route went to expert 0 twice
    # an explicit mask leaves those positions out too, also without an attention mask
    keep = torch.ones(3, 8, dtype=torch.bool)
    keep[0, :3] = False
    with record_routing(model) as unpadded:
        model(x)
    with replay_routing(model, record, mask=keep), Probe(model) as probe:
        model(x)
    used = probe.calls[0]["index"].reshape(3, 8, TOP_K).long()
    assert torch.equal(used[0, :3], unpadded.record.experts[0, :3, 0])
    assert torch.equal(used[keep], experts[keep][:, 0])


def test_diagnose_reports_the_routing_confidence_when_both_records_carry_it():
    from rollout_correction.diagnose.diagnosis import diagnose_tensors

    model = build("mixtral")
    x = tokens(rows=4, length=5)
    with record_routing(model) as a:
        model(x)
    with record_routing(model, router_fp32=True) as b:
        model(x)
    old = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    diag = diagnose_tensors(old, old - 0.01, torch.ones(4, 5), presets=[], routing=(a.record, b.record))
    want = routing_confidence(a.record, b.record)
    for k, v in want.items():
        assert diag.profile.metrics[k] == pytest.approx(v.item())


def test_verl_top1_records_need_the_attention_mask():
    experts = torch.zeros(2, 4, LAYERS, 1, dtype=torch.int16)
    with pytest.raises(RoutingMismatchError, match="top_k = 1 need the attention_mask"):
        RoutingRecord.from_verl(experts)
    record = RoutingRecord.from_verl(experts, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]))
    assert record.valid.tolist() == [[False, True, True, True], [True, True, False, False]]


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_fp32_router_logits_make_a_bf16_engine_agree_with_an_fp32_router(arch):
    """prime-rl #2952: a trainer routing from fp32 logits (as Megatron's moe_router_dtype=fp32 does)
    on the same bf16 activations as the engine. The engine's bf16 router logits round near-ties the
    other way on some tokens; with router_fp32 the two route every token alike."""
    engine = build(arch, dtype=torch.bfloat16).eval()
    trainer = build(arch, dtype=torch.bfloat16).eval()  # the same weights, a separate stack
    x = tokens(rows=16, length=64, seed=3)
    with torch.no_grad():
        with record_routing(trainer, router_fp32=True) as fp32_trainer:
            trainer(x)
        with record_routing(engine) as bf16_engine:
            engine(x)
        with record_routing(engine, router_fp32=True) as fp32_engine:
            engine(x)
    P = METRIC_PREFIX
    before = routing_agreement(bf16_engine.record, fp32_trainer.record)
    after = routing_agreement(fp32_engine.record, fp32_trainer.record)
    assert before[P + "routing_match"].item() < after[P + "routing_match"].item() == 1.0
    # the recorded probabilities are of the fp32 logits, and so are the replayed gates
    conf = routing_confidence(fp32_engine.record, fp32_trainer.record)
    assert conf[P + "routing_confidence_diff"].item() == 0.0
    with replay_routing(engine, fp32_trainer.record, router_fp32=True), Probe(engine) as probe:
        engine(x)
    call = probe.calls[0]
    w = engine.model.layers[0].mlp.gate.weight
    probs = torch.softmax(call["router_input"].reshape(-1, HIDDEN).float() @ w.float().T, -1)
    want = probs.gather(-1, call["index"].long())
    if RENORMALISES[arch]:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(call["weights"].float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)
    with pytest.raises(TypeError, match="router_fp32 must be True or False"):
        with record_routing(engine, router_fp32="yes"):
            pass


def test_response_mask_maps_to_the_positions_that_produced_each_token():
    # prompt of 3 tokens, 4 response tokens; the record covers the 6 fed positions
    m = routing_mask_from_response(torch.tensor([[1, 1, 1, 0]]), prompt_len=3, positions=6)
    assert m.tolist() == [[False, False, True, True, True, False]]


def _dp_worker(rank: int, world: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randint(0, 5, (7, 6, 3, 2), generator=g)
        b = torch.randint(0, 5, (7, 6, 3, 2), generator=g)
        mask = torch.rand(7, 6, generator=g) > 0.3
        rows = [(0, 2), (2, 7)][rank]  # uneven split
        got = routing_agreement(a[rows[0]:rows[1]], b[rows[0]:rows[1]], mask[rows[0]:rows[1]],
                                process_group=dist.group.WORLD)
        want = routing_agreement(a, b, mask)
        ra = RoutingRecord(a, torch.ones(7, 6, dtype=torch.bool), torch.rand(7, 6, 3, generator=g))
        rb = RoutingRecord(b, torch.rand(7, 6, generator=g) > 0.2, torch.rand(7, 6, 3, generator=g))
        got.update(routing_confidence(ra[rows[0]:rows[1]], rb[rows[0]:rows[1]], mask[rows[0]:rows[1]],
                                      process_group=dist.group.WORLD))
        want.update(routing_confidence(ra, rb, mask))
        queue.put((rank, {k: (got[k].item(), want[k].item()) for k in want}))
    finally:
        dist.destroy_process_group()


def test_agreement_is_exact_across_data_parallel_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_dp_worker, args=(2, port, queue), nprocs=2, join=True, start_method="spawn")
    for _ in range(2):
        rank, values = queue.get(timeout=30)
        for name, (got, want) in values.items():
            assert got == pytest.approx(want, rel=1e-12, abs=0), (rank, name)


# ---------------------------------------------------------------------------------------------
# Engines' formats


def test_verl_routed_experts_become_a_record():
    """verl's layout (agent loop): (B, prompt + response, L, K) int16, left-padded prompt, zeros
    where nothing was recorded, in a DataProto next to the attention mask."""
    from verl import DataProto

    experts = torch.zeros(2, 6, LAYERS, TOP_K, dtype=torch.int16)
    experts[0, 1:5] = random_record(1, 4, seed=1)[0].short()     # prompt padded by one, last token unrouted
    experts[1, 0:4] = random_record(1, 4, seed=2)[0].short()
    attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    data = DataProto.from_dict(tensors={"routed_experts": experts, "attention_mask": attention})
    record = RoutingRecord.from_verl(data)
    assert record.experts.dtype == torch.long and record.experts.shape == (2, 6, LAYERS, TOP_K)
    assert record.valid.tolist() == [[False, True, True, True, True, False], [True, True, True, True, False, False]]
    assert torch.equal(record.experts[0, 1:5], experts[0, 1:5].long())
    packed = record.pack(attention)
    assert packed.experts.shape == (1, 10, LAYERS, TOP_K)
    # verl's own conversion to its remove-padding layout gives the same packed record
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    td = TensorDict({"input_ids": torch.randint(0, VOCAB, (2, 6)), "attention_mask": attention,
                     "response_mask": attention[:, 3:], "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
                     "routed_experts": experts}, batch_size=[2])
    no_padding = RoutingRecord.from_verl(left_right_2_no_padding(td))
    assert torch.equal(no_padding.experts, packed.experts)
    assert torch.equal(no_padding.valid, packed.valid)


def test_slime_rollout_routed_experts_become_a_record():
    """slime's layout: per sample, (len(tokens) − 1, L, K)."""
    s0, s1 = random_record(1, 5, seed=1)[0].int(), random_record(1, 3, seed=2)[0].int()
    record = RoutingRecord.from_slime([s0, s1.tolist()])
    assert record.experts.shape == (2, 5, LAYERS, TOP_K)
    assert record.valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert torch.equal(record.experts[1, :3], s1.long())
    with pytest.raises(RoutingMismatchError, match="samples \\[1\\]"):
        RoutingRecord.from_slime([s0, torch.zeros(3, LAYERS + 1, TOP_K)])


def test_diagnose_and_monitor_know_the_routing_metrics():
    """The diagnosis adds the agreement and a check that warns below 0.9; the health monitor's
    routing_match_low rule reads the same metric name."""
    from rollout_correction.diagnose.diagnosis import diagnose_tensors
    from rollout_correction.monitor import HealthMonitor

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 5, generator=g)
    a = random_record(8, 5, seed=1)
    b = a.clone()
    b[:4, :, 0] = random_record(4, 5, seed=2)[:, :, 0]  # half the rows re-routed in layer 0
    diag = diagnose_tensors(old, old - 0.01, torch.ones(8, 5), presets=["decoupled_token_is"],
                            routing=(RoutingRecord.from_experts(a), RoutingRecord.from_experts(b)))
    want = routing_agreement(a, b)
    assert diag.profile.metrics[METRIC_PREFIX + "routing_match"] == pytest.approx(
        want[METRIC_PREFIX + "routing_match"].item())
    check = next(c for c in diag.health if c.name.startswith("routing agreement"))
    expected_verdict = "warn" if want[METRIC_PREFIX + "routing_match"].item() < 0.9 else "ok"
    assert check.verdict == expected_verdict == "warn"
    import io

    from rollout_correction.diagnose.report import print_summary

    text = io.StringIO()
    print_summary(diag, file=text)
    assert "routing_match" in text.getvalue() and "routing agreement" in text.getvalue()
    mon = HealthMonitor(log_alerts=False, static_window=1, trends=False)
    mon.update(0, {METRIC_PREFIX + k.split("/")[-1]: v.item() for k, v in want.items()})
    assert [al.name for al in mon.alerts] == ["routing_match_low"]


def test_agreement_and_the_hooks_never_wait_for_the_device():
    """No host read and no data-dependent shape in routing_agreement (with a mask), and none added
    by the record / replay hooks to a forward (the test_no_sync watch; the eager experts loop of the
    model itself reads the device, so a hooked forward is compared with a plain one over the same
    experts)."""
    from test_no_sync import watched

    a, b = random_record(4, 9, seed=1), random_record(4, 9, seed=2)
    mask = torch.rand(4, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    with watched() as watch:
        routing_agreement(a, b, mask)
    assert watch.syncs == [] and watch.dynamic == []
    model = build("qwen3_moe_norm")
    x = tokens()
    with torch.no_grad():
        with record_routing(model) as first:
            model(x)
        with watched() as plain:
            model(x)
        with replay_routing(model, first.record), record_routing(model) as own:
            with watched() as hooked:
                model(x)
    assert hooked.syncs == plain.syncs and hooked.dynamic == plain.dynamic
    assert torch.equal(own.record.experts, first.record.experts)


def test_gradient_checkpointing_replays_in_the_recompute():
    """With (non-reentrant) gradient checkpointing the routers run again during backward; with the
    backward inside the replay block they replay the same experts, so every gradient equals the
    one without checkpointing."""
    x = tokens()
    record = RoutingRecord.from_experts(random_record(*x.shape, seed=3))

    def grads(checkpointing: bool) -> torch.Tensor:
        model = build("mixtral").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with replay_routing(model, record):
            model(x).logits.logsumexp(-1).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    torch.testing.assert_close(grads(True), grads(False), rtol=1e-5, atol=1e-6)
