"""TRL: train a GRPO policy with this library's rollout correction, on CPU, in a few seconds.

    pip install "rollout-correction[trl]"        # trl>=1.16,<1.17
    python examples/integration_trl.py [--preset decoupled_seq_is_rs] [--loss-type dapo] [--steps 5]

The policy is a tiny randomly initialised Llama and the tokenizer is built in code, so nothing is
downloaded. Generation runs under bf16 autocast while the trainer computes in fp32: the sampler
and the learner genuinely differ, which is the situation rollout correction exists for. The only
lines that differ from a plain TRL script are marked ``# <-``. Every step prints what TRL logged
under ``rollout_corr/``: the proof that the correction ran.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Optional, Sequence

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

from rollout_correction.integrations.trl import TRL_LOSS_TYPES, RolloutCorrectionGRPOTrainer  # <-


def tiny_policy(seed: int = 0):
    letters = "abcdefghijkl"
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(letters)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


def distinct_letters(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def main(argv: Optional[Sequence[str]] = None) -> RolloutCorrectionGRPOTrainer:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="decoupled_seq_is_rs", help="any RolloutCorrectionConfig preset")
    parser.add_argument("--loss-type", default="dapo", choices=TRL_LOSS_TYPES, help="GRPOConfig.loss_type")
    parser.add_argument("--steps", type=int, default=5)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, tokenizer = tiny_policy()
    data = Dataset.from_dict({"prompt": ["abc", "def", "ghi", "jkl", "bad", "cab", "fed", "hig"]})
    with tempfile.TemporaryDirectory() as out:
        # GRPOConfig's defaults, except what a tiny CPU run needs; bf16=False: an fp32 learner.
        args = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                          max_completion_length=8, max_steps=opts.steps, logging_steps=1, learning_rate=5e-3,
                          loss_type=opts.loss_type, disable_tqdm=True)
        trainer = RolloutCorrectionGRPOTrainer(  # <- was: GRPOTrainer(
            model=model, reward_funcs=distinct_letters, args=args, train_dataset=data, processing_class=tokenizer,
            rollout_correction=opts.preset,          # <- preset name, dict, config, or None (TRL's own mode)
            rollout_autocast_dtype=torch.bfloat16,   # <- sample in bf16, train in fp32
        )
        trainer.train()
    for entry in trainer.state.log_history:
        if "rollout_corr/kl" in entry:
            print(f"step {entry['step']}: reward {entry['reward']:.3f}  kl(rollout‖train) {entry['rollout_corr/kl']:.2e}  "
                  f"IS mean {entry.get('rollout_corr/rollout_is_mean', float('nan')):.5f}  "
                  f"rejected tokens {entry.get('rollout_corr/rollout_rs_masked_fraction', 0.0):.3f}")
    return trainer


if __name__ == "__main__":
    main()
