"""TRL adapter, tested against the real installed ``trl`` package (pin: ``pip install trl==1.16.0``).

The training test runs TRL's own ``GRPOTrainer`` machinery end to end on CPU — dataset sampling,
HF ``generate`` (under bf16 autocast, so the sampler and the fp32 trainer really differ), reward
scoring, GRPO advantages, TRL's loss and optimizer step — with a tiny randomly initialised Llama
built from a config and a word-level tokenizer built in code (nothing from a hub).
"""

from __future__ import annotations

import math

import pytest
import torch

import trl  # CI: pip install trl==1.16.0 (see docs/integrations.md)

from datasets import Dataset  # noqa: E402  (installed with trl)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from rollout_correction.integrations.trl import (  # noqa: E402
    RolloutCorrectionGRPOTrainer,
    SamplingLogProbRecorder,
    config_from_trl_args,
    resolve_config,
)

torch.set_num_threads(1)


def _log_probs(B=6, T=7, seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2 - 0.05
    old = rollout + scale * torch.randn(B, T, generator=g)
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
    out = compute_rollout_correction(old, rollout, mask, config_from_trl_args(mode, clip_min, clip_max))
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


class _CheckedTrainer(RolloutCorrectionGRPOTrainer):
    """Records, for every loss call, TRL's loss and the same loss recomputed independently."""

    checks: list

    def _apply_rollout_correction(self, out, mode):
        base = out["advantages"].clone()
        out = super()._apply_rollout_correction(out, mode)
        out["check_base_advantages"] = base
        return out

    def _compute_loss(self, model, inputs):
        inputs = dict(inputs)
        base = inputs.pop("check_base_advantages")
        loss = super()._compute_loss(model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            logp, _, _ = self._get_per_token_logps_and_entropies(model, ids, att, inputs["completion_ids"].size(1))
        old, samp = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"]
        m = inputs["completion_mask"].bool()
        rho = torch.exp(old - samp)
        keep = m & (rho >= 0.9998) & (rho <= 1.0002)       # token_k1 band "0.9998_1.0002"
        w = torch.where(keep, rho.clamp(max=1.0), 0.0)       # token TIS at 1.0
        r = torch.exp(logp - old)
        a = base[:, None]
        per_tok = w * torch.maximum(-a * r, -a * r.clamp(1 - self.epsilon_low, 1 + self.epsilon_high))
        per_tok = torch.where(keep, per_tok, 0.0)
        expected = (per_tok.sum(-1) / keep.sum(-1).clamp(min=1)).mean()
        self.checks.append((loss.detach().clone(), expected, (rho > 1.0)[keep].any().item(), (~keep & m).any().item(),
                            keep.any().item()))
        return loss


def test_grpo_trainer_trains_with_our_weights_and_logs_our_metrics(tmp_path):
    model, tokenizer = _tiny_lm()
    before = [p.detach().clone() for p in model.parameters()]
    data = Dataset.from_dict({"prompt": ["abc", "def", "ghi", "jkl", "bad", "cab", "fed", "hig"]})

    def reward(completions, **kwargs):  # distinct letters: varies across a group
        return [float(len(set(c))) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=5e-3,
        loss_type="grpo", beta=0.0, disable_tqdm=True, seed=0, bf16=False,  # fp32 trainer, bf16 sampler
    )
    # bf16 vs fp32 moves per-token ratios by ~1e-4..1e-3 on this model: bounds that tight make both
    # the truncation and the rejection bite.
    cfg = {"rollout_is": "token", "rollout_is_threshold": 1.0, "rollout_rs": "token_k1",
           "rollout_rs_threshold": "0.9998_1.0002"}
    trainer = _CheckedTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, rollout_correction=cfg,
                              rollout_autocast_dtype=torch.bfloat16)
    trainer.checks = []
    trainer.train()

    assert len(trainer.checks) == 3
    for loss, expected, *_ in trainer.checks:
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    # The bf16 sampler really differs from the fp32 trainer: truncation and rejection both acted,
    # and tokens were left to learn from.
    assert any(c[2] for c in trainer.checks) and any(c[3] for c in trainer.checks)
    assert all(c[4] for c in trainer.checks)
    assert any(abs(float(c[0])) > 1e-6 for c in trainer.checks)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    logged = [h for h in trainer.state.log_history if "rollout_corr/rollout_is_mean" in h]
    assert len(logged) == 3
    for h in logged:
        assert 0 < h["rollout_corr/rollout_is_mean"] <= 1.0 + 1e-6
        assert math.isfinite(h["rollout_corr/kl"]) and h["rollout_corr/kl"] != 0.0
        assert 0.0 <= h["rollout_corr/rollout_rs_masked_fraction"] <= 1.0


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
           "advantages": adv.clone(), "importance_sampling_ratio": torch.full((4, 1), 7.0)}
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
         "advantages": adv.clone()}, "train")
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
             "advantages": torch.tensor([1.0, -1.0, 0.5, 2.0])}, "train")
        assert out["tool_mask"][2].sum() == 0 and torch.equal(out["tool_mask"][[0, 1, 3]], mask[[0, 1, 3]].long())
        assert torch.isfinite(out["advantages"]).all() and torch.isfinite(out["old_per_token_logps"]).all()
        assert trainer._metrics["train"]["rollout_corr/nonfinite_seq_fraction"] == [0.25]


def _apply_on_rank(rank, world, port, old, rollout, mask, adv, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = slice(rank * old.shape[0] // world, (rank + 1) * old.shape[0] // world)
        from collections import defaultdict
        from types import SimpleNamespace

        host = SimpleNamespace(rollout_correction=RolloutCorrectionConfig.decoupled_seq_is_rs(), use_vllm=False,
                               vllm_importance_sampling_correction=True,
                               _metrics={"train": defaultdict(list)})
        out = {"completion_mask": mask[rows].long(), "old_per_token_logps": old[rows],
               "sampling_per_token_logps": rollout[rows], "advantages": adv[rows].clone()}
        # The trainer's own method, on a light host object (no model is needed on this path).
        RolloutCorrectionGRPOTrainer._apply_rollout_correction(host, out, "train")
        results[rank] = ({k: v[0] for k, v in host._metrics["train"].items()}, out["advantages"])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes re-import trl/transformers: ~30-60 s on a shared box
def test_statistics_cover_all_processes():
    """Two gloo processes, each with half of a generation batch, log the metrics of the whole batch."""
    import socket

    import torch.multiprocessing as mp

    old, rollout, mask = _log_probs(B=8, T=6, scale=0.5)
    adv = torch.linspace(-1, 1, 8)
    single = {k: v[0] for k, v in _single_process_metrics(old, rollout, mask, adv).items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_apply_on_rank, args=(2, port, old, rollout, mask, adv, results), nprocs=2, join=True)
    for rank in (0, 1):
        metrics, _ = results[rank]
        for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/kl",
                    "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/chi2_seq"):
            assert metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
    both = torch.cat([results[0][1], results[1][1]])
    assert both.shape == (8, 6)


def _single_process_metrics(old, rollout, mask, adv):
    from collections import defaultdict
    from types import SimpleNamespace

    host = SimpleNamespace(rollout_correction=RolloutCorrectionConfig.decoupled_seq_is_rs(), use_vllm=False,
                           vllm_importance_sampling_correction=True, _metrics={"train": defaultdict(list)})
    RolloutCorrectionGRPOTrainer._apply_rollout_correction(
        host, {"completion_mask": mask.long(), "old_per_token_logps": old, "sampling_per_token_logps": rollout,
               "advantages": adv.clone()}, "train")
    return host._metrics["train"]
