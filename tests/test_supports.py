"""Truncated sampling supports: hand-computed cases, transformers' own filters, and a real sampling loop."""

import math

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rollout_correction.supports import renormalized_log_probs, sampling_support_mask, support_metrics

torch.set_num_threads(1)


def _logits(*rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(1, len(rows), -1)


def test_top_k_renormalisation_by_hand():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().reshape(1, 1, 3)
    out = renormalized_log_probs(logits, torch.tensor([[1]]), top_k=2)
    assert out.log_prob.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert out.full_log_prob.item() == pytest.approx(math.log(0.3), abs=1e-6)
    assert out.kept_log_mass.item() == pytest.approx(math.log(0.8), abs=1e-6)
    assert bool(out.in_support.item())
    # The raw log-ratio against the engine's processed log-prob is exactly log Z; ours is 0.
    processed = math.log(0.3 / 0.8)
    assert out.full_log_prob.item() - processed == pytest.approx(math.log(0.8), abs=1e-6)
    assert out.log_prob.item() - processed == pytest.approx(0.0, abs=1e-6)


def test_top_k_keeps_every_tie_at_the_kth_value():
    keep = sampling_support_mask(_logits([2.0, 1.0, 1.0, 0.0]), top_k=2)
    assert keep[0, 0].tolist() == [True, True, True, False]


def test_top_p_boundary_ties_are_all_kept():
    logits = _logits([math.log(2.0), 0.0, 0.0, -10.0])  # probs ≈ 0.5, 0.25, 0.25, 2e-5
    assert sampling_support_mask(logits, top_p=0.45)[0, 0].tolist() == [True, False, False, False]
    # The second token is needed to reach 0.55; the third is tied with it and is kept too.
    assert sampling_support_mask(logits, top_p=0.55)[0, 0].tolist() == [True, True, True, False]
    assert sampling_support_mask(logits, top_p=1.0)[0, 0].tolist() == [True] * 4


def test_min_p_is_relative_to_the_top_token():
    logits = torch.tensor([0.6, 0.25, 0.1, 0.05]).log().reshape(1, 1, 4)
    keep = sampling_support_mask(logits, min_p=0.2)  # threshold 0.12
    assert keep[0, 0].tolist() == [True, True, False, False]


def test_filter_order_matters_and_follows_each_engine():
    # probs 0.4, 0.3, 0.2, 0.1. min-p 0.3 drops 0.1 (threshold 0.12); top-p 0.7 then acts on
    # renormalised 0.44, 0.33, 0.22 (vLLM: min-p first → keeps 2 tokens) or on the full
    # distribution (transformers: top-p first; 0.4 + 0.3 < 0.72 so 3 tokens, and min-p keeps them).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().reshape(1, 1, 4)
    vllm = sampling_support_mask(logits, top_p=0.72, min_p=0.3, order="vllm")[0, 0].tolist()
    hf = sampling_support_mask(logits, top_p=0.72, min_p=0.3, order="hf")[0, 0].tolist()
    sgl = sampling_support_mask(logits, top_p=0.72, min_p=0.3, order="sglang")[0, 0].tolist()
    assert vllm == [True, True, False, False]
    assert hf == [True, True, True, False]
    assert sgl == [True, True, True, False]


@pytest.mark.parametrize("top_k,top_p,min_p,temperature", [
    (5, None, None, 1.0), (None, 0.8, None, 0.7), (None, None, 0.1, 1.3), (10, 0.9, None, 1.0),
    (20, 0.6, 0.05, 0.9), (3, 0.95, 0.2, 1.0)])
def test_reconstruction_matches_transformers_filters(top_k, top_p, min_p, temperature):
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p))
    scores = logits.clone()
    for w in warpers:
        scores = w(None, scores)
    expected = torch.isfinite(scores)
    got = sampling_support_mask(logits.unsqueeze(0), temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, order="hf")[0]
    assert torch.equal(got, expected)


def test_temperature_and_per_row_settings():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    tau = torch.tensor([0.5, 2.0])
    out = renormalized_log_probs(logits, tokens, temperature=tau)  # no truncation: full softmax
    ref = torch.log_softmax(logits / tau.view(2, 1, 1), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.log_prob, ref)
    torch.testing.assert_close(out.kept_log_mass, torch.zeros(2, 3), atol=1e-6, rtol=0)
    keep = sampling_support_mask(logits, top_k=torch.tensor([1, 7]))
    assert keep[0].sum(-1).tolist() == [1, 1, 1] and keep[1].all()


def test_neg_inf_logits_are_never_kept_and_an_impossible_token_is_minus_inf():
    logits = _logits([0.0, float("-inf"), 0.0, 1.0])
    keep = sampling_support_mask(logits, top_p=1.0)
    assert keep[0, 0].tolist() == [True, False, True, True]
    out = renormalized_log_probs(logits, torch.tensor([[1]]), top_k=3)
    assert out.log_prob.item() == float("-inf") and not bool(out.in_support.item())
    out = renormalized_log_probs(logits, torch.tensor([[3]]), top_k=3)  # -inf token does not count in k
    assert out.log_prob.item() == pytest.approx(1.0 - math.log(2 + math.e), abs=1e-6)
    assert out.kept_log_mass.item() == pytest.approx(0.0, abs=1e-6)


def test_nan_logits_give_nan_at_that_position_only_and_masked_positions_are_zero():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = float("nan")
    logits[0, 2, :] = float("nan")
    tokens = torch.tensor([[0, 1, -100]])
    mask = torch.tensor([[1, 1, 0]])
    out = renormalized_log_probs(logits, tokens, top_k=2, response_mask=mask)
    assert math.isnan(out.log_prob[0, 0].item())
    # four equal logits: all tie with the 2nd largest, so all are kept
    assert out.log_prob[0, 1].item() == pytest.approx(math.log(0.25), abs=1e-6)
    for field in (out.log_prob, out.full_log_prob, out.kept_log_mass):
        assert field[0, 2].item() == 0.0
    assert bool(out.in_support[0, 2])


def test_sampled_token_outside_the_kept_set():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().reshape(1, 1, 4)
    tokens = torch.tensor([[2]])
    with pytest.raises(ValueError, match=r"position \(0, 0\) is outside the kept support"):
        renormalized_log_probs(logits, tokens, top_k=2, outside_support="raise")
    out = renormalized_log_probs(logits, tokens, top_k=2)  # include: S = {0, 1, 2}
    assert not bool(out.in_support.item())
    assert out.log_prob.item() == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    kept = torch.tensor([[[True, True, False, False]]])
    with pytest.raises(ValueError, match="outside the kept support"):
        renormalized_log_probs(logits, tokens, kept_mask=kept, outside_support="raise")
    metrics = support_metrics(out)
    assert metrics["rollout_corr/support_outside_fraction"].item() == 1.0
    assert metrics["rollout_corr/support_kept_mass_mean"].item() == pytest.approx(0.95, abs=1e-6)


def test_bad_arguments_are_named():
    logits = torch.zeros(1, 2, 5)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        renormalized_log_probs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        sampling_support_mask(logits, top_p=0.0)
    with pytest.raises(ValueError, match="min_p must be in"):
        sampling_support_mask(logits, min_p=1.5)
    with pytest.raises(ValueError, match="pass one of kept_mask, kept_ids .* got kept_mask, top_k"):
        renormalized_log_probs(logits, tokens, kept_mask=torch.ones(1, 2, 5, dtype=torch.bool), top_k=2)
    with pytest.raises(ValueError, match=r"kept_mask has shape \(1, 2, 4\) but logits have shape \(1, 2, 5\)"):
        renormalized_log_probs(logits, tokens, kept_mask=torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"token id 5 at position \(0, 1\) is outside the vocabulary"):
        renormalized_log_probs(logits, torch.tensor([[0, 5]]))
    # The same id on a masked position is ignored.
    renormalized_log_probs(logits, torch.tensor([[0, 5]]), response_mask=torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match=r"tokens has shape \(2, 1\)"):
        renormalized_log_probs(logits, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        renormalized_log_probs(logits, tokens.float())
    with pytest.raises(ValueError, match="top_k must be a scalar or have a leading shape"):
        sampling_support_mask(logits, top_k=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="order must be one of"):
        sampling_support_mask(logits, top_k=2, order="tgi")


def test_empty_batches_and_low_precision():
    for shape in [(0, 3, 5), (2, 0, 5)]:
        out = renormalized_log_probs(torch.zeros(shape), torch.zeros(shape[:2], dtype=torch.long), top_k=2)
        assert out.log_prob.shape == shape[:2]
    logits = torch.randn(2, 3, 9).to(torch.bfloat16)
    out = renormalized_log_probs(logits, torch.zeros(2, 3, dtype=torch.long), top_p=0.5)
    assert out.log_prob.dtype == torch.float32 and torch.isfinite(out.log_prob).all()


def test_gradient_is_finite_with_minus_inf_logits_and_matches_a_direct_formula():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 4, 6, generator=g)
    base[0, 0, 5] = float("-inf")
    base[1, 2, :5] = float("-inf")  # only one finite logit left
    tokens = torch.randint(0, 5, (2, 4), generator=g)
    tokens[1, 2] = 5
    tokens[0, 1] = 0
    base[0, 1, 0] = float("-inf")  # an impossible sampled token
    kept = torch.rand(2, 4, 6, generator=g) < 0.6
    logits = base.clone().requires_grad_(True)
    out = renormalized_log_probs(logits, tokens, kept_mask=kept, temperature=0.9)
    valid = torch.isfinite(out.log_prob)
    assert valid.sum() == 7  # everything except the impossible token
    torch.where(valid, out.log_prob, 0.0).sum().backward()
    assert torch.isfinite(logits.grad).all()
    ref_logits = base.clone().requires_grad_(True)
    z = ref_logits / 0.9
    keep = kept.scatter(-1, tokens.unsqueeze(-1), True) & torch.isfinite(base)
    ref = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z.masked_fill(~keep, float("-inf")), -1)
    torch.where(valid, ref, 0.0).sum().backward()
    torch.testing.assert_close(out.log_prob[valid], ref[valid].detach())
    torch.testing.assert_close(logits.grad, torch.nan_to_num(ref_logits.grad, nan=0.0))


# --- kept ids (slime's replay format) ------------------------------------------------------------

def _dense(kept_ids, vocab):
    """The kept mask a (B, T, k) id tensor padded with -1 stands for (the reference path)."""
    mask = torch.zeros(*kept_ids.shape[:2], vocab + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(kept_ids < 0, vocab, kept_ids), True)
    return mask[..., :vocab]


def test_kept_ids_by_hand_padding_and_repeats_count_once():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().reshape(1, 1, 4)
    for ids in ([[[0, 1, -1, -1]]], [[[1, -1, 0, 1]]]):
        out = renormalized_log_probs(logits, torch.tensor([[1]]), kept_ids=torch.tensor(ids))
        assert out.log_prob.item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
        assert out.kept_log_mass.item() == pytest.approx(math.log(0.8), abs=1e-6)
        assert out.full_log_prob.item() == pytest.approx(math.log(0.3), abs=1e-6)
        assert bool(out.in_support.item())
    # The sampled token 2 is not among the kept ids: added (S = {0, 1, 2}) or refused.
    ids = torch.tensor([[[0, 1, -1]]])
    out = renormalized_log_probs(logits, torch.tensor([[2]]), kept_ids=ids)
    assert out.log_prob.item() == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    assert not bool(out.in_support.item())
    with pytest.raises(ValueError, match=r"sampled token 2 at position \(0, 0\) is outside the kept support"):
        renormalized_log_probs(logits, torch.tensor([[2]]), kept_ids=ids, outside_support="raise")
    # Only padding: S is the sampled token alone.
    out = renormalized_log_probs(logits, torch.tensor([[3]]), kept_ids=torch.full((1, 1, 2), -1))
    assert out.log_prob.item() == pytest.approx(0.0, abs=1e-6)
    assert out.kept_log_mass.item() == pytest.approx(math.log(0.05), abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 7), vocab=st.integers(2, 9),
       temperature=st.sampled_from([1.0, 0.7]), outside=st.sampled_from(["include", "raise"]))
def test_kept_ids_equal_the_dense_kept_mask_path(seed, k, vocab, temperature, outside):
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 3
    base = torch.randn(B, T, vocab, generator=g) * 3
    specials = torch.rand(B, T, vocab, generator=g)
    base[specials < 0.1] = float("-inf")
    base[0, 2, 0] = float("nan") if seed % 3 == 0 else base[0, 2, 0]
    kept_ids = torch.randint(-1, vocab, (B, T, k), generator=g)
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    if outside == "raise":  # every sampled token among the kept ids
        kept_ids[..., 0] = tokens
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    a_logits = base.clone().requires_grad_(True)
    b_logits = base.clone().requires_grad_(True)

    def call(logits, **kept):
        try:
            return renormalized_log_probs(logits, tokens, temperature=temperature, response_mask=mask,
                                          outside_support=outside, **kept)
        except ValueError as e:  # "raise": a sampled token with a −inf logit is outside both ways
            return str(e)

    a = call(a_logits, kept_ids=kept_ids)
    b = call(b_logits, kept_mask=_dense(kept_ids, vocab))
    if isinstance(b, str):
        assert a == b and outside == "raise"
        return
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.in_support, b.in_support)
    finite = torch.isfinite(a.log_prob) & torch.isfinite(a.kept_log_mass)
    torch.where(finite, a.log_prob + a.kept_log_mass, 0.0).sum().backward()
    torch.where(finite, b.log_prob + b.kept_log_mass, 0.0).sum().backward()
    assert torch.isfinite(a_logits.grad).all()
    torch.testing.assert_close(a_logits.grad, b_logits.grad, atol=1e-5, rtol=1e-5)


class _Allocations(TorchDispatchMode):
    """The dtype and size of every tensor an ATen call returns."""

    def __init__(self):
        super().__init__()
        self.out = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in (result if isinstance(result, (tuple, list)) else (result,)):
            if isinstance(t, torch.Tensor):
                self.out.append((str(func), t.dtype, t.numel()))
        return result


def test_kept_ids_build_no_vocabulary_sized_mask():
    B, T, V, k = 2, 3, 1000, 4
    logits = torch.randn(B, T, V)
    kept_ids = torch.randint(-1, V, (B, T, k))
    tokens = kept_ids[..., 0].clamp(min=0)
    with _Allocations() as sparse:
        renormalized_log_probs(logits, tokens, kept_ids=kept_ids)
    with _Allocations() as dense:
        renormalized_log_probs(logits, tokens, kept_mask=_dense(kept_ids, V))
    big = lambda allocations: [(f, d) for f, d, n in allocations.out if n >= B * T * V]  # noqa: E731
    assert any(d == torch.bool for _, d in big(dense))  # the check sees the dense path's masks
    assert all(d.is_floating_point for _, d in big(sparse)), big(sparse)
    # one (B, T, V) allocation: the scaled float32 copy of the logits (then zeroed in place where broken)
    assert [f for f, _ in big(sparse)] == ["aten.div.Tensor", "aten.masked_fill_.Scalar"], big(sparse)


def test_kept_ids_bad_input_names_kept_ids():
    logits = torch.zeros(1, 2, 5)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    for ids, err in [(torch.zeros(1, 2, 3), TypeError), (torch.zeros(1, 2, 3, dtype=torch.bool), TypeError),
                     ([[[0]]], TypeError), (torch.zeros(1, 2, dtype=torch.long), ValueError),
                     (torch.zeros(2, 2, 3, dtype=torch.long), ValueError),
                     (torch.tensor([[[0, 5]], [[0, 1]]]).reshape(1, 2, 2), ValueError),
                     (torch.tensor([[[0, -2], [0, 1]]]), ValueError)]:
        with pytest.raises(err, match="kept_ids"):
            renormalized_log_probs(logits, tokens, kept_ids=ids)
    with pytest.raises(ValueError, match=r"kept_ids holds id 5 at \(0, 0, 1\), outside the vocabulary \[0, 5\)"):
        renormalized_log_probs(logits, tokens, kept_ids=torch.tensor([[[0, 5], [0, 1]]]))
    ids = torch.zeros(1, 2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="got kept_mask, kept_ids"):
        renormalized_log_probs(logits, tokens, kept_ids=ids, kept_mask=torch.ones(1, 2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="got kept_ids, top_p"):
        renormalized_log_probs(logits, tokens, kept_ids=ids, top_p=0.9)


# --- a real sampling loop --------------------------------------------------------------------------

def _tiny_lm(seed, vocab=48, sharpen=12.0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is nearly uniform; sharpen it so top-p has work to do
        model.lm_head.weight.mul_(sharpen)
    return model


def _sample(model, batch, new_tokens, seed, **sampling):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 3), generator=g)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **sampling)
    scores = torch.stack(out.scores, 1)  # the engine's processed (truncated, tempered) scores
    tokens = out.sequences[:, prompt.shape[1]:]
    processed = torch.log_softmax(scores, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return out.sequences, tokens, processed, torch.isfinite(scores)


def _trainer_logits(model, sequences, new_tokens):
    with torch.no_grad():
        logits = model(sequences).logits
    return logits[:, -new_tokens - 1:-1]


SAMPLING = dict(top_k=12, top_p=0.8, temperature=0.9)


def test_sampling_loop_same_weights_raw_ratio_is_the_kept_mass_renormalised_is_one():
    model = _tiny_lm(0)
    seqs, tokens, processed, engine_kept = _sample(model, 16, 12, seed=1, **SAMPLING)
    logits = _trainer_logits(model, seqs, 12)
    out = renormalized_log_probs(logits, tokens, order="hf", **SAMPLING)
    # The reconstruction on trainer logits finds the engine's kept set.
    assert torch.equal(sampling_support_mask(logits, order="hf", **SAMPLING), engine_kept)
    raw = out.full_log_prob - processed
    fixed = out.log_prob - processed
    assert raw.exp().mean() < 0.9  # the naive ratio is visibly biased ...
    torch.testing.assert_close(raw, out.kept_log_mass, atol=2e-5, rtol=0)  # ... by exactly log Z
    assert fixed.abs().max() < 2e-5
    exact = renormalized_log_probs(logits, tokens, kept_mask=engine_kept, temperature=0.9)
    torch.testing.assert_close(exact.log_prob, out.log_prob)


def test_sampling_loop_mismatched_engine_renormalised_ratio_is_unbiased():
    """A sampler with perturbed weights: E_q[p_S/q_S] = 1, E_q[p/q_S] = E[Z_p(S)] < 1."""
    trainer = _tiny_lm(0)
    sampler = _tiny_lm(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        sampler.lm_head.weight.add_(0.4 * torch.randn(sampler.lm_head.weight.shape, generator=g))
    seqs, tokens, processed, engine_kept = _sample(sampler, 96, 16, seed=2, **SAMPLING)
    logits = _trainer_logits(trainer, seqs, 16)
    out = renormalized_log_probs(logits, tokens, kept_mask=engine_kept, temperature=0.9)
    fixed = (out.log_prob - processed).exp().flatten()
    raw = (out.full_log_prob - processed).exp().flatten()
    mass = out.kept_log_mass.exp().flatten()
    n = fixed.numel()
    assert (fixed - processed.new_ones(n)).abs().mean() > 0.02  # the engines really differ
    se_fixed = fixed.std() / math.sqrt(n)
    assert abs(fixed.mean().item() - 1.0) < 4 * se_fixed.item() + 1e-3
    se_raw = (raw - mass).std() / math.sqrt(n)
    assert abs(raw.mean().item() - mass.mean().item()) < 4 * se_raw.item() + 1e-3
    assert raw.mean() < 0.9 and abs(raw.mean().item() - 1.0) > 10 * se_fixed.item()
