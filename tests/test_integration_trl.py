"""TRL adapter, tested against the real installed ``trl`` package (pin: ``pip install trl==1.16.0``).

The training test runs TRL's own ``GRPOTrainer`` machinery end to end on CPU — dataset sampling,
HF ``generate`` (under bf16 autocast, so the sampler and the fp32 trainer really differ), reward
scoring, GRPO advantages, TRL's loss and optimizer step — with a tiny randomly initialised Llama
built from a config and a word-level tokenizer built in code (nothing from a hub).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import trl  # CI: pip install trl==1.16.0 (see docs/integrations.md)

from datasets import Dataset  # noqa: E402  (installed with trl)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from rollout_correction.integrations.trl import (  # noqa: E402
    SUPPORTED_TRL,
    TRL_LOSS_TYPES,
    RolloutCorrectionGRPOTrainer,
    SamplingLogProbRecorder,
    check_trl_version,
    config_from_trl_args,
    resolve_config,
)

torch.set_num_threads(1)


def _log_probs(B=6, T=7, seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2 - 0.05
    old = (rollout + scale * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(B, T)
    for i in range(B):
        mask[i, T - i % 4:] = 0
    return old, rollout, mask


@pytest.mark.parametrize("mode,clip_min,clip_max", [
    ("token_truncate", None, 1.3), ("token_truncate", 0.8, 1.3), ("token_mask", 0.8, 1.3),
    ("token_mask", None, 1.3), ("sequence_truncate", None, 1.5), ("sequence_truncate", 0.7, 1.5),
    ("sequence_mask", 0.5, 2.0),
])
def test_trl_modes_map_to_trl_formulas(mode, clip_min, clip_max):
    old, rollout, mask = _log_probs()
    out = compute_rollout_correction(old, rollout, mask, config=config_from_trl_args(mode, clip_min, clip_max))
    # TRL's definitions, written out by hand: ratio per token or product per sequence, then
    # clamp to [min, max] (truncate) or zero outside [min, max] (mask).
    diff = (old - rollout) * mask
    ratio = diff.exp() if mode.startswith("token") else diff.sum(-1, keepdim=True).exp().expand_as(diff)
    lo = -math.inf if clip_min is None else clip_min
    if mode.endswith("truncate"):
        expected = ratio.clamp(min=clip_min, max=clip_max)
    else:
        expected = torch.where((ratio >= lo) & (ratio <= clip_max), ratio, torch.zeros(()))
    expected = expected * mask
    torch.testing.assert_close(out.weights, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.response_mask, mask)  # TRL's modes never change the loss mask


def test_trl_mode_errors_name_the_option():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        config_from_trl_args("token_clip")
    with pytest.raises(ValueError, match="clip_max"):
        config_from_trl_args("token_truncate", None, None)
    with pytest.raises(TypeError, match="rollout_correction"):
        resolve_config(3.0)
    assert resolve_config("decoupled_seq_is_rs") == RolloutCorrectionConfig.decoupled_seq_is_rs()
    assert resolve_config({"rollout_is": "token"}).rollout_is == "token"


def _tiny_lm(seed=0):
    vocab = {"<pad>": 0, "<eos>": 1, **{chr(97 + i): i + 2 for i in range(12)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg), tokenizer


def test_recorder_gives_the_sampling_distribution_log_probs():
    model, tokenizer = _tiny_lm()
    model.eval()
    prompt = torch.tensor([[2, 3, 4], [5, 6, 7], [8, 9, 10]])
    torch.manual_seed(1)
    with SamplingLogProbRecorder(model) as rec:
        seqs = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                              max_new_tokens=6, pad_token_id=0, eos_token_id=1, temperature=0.7, top_k=0)
    assert "generate" not in vars(model)  # the instance wrapper is removed again
    gen = seqs[:, prompt.shape[1]:]
    lengths = [int((row == 1).nonzero()[0]) + 1 if (row == 1).any() else row.numel() for row in gen]
    # Independent: teacher-forced forward of the full sequence; log-softmax(logits / T) at the token.
    with torch.no_grad():
        logits = model(seqs).logits[:, prompt.shape[1] - 1:-1] / 0.7
    expected = torch.log_softmax(logits.float(), -1).gather(-1, gen[..., None]).squeeze(-1)
    rows = rec.per_row(lengths)
    for i, n in enumerate(lengths):
        assert len(rows[i]) == n
        torch.testing.assert_close(torch.tensor(rows[i]), expected[i, :n], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Training through TRL's own GRPOTrainer.train(), for every loss_type, with the loss recomputed
# independently over the accepted tokens only.

# Token TIS at 1.0 (weights min(ρ_t, 1)), a token band on ρ_t and a per-sequence bound on
# max_t ½(log ρ_t)². The bf16 sampler moves log ρ_t by ~1e-4..1e-3 on this model: these bounds
# reject single tokens inside kept sequences and whole sequences.
TOKEN_BAND = (0.9997, 1.0003)
SEQ_MAX_K2 = 2.5e-7
REJECTING = {"rollout_is": "token", "rollout_is_threshold": 1.0, "rollout_rs": "token_k1,seq_max_k2",
             "rollout_rs_threshold": f"{TOKEN_BAND[0]}_{TOKEN_BAND[1]},{SEQ_MAX_K2}"}
PROMPTS = ["abc", "def", "ghi", "jkl", "bad", "cab", "fed", "hig"]


def _grpo_args(tmp_path, **overrides):
    """GRPOConfig with its defaults (loss_type="dapo", beta=0, batch 8, 8 generations per prompt,
    gradient_accumulation_steps=1, ...) except what a tiny CPU run needs. bf16=False gives an fp32
    learner beside the bf16 sampler (rollout_autocast_dtype), so the two really differ."""
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=1,
                max_completion_length=8, logging_steps=1, bf16=False, disable_tqdm=True)
    return trl.GRPOConfig(**{**base, **overrides})


def distinct_letters(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def _accepted(old, sampling, completion_mask):
    """The acceptance mask of REJECTING, written out: band on ρ_t and max_t ½(log ρ_t)² per row."""
    m = completion_mask.bool()
    log_rho = torch.where(m, old - sampling, 0.0)
    rho = log_rho.exp()
    token_ok = (rho >= TOKEN_BAND[0]) & (rho <= TOKEN_BAND[1])
    row_ok = (0.5 * log_rho ** 2).amax(-1, keepdim=True) <= SEQ_MAX_K2
    return m & token_ok & row_ok


def _per_token_loss(trainer, logp, old, sampling, adv, accept):
    """TRL's per-token policy terms written out, with the IS weight w_t = min(ρ_t, 1) and the
    base (uncorrected) advantage A; 0 off the accepted tokens."""
    a = adv[:, None]
    w = torch.where(accept, (old - sampling).exp().clamp(max=1.0), 0.0)
    r = (logp - old).exp()
    lt = trainer.loss_type
    if lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        clipped = r.clamp(1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        per_tok = -torch.minimum(r * a, clipped * a) * w
    elif lt == "cispo":
        per_tok = -r.clamp(max=trainer.epsilon_high) * a * logp * w
    elif lt == "sapo":
        tau = torch.where(a > 0, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg)
        per_tok = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a * w
    elif lt == "vespo":  # VESPO: φ(w_seq), log w_seq = Σ_accepted [log r_t + log w_t]
        lo = math.log(1e-8)
        log_w = (torch.where(accept, (logp - old).clamp(-20, 20) + w.clamp(min=1e-30).log().clamp(lo, 20), 0.0)
                 .sum(-1, keepdim=True).clamp(lo, 20))
        pos = a >= 0
        k = torch.where(pos, trainer.args.vespo_k_pos, trainer.args.vespo_k_neg)
        lam = torch.where(pos, trainer.args.vespo_lambda_pos, trainer.args.vespo_lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        per_tok = -phi * a * logp
    else:
        raise AssertionError(lt)
    return torch.where(accept, per_tok, 0.0)


def _aggregate(trainer, per_tok, accept, counts, processes=1):
    """One micro-batch's share of the loss over accepted tokens only, given the generation batch's
    counts over all processes (accepted tokens, sequences with an accepted token). Summed over the
    micro-batches of the generation batch and averaged over the processes, it is: the mean over
    accepted sequences of their token mean (grpo, sapo) or token sum (luspo), the token sum over
    accepted sequences × max_completion_length (dr_grpo), the token mean over the accepted tokens
    (dapo, cispo, vespo)."""
    n_tokens, n_rows = counts
    ga = trainer.args.gradient_accumulation_steps
    lt = trainer.loss_type
    if lt in ("grpo", "sapo"):
        row_mean = per_tok.sum(-1) / accept.sum(-1).clamp(min=1)
        return processes * row_mean.sum() / n_rows
    if lt == "luspo":
        return processes * per_tok.sum() / n_rows
    if lt == "dr_grpo":
        return processes * per_tok.sum() / (n_rows * trainer.max_completion_length)
    if lt == "bnpo":  # TRL's bnpo is a token mean per micro-batch
        return per_tok.sum() / accept.sum().clamp(min=1) / ga
    return processes * per_tok.sum() / n_tokens  # dapo, cispo, vespo: the generation batch's tokens


class _CheckedTrainer(RolloutCorrectionGRPOTrainer):
    """Records, for every loss call, TRL's loss and the pieces to recompute it independently."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records, self.batches = [], []

    def _apply_rollout_correction(self, out, mode):
        trl_items = out["num_items_in_batch"].clone()
        base = out["advantages"].clone()
        out = super()._apply_rollout_correction(out, mode)
        accept = _accepted(out["old_per_token_logps"], out["sampling_per_token_logps"], out["completion_mask"])
        self.batches.append({"trl_items": int(trl_items), "items": int(out["num_items_in_batch"]),
                             "accepted": int(accept.sum()), "rows": accept.shape[0],
                             "kept_rows": int(accept.any(-1).sum()),
                             "full_rows_rejected": int((out["completion_mask"].bool().any(-1) & ~accept.any(-1)).sum()),
                             "partly_rejected": int((accept.any(-1) & (accept.sum(-1) < out["completion_mask"].sum(-1))).sum())})
        self.batch_completion_rows = int(out["completion_mask"].bool().any(-1).sum())
        self.batch_completion_mask = out["completion_mask"].float()
        out["check_base_advantages"] = base
        out["check_accept"] = accept
        return out

    def _compute_loss(self, model, inputs):
        inputs = dict(inputs)
        base, accept = inputs.pop("check_base_advantages"), inputs.pop("check_accept")
        seen = []
        forward = self._get_per_token_logps_and_entropies

        def capture(*args, **kwargs):  # the log-probs (and entropies) TRL's loss is computed from
            result = forward(*args, **kwargs)
            seen.append((result[0].detach(), None if result[1] is None else result[1].detach()))
            return result

        self._get_per_token_logps_and_entropies = capture
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            del self._get_per_token_logps_and_entropies
        logp, entropies = seen[0]
        per_tok = _per_token_loss(self, logp, inputs["old_per_token_logps"], inputs["sampling_per_token_logps"],
                                  base, accept)
        kl = None
        if self.beta != 0.0:
            d = inputs["ref_per_token_logps"] - logp
            kl = torch.where(accept, d.exp() - d - 1, 0.0)
        self.records.append({"loss": loss.detach().clone(), "per_tok": per_tok, "accept": accept, "kl": kl,
                             "entropies": entropies})
        return loss


def _train(tmp_path, loss_type, config=REJECTING, model_seed=0, trainer_cls=_CheckedTrainer, **overrides):
    model, tokenizer = _tiny_lm(model_seed)
    args = _grpo_args(tmp_path, loss_type=loss_type, **overrides)
    trainer = trainer_cls(model=model, reward_funcs=distinct_letters, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                          rollout_correction=config, rollout_autocast_dtype=torch.bfloat16)
    trainer.train()
    return trainer


def _expected(trainer, record, batch, processes=1):
    counts = (batch["accepted"], batch["kept_rows"])
    per_tok = record["per_tok"]
    if record["kl"] is not None:
        per_tok = per_tok + trainer.beta * record["kl"]
    return _aggregate(trainer, per_tok, record["accept"], counts, processes)


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_every_loss_type_trains_on_the_accepted_tokens_only(tmp_path, loss_type):
    trainer = _train(tmp_path, loss_type)
    (batch,), (record,) = trainer.batches, trainer.records
    # Rejection bites: whole sequences and single tokens inside kept sequences, tokens are left.
    assert batch["full_rows_rejected"] >= 1 and batch["partly_rejected"] >= 1 and batch["kept_rows"] >= 1
    # num_items_in_batch is the accepted-token count (TRL counted every completion token).
    assert batch["items"] == batch["accepted"] < batch["trl_items"]
    expected = _expected(trainer, record, batch)
    torch.testing.assert_close(record["loss"], expected, rtol=1e-5, atol=1e-8)
    assert abs(float(expected)) > 1e-6
    # The check discriminates: the denominators TRL had before the rejection give another loss.
    stale = _aggregate(trainer, record["per_tok"], record["accept"], (batch["trl_items"], batch["rows"]))
    if loss_type != "bnpo":  # bnpo's token count comes from the loss mask itself
        assert abs(float(stale) - float(expected)) > 1e-3 * abs(float(expected))
    logged = [h for h in trainer.state.log_history if "rollout_corr/rollout_rs_masked_fraction" in h]
    assert len(logged) == 1 and 0 < logged[0]["rollout_corr/rollout_rs_masked_fraction"] < 1


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_gradient_accumulation_denominators_span_the_generation_batch(tmp_path, loss_type):
    """Two accumulation steps share one generation batch: each micro-batch's loss uses the whole
    batch's accepted counts, and the two add up to the loss over the accepted tokens only."""
    trainer = _train(tmp_path, loss_type, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    (batch,) = trainer.batches
    assert len(trainer.records) == 2 and batch["rows"] == 8
    assert batch["full_rows_rejected"] >= 1 and batch["items"] == batch["accepted"] < batch["trl_items"]
    for record in trainer.records:
        torch.testing.assert_close(record["loss"], _expected(trainer, record, batch), rtol=1e-5, atol=1e-8)
    total = sum(float(r["loss"]) for r in trainer.records)
    if loss_type == "dapo":  # token mean over every accepted token of the generation batch
        whole = sum(float(r["per_tok"].sum()) for r in trainer.records) / batch["accepted"]
    else:  # mean over accepted sequences of their accepted-token mean
        whole = sum(float((r["per_tok"].sum(-1) / r["accept"].sum(-1).clamp(min=1)).sum())
                    for r in trainer.records) / batch["kept_rows"]
    assert total == pytest.approx(whole, rel=1e-5)


def test_entropy_bonus_and_rows_trl_empties(tmp_path):
    """entropy_coef > 0: TRL subtracts coef × the entropy's token mean over the loss mask, hence over
    the accepted tokens. mask_truncated_completions: rows TRL itself empties stay in the sequence
    count (as in TRL); rows this library rejects leave it."""
    coef = 0.1
    trainer = _train(tmp_path, "grpo", model_seed=1, entropy_coef=coef, mask_truncated_completions=True)
    (batch,), (record,) = trainer.batches, trainer.records
    accept = record["accept"]
    emptied_by_trl = batch["rows"] - int(trainer.batch_completion_rows)
    assert emptied_by_trl >= 1 and batch["full_rows_rejected"] >= 1 and batch["kept_rows"] >= 1
    rows_counted = batch["rows"] - batch["full_rows_rejected"]
    row_mean = record["per_tok"].sum(-1) / accept.sum(-1).clamp(min=1)
    entropy = (record["entropies"] * accept).sum() / accept.sum()
    expected = row_mean.sum() / rows_counted - coef * entropy
    torch.testing.assert_close(record["loss"], expected, rtol=1e-5, atol=1e-8)
    # Discriminating: counting every valid token in the entropy mean gives another loss.
    valid = record["entropies"].new_tensor(trainer.batch_completion_mask)
    other = row_mean.sum() / rows_counted - coef * (record["entropies"] * valid).sum() / valid.sum()
    assert abs(float(other) - float(expected)) > 1e-6


def test_kl_term_gets_the_same_denominators(tmp_path):
    """beta > 0: TRL adds β·KL inside its per-token loss; it is averaged over the accepted
    sequences too. TRL loads the reference from the checkpoint the policy's config names; that
    checkpoint holds other weights here, so the KL term is not zero."""
    reference, tokenizer = _tiny_lm(seed=1)
    path = tmp_path / "reference"
    reference.save_pretrained(path)
    model, _ = _tiny_lm()
    model.config._name_or_path = str(path)
    args = _grpo_args(tmp_path, loss_type="grpo", beta=0.5)
    trainer = _CheckedTrainer(model=model, reward_funcs=distinct_letters, args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                              rollout_correction=REJECTING, rollout_autocast_dtype=torch.bfloat16)
    trainer.train()
    (batch,), (record,) = trainer.batches, trainer.records
    assert batch["full_rows_rejected"] >= 1 and batch["kept_rows"] >= 1
    assert float(record["kl"].abs().max()) > 1e-3  # the KL term is really there
    torch.testing.assert_close(record["loss"], _expected(trainer, record, batch), rtol=1e-5, atol=1e-8)
    assert trainer.beta == 0.5  # restored after each loss call


def test_disabled_correction_leaves_trls_loss_unchanged(tmp_path):
    """With nothing rejected and no weights, the trainer's loss is GRPOTrainer's own (same seed)."""
    losses, logged = [], []
    for cls, extra in ((trl.GRPOTrainer, {}), (RolloutCorrectionGRPOTrainer, {"rollout_correction": "disabled"})):
        model, tokenizer = _tiny_lm()
        trainer = cls(model=model, reward_funcs=distinct_letters, args=_grpo_args(tmp_path, loss_type="grpo"),
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer, **extra)
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
        logged.append(any(k.startswith("rollout_corr/") for h in trainer.state.log_history for k in h))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    # The documented check for "is it active": TRL itself never logs a rollout_corr/ key.
    assert logged == [False, True]


def test_the_metric_families_are_logged_through_trls_logger(tmp_path):
    """``metrics`` in the trainer's ``rollout_correction`` dict: TRL's log history holds those
    families' ``rollout_corr/...`` metrics (the raw means, not the self-normalised χ²), the loss is
    trained on the same accepted tokens as with the default families."""
    trainer = _train(tmp_path, "grpo", config={**REJECTING, "metrics": ["default", "raw"]})
    assert trainer.rollout_correction.metrics == ("default", "raw")
    (batch,), (record,) = trainer.batches, trainer.records
    torch.testing.assert_close(record["loss"], _expected(trainer, record, batch), rtol=1e-5, atol=1e-8)
    logged = {k for h in trainer.state.log_history for k in h if k.startswith("rollout_corr/")}
    assert {"rollout_corr/rollout_is_raw_mean", "rollout_corr/rollout_is_seq_raw_mean",
            "rollout_corr/rollout_rs_masked_fraction"} <= logged
    assert not any(k.endswith("_sn") or "sentinel" in k for k in logged)


def test_default_maps_trls_own_settings(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_mode="token_truncate",
                          vllm_importance_sampling_clip_max=2.5, report_to=[], use_cpu=True)
    assert resolve_config(None, args) == config_from_trl_args("token_truncate", None, 2.5)
    args.vllm_importance_sampling_correction = False
    assert resolve_config(None, args) == RolloutCorrectionConfig.disabled()


class _BypassTrainer(RolloutCorrectionGRPOTrainer):
    seen: list

    def _compute_loss(self, model, inputs):
        self.seen.append({k: inputs[k].detach().clone() for k in
                          ("old_per_token_logps", "sampling_per_token_logps", "completion_mask", "tool_mask",
                           "advantages")})
        return super()._compute_loss(model, inputs)


def test_bypass_preset_clips_against_the_sampling_log_probs(tmp_path):
    model, tokenizer = _tiny_lm(seed=1)
    data = Dataset.from_dict({"prompt": ["abc", "def", "ghi", "jkl"]})
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=6, max_steps=1, logging_steps=1, report_to=[], use_cpu=True,
                          save_strategy="no", loss_type="grpo", disable_tqdm=True, seed=0, bf16=False)
    trainer = _BypassTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                             args=args, train_dataset=data, processing_class=tokenizer,
                             rollout_correction=RolloutCorrectionConfig.bypass_ppo_clip_k3_rs(1e-7),
                             rollout_autocast_dtype=torch.bfloat16)
    trainer.seen = []
    trainer.train()
    (inputs,) = trainer.seen
    kept = inputs["tool_mask"].bool() & inputs["completion_mask"].bool()
    # π_old := π_rollout on every kept token; advantages stay per sequence (no IS weights in bypass).
    torch.testing.assert_close(inputs["old_per_token_logps"][kept], inputs["sampling_per_token_logps"][kept])
    assert inputs["advantages"].dim() == 1
    # k3 at 1e-7 per sequence is tight enough for the bf16 sampler to get some sequences rejected.
    rejected = inputs["completion_mask"].bool().any(-1) & ~kept.any(-1)
    assert rejected.any() and kept.any()


class _SeenTrainer(RolloutCorrectionGRPOTrainer):
    """Keeps each generation batch's trainer and sampling log-probs and mask as the correction gets them."""

    def _apply_rollout_correction(self, out, mode):
        mask = out["completion_mask"].clone()
        out = super()._apply_rollout_correction(out, mode)
        self.seen.append((out["old_per_token_logps"].clone(), out["sampling_per_token_logps"].clone(), mask))
        return out


def test_the_dump_option_writes_what_diagnose_reads(tmp_path):
    """``rollout_correction_dump_dir``: one file per generation batch, read back by diagnose."""
    from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
    from rollout_correction.diagnose import diagnose_file

    model, tokenizer = _tiny_lm(0)
    dump = tmp_path / "dump"
    trainer = _SeenTrainer(model=model, reward_funcs=distinct_letters, args=_grpo_args(tmp_path, max_steps=2),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                           rollout_correction=REJECTING, rollout_autocast_dtype=torch.bfloat16,
                           rollout_correction_dump_dir=str(dump))
    trainer.seen = []
    trainer.train()
    assert sorted(os.listdir(dump)) == ["step_000000.pt", "step_000001.pt"] and len(trainer.seen) == 2
    for step, (old, rollout, mask) in enumerate(trainer.seen):
        diag = diagnose_file(str(dump / f"step_{step:06d}.pt"), presets=[])
        assert diag.profile.counters.tokens == int(mask.sum()) and list(diag.profile.version) == [step]
        for name, value in metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask)).items():
            assert diag.profile.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert diagnose_file(str(dump), presets=[]).profile.counters.tokens == sum(int(m.sum()) for _, _, m in trainer.seen)


def test_with_vllm_the_weights_go_where_trl_multiplies_them(tmp_path):
    """The vLLM route (no vLLM here): TRL multiplies its loss by inputs["importance_sampling_ratio"]
    itself when use_vllm and its correction are on, so our weights must go there and the
    advantages must stay untouched."""
    model, tokenizer = _tiny_lm()
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          report_to=[], use_cpu=True, bf16=False)
    trainer = RolloutCorrectionGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                           args=args, train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}),
                                           processing_class=tokenizer, rollout_correction="decoupled_token_is")
    old, rollout, mask = _log_probs(B=4, T=5)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    out = {"completion_mask": mask.long(), "old_per_token_logps": old, "sampling_per_token_logps": rollout,
           "advantages": adv.clone(), "importance_sampling_ratio": torch.full((4, 1), 7.0),
           "num_items_in_batch": mask.sum().long()}
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    out = trainer._apply_rollout_correction(out, "train")
    expected = torch.exp(old - rollout).clamp(max=2.0) * mask
    torch.testing.assert_close(out["importance_sampling_ratio"], expected)
    assert torch.equal(out["advantages"], adv)
    assert "rollout_corr/rollout_is_mean" in trainer._metrics["train"]
    # Without vLLM the same weights are folded into the advantages instead.
    trainer.use_vllm = False
    out = trainer._apply_rollout_correction(
        {"completion_mask": mask.long(), "old_per_token_logps": old, "sampling_per_token_logps": rollout,
         "advantages": adv.clone(), "num_items_in_batch": mask.sum().long()}, "train")
    torch.testing.assert_close(out["advantages"], adv[:, None] * expected)
    assert "importance_sampling_ratio" not in out


def test_nan_sampling_log_prob_rejects_the_row_instead_of_poisoning_the_loss(tmp_path):
    """vLLM can return NaN log-probs (TRL #6166); TRL turns such a token's ratio into 1. Here the
    row is rejected: it leaves the loss mask and every tensor handed to TRL's loss stays finite."""
    model, tokenizer = _tiny_lm()
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          report_to=[], use_cpu=True, bf16=False)
    for preset in ("decoupled_seq_is", "bypass_ppo_clip"):
        trainer = RolloutCorrectionGRPOTrainer(
            model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
            train_dataset=Dataset.from_dict({"prompt": ["ab"] * 4}), processing_class=tokenizer,
            rollout_correction=preset)
        old, rollout, mask = _log_probs(B=4, T=5)
        rollout = rollout.clone()
        rollout[2, 1] = float("nan")
        out = trainer._apply_rollout_correction(
            {"completion_mask": mask.long(), "old_per_token_logps": old, "sampling_per_token_logps": rollout,
             "advantages": torch.tensor([1.0, -1.0, 0.5, 2.0]), "num_items_in_batch": mask.sum().long()}, "train")
        assert out["tool_mask"][2].sum() == 0 and torch.equal(out["tool_mask"][[0, 1, 3]], mask[[0, 1, 3]].long())
        assert torch.isfinite(out["advantages"]).all() and torch.isfinite(out["old_per_token_logps"]).all()
        assert trainer._metrics["train"]["rollout_corr/nonfinite_seq_fraction"] == [0.25]


def test_continuous_batching_path_takes_the_samplers_log_probs(tmp_path):
    """use_transformers_continuous_batching: the trainer asks generate_batch for the sampled
    tokens' log-probs; they equal the model's own log-softmax at those tokens (fp32, T = 1)."""

    class Recording(RolloutCorrectionGRPOTrainer):
        seen = []

        def _apply_rollout_correction(self, out, mode):
            # Independent: a teacher-forced forward of the same weights, before the optimizer step.
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            n = out["completion_ids"].shape[1]
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=att).logits[:, -n - 1:-1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"][..., None]).squeeze(-1)
            self.seen.append((out["sampling_per_token_logps"].clone(), expected, out["completion_mask"].bool()))
            return super()._apply_rollout_correction(out, mode)

    model, tokenizer = _tiny_lm()
    args = _grpo_args(tmp_path, use_transformers_continuous_batching=True,
                      transformers_continuous_batching_config={"num_blocks": 8, "max_batch_tokens": 64})
    trainer = Recording(model=model, reward_funcs=distinct_letters, args=args,
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
                        rollout_correction="decoupled_token_is")
    assert trainer.continuous_batching_config.return_logprobs
    trainer.train()
    ((sampling, expected, m),) = Recording.seen
    assert m.sum() > 8
    torch.testing.assert_close(sampling[m], expected[m], rtol=0, atol=1e-5)
    assert any("rollout_corr/rollout_is_mean" in h for h in trainer.state.log_history)


def test_construction_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    model, tokenizer = _tiny_lm()
    data = Dataset.from_dict({"prompt": PROMPTS})

    def build(args, **kwargs):
        return RolloutCorrectionGRPOTrainer(model=model, reward_funcs=distinct_letters, args=args,
                                            train_dataset=data, processing_class=tokenizer, **kwargs)

    # VESPO takes token-level weights only, as TRL's own VESPO (TRL's default mode is sequence_mask).
    with pytest.raises(ValueError, match="rollout_is='sequence'.*token_truncate"):
        build(_grpo_args(tmp_path, loss_type="vespo"))
    with pytest.raises(ValueError, match="rollout_is='geometric'"):
        build(_grpo_args(tmp_path, loss_type="vespo"), rollout_correction={"rollout_is": "geometric"})
    assert build(_grpo_args(tmp_path, loss_type="vespo", vllm_importance_sampling_mode="token_mask")) is not None
    # The policy loss is TRL's: this library's losses and its loss-side OPSM are not called.
    with pytest.raises(ValueError, match="loss_type='reinforce'.*GRPOConfig"):
        build(_grpo_args(tmp_path), rollout_correction="bypass_pg_is")
    with pytest.raises(ValueError, match="loss_type='gspo'.*importance_sampling_level='sequence'"):
        build(_grpo_args(tmp_path), rollout_correction={"rollout_is": "sequence", "loss_type": "gspo"})
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        build(_grpo_args(tmp_path), rollout_correction={"rollout_is": "token", "rollout_opsm_delta": 0.05})
    with pytest.raises(ValueError, match="loss_denominator='valid' is not available with TRL"):
        build(_grpo_args(tmp_path), rollout_correction={"rollout_is": "token", "loss_denominator": "valid"})
    with pytest.raises(ValueError, match="rollout_autocast_dtype"):
        build(_grpo_args(tmp_path, use_transformers_continuous_batching=True), rollout_autocast_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rollout_autocast_dtype"):  # refused before TRL looks for vLLM
        build(_grpo_args(tmp_path, use_vllm=True), rollout_autocast_dtype=torch.bfloat16)
    # Refused before TRL loads anything (here: a model path that does not exist).
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        RolloutCorrectionGRPOTrainer(str(tmp_path / "no-such-model"), distinct_letters, _grpo_args(tmp_path),
                                     rollout_correction={"rollout_is": "token", "rollout_opsm_delta": 0.05})
    with pytest.raises(ValueError, match=r"rollout_is='segment'.*TRL"):  # TRL passes no segment ids
        RolloutCorrectionGRPOTrainer(str(tmp_path / "no-such-model"), distinct_letters, _grpo_args(tmp_path),
                                     rollout_correction={"rollout_is": "segment"})
    # Outside the tested TRL range the trainer refuses, naming both versions.
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"trl>=1\.16,<1\.17.*installed trl is 1\.17\.0"):
        build(_grpo_args(tmp_path))


def test_supported_range_is_the_extras_pin():
    import pathlib
    import tomllib

    check_trl_version()  # the installed TRL is in range
    check_trl_version("1.16.4")
    for outside in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(RuntimeError, match=outside.replace(".", r"\.")):
            check_trl_version(outside)
    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["trl"] == [f"trl{SUPPORTED_TRL}"]


def _train_on_rank(rank, world, port, tmp, results):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out = {}
    for loss_type in ("dapo", "grpo"):
        trainer = _train(f"{tmp}/{loss_type}", loss_type)
        (batch,), (record,) = trainer.batches, trainer.records
        row_mean = record["per_tok"].sum(-1) / record["accept"].sum(-1).clamp(min=1)
        out[loss_type] = {**batch, "loss": float(record["loss"]), "token_sum": float(record["per_tok"].sum()),
                          "row_mean_sum": float(row_mean.sum())}
    results[rank] = out
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned processes import trl/transformers and train twice: ~30-60 s on 2 shared cores
def test_denominators_are_summed_over_processes(tmp_path):
    """Two gloo processes, each with its half of the generation batch: num_items_in_batch is the
    accepted-token count of both halves and each rank's loss uses the global counts, so that the
    average over the ranks is the loss over every accepted token (dapo) / sequence (grpo)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_train_on_rank, args=(2, port, str(tmp_path), results), nprocs=2, join=True)
    for loss_type in ("dapo", "grpo"):
        ranks = [results[r][loss_type] for r in (0, 1)]
        accepted = sum(r["accepted"] for r in ranks)
        kept = sum(r["kept_rows"] for r in ranks)
        assert all(r["items"] == accepted for r in ranks)  # gathered and summed, as TRL does
        assert all(r["trl_items"] == ranks[0]["trl_items"] > accepted for r in ranks)  # TRL's count: global too
        assert sum(r["full_rows_rejected"] for r in ranks) >= 1
        for r in ranks:
            expected = 2 * (r["token_sum"] / accepted if loss_type == "dapo" else r["row_mean_sum"] / kept)
            assert r["loss"] == pytest.approx(expected, rel=1e-5)
        whole = (sum(r["token_sum"] for r in ranks) / accepted if loss_type == "dapo"
                 else sum(r["row_mean_sum"] for r in ranks) / kept)
        assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(whole, rel=1e-5)


def _docs_section():
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    start = text.index("\n## TRL")
    return text[start:text.index("\n## ", start + 1)]


def test_the_documented_recipe_runs_as_written(tmp_path):
    """docs/integrations.md, TRL section: the install line installs the tested range, and the
    code blocks (build the trainer, train, read the rollout_corr/ keys) run as written."""
    import re

    section = _docs_section()
    (install,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert 'pip install "rollout-correction[trl]"' in install and SUPPORTED_TRL in install
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    model, tokenizer = _tiny_lm()
    namespace = {"model": model, "tokenizer": tokenizer, "reward": distinct_letters,
                 "data": Dataset.from_dict({"prompt": PROMPTS}), "grpo_config": _grpo_args(tmp_path, max_steps=2)}
    for block in blocks:
        exec(compile(block, "docs/integrations.md", "exec"), namespace)
    assert type(namespace["trainer"]) is RolloutCorrectionGRPOTrainer
    assert namespace["trainer"].rollout_correction == RolloutCorrectionConfig.from_preset("decoupled_seq_is_rs")
    assert len(namespace["logged"]) == 2  # one rollout_corr/ entry per step
    # Every loss_type the section names is TRL's list, which the trainer accepts.
    assert all(f"`{lt}`" in section for lt in TRL_LOSS_TYPES)


def test_example_script_runs(tmp_path, capsys):
    import pathlib
    import runpy

    example = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "integration_trl.py"))
    trainer = example["main"](["--steps", "2", "--loss-type", "grpo"])
    assert trainer.loss_type == "grpo"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "kl(rollout‖train)" in lines[0]


def test_evaluation_loss_uses_the_same_denominators(tmp_path):
    """trainer.evaluate(): TRL generates and scores each eval batch without splitting it; its loss
    is over the accepted tokens (dapo) / sequences (grpo) of that batch too."""
    for loss_type in ("dapo", "grpo"):
        model, tokenizer = _tiny_lm()
        data = Dataset.from_dict({"prompt": PROMPTS})
        trainer = _CheckedTrainer(model=model, reward_funcs=distinct_letters,
                                  args=_grpo_args(tmp_path / loss_type, loss_type=loss_type), train_dataset=data,
                                  eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}),  # one eval batch of 8
                                  processing_class=tokenizer, rollout_correction=REJECTING,
                                  rollout_autocast_dtype=torch.bfloat16)
        metrics = trainer.evaluate()
        (batch,), (record,) = trainer.batches, trainer.records
        assert batch["full_rows_rejected"] >= 1 and batch["items"] == batch["accepted"] < batch["trl_items"]
        torch.testing.assert_close(record["loss"], _expected(trainer, record, batch), rtol=1e-5, atol=1e-8)
        assert metrics["eval_loss"] == pytest.approx(float(record["loss"]), rel=1e-5)
        assert "eval_rollout_corr/rollout_rs_masked_fraction" in metrics


def _tiny_vlm():
    """A tiny LLaVA (vision tower + the word-level tokenizer) and its processor, built in code."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    _, tokenizer = _tiny_lm()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                       eos_token_id=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_index=len(tokenizer) - 1))
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size=16),
                               tokenizer=tokenizer, patch_size=8, image_token="<image>")
    return model, processor


def test_vision_language_model_needs_trls_old_log_probs(tmp_path):
    """Documented limit: with a processor (TRL's vision-language path) and no π_old from TRL, the
    trainer refuses at construction, naming the settings that make TRL compute it."""
    model, processor = _tiny_vlm()
    data = Dataset.from_dict({"prompt": PROMPTS})

    def build(**overrides):
        return RolloutCorrectionGRPOTrainer(model=model, reward_funcs=distinct_letters, args=_grpo_args(tmp_path, **overrides),
                                            train_dataset=data, processing_class=processor,
                                            rollout_correction="decoupled_token_is")

    with pytest.raises(ValueError, match="vision-language.*num_iterations > 1"):
        build()
    assert build(num_iterations=2)._is_vlm  # TRL computes π_old itself then: accepted


def test_custom_rollout_func_without_log_probs_is_refused_at_the_first_generation(tmp_path):
    """Documented limit: a rollout_func returning logprobs=None leaves nothing to correct against;
    the first generation raises, naming the key to return."""
    model, tokenizer = _tiny_lm()

    def rollout_func(prompts, trainer):
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [[2, 3, 1]] * len(prompts), "logprobs": None}

    trainer = RolloutCorrectionGRPOTrainer(model=model, reward_funcs=distinct_letters, args=_grpo_args(tmp_path),
                                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                           processing_class=tokenizer, rollout_func=rollout_func,
                                           rollout_correction="decoupled_token_is")
    with pytest.raises(RuntimeError, match="rollout_func must return the sampled tokens' log-probs under the key 'logprobs'"):
        trainer.train()


def _m2po_accepted(old, sampling, completion_mask, tau):
    """M2PO written out: drop the valid tokens with the largest (log ρ_t)², largest first, until the
    mean over the kept tokens is ≤ τ (a float64 walk down the sorted values)."""
    m = completion_mask.bool()
    sq = torch.where(m, (old.double() - sampling.double()) ** 2, 0.0)
    values = sorted(sq[m].tolist(), reverse=True)
    total, n, dropped = sum(values), len(values), 0
    while n and total / n > tau:
        total, n, dropped = total - values[dropped], n - 1, dropped + 1
    return m if dropped == 0 else m & (sq < values[dropped - 1])


def test_m2po_masks_over_the_whole_generation_batch(tmp_path, monkeypatch):
    """rollout_m2po_threshold acts in the scoring step over the generation batch: TRL's loss equals
    the token TIS loss over the tokens an independent M2PO walk keeps, with their count as the
    denominator (dapo, TRL's default)."""
    tau = 6e-8  # the batch mean of (log ρ_t)² is about 1.3e-7 on this model and sampler
    monkeypatch.setattr(sys.modules[__name__], "_accepted",
                        lambda old, sampling, mask: _m2po_accepted(old, sampling, mask, tau))
    config = {"rollout_is": "token", "rollout_is_threshold": 1.0, "rollout_m2po_threshold": tau}
    trainer = _train(tmp_path, "dapo", config=config)
    (batch,), (record,) = trainer.batches, trainer.records
    assert 0 < batch["accepted"] < int(trainer.batch_completion_mask.sum())  # M2PO bites, tokens are left
    assert batch["items"] == batch["accepted"]
    torch.testing.assert_close(record["loss"], _expected(trainer, record, batch), rtol=1e-5, atol=1e-8)
    logged = [h for h in trainer.state.log_history if "rollout_corr/m2po_masked_fraction" in h]
    assert len(logged) == 1 and 0 < logged[0]["rollout_corr/m2po_masked_fraction"] < 1
