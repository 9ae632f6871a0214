"""A realistic example dump for ``rollout-correction diagnose --example``.

A small causal LM (built from a transformers config, no download) plays the policy. The demo's
rollout engine (:class:`rollout_correction.demo.engine.RolloutEngine`) holds a bf16 copy with
fake-quantised linear weights and samples the responses with its own KV-cache loop, returning
its log-probs (π_rollout); the fp32 model then recomputes the log-probs of the same tokens with
teacher forcing (π_old). The gap between the two columns is real numerics — reduced precision
and quantisation — not injected noise.

Responses end at an end-of-sequence token (so lengths vary, as in real rollouts) or at
``max_new_tokens``. The output has one row per response and the columns ``rollout_log_probs``,
``old_log_probs`` (ragged lists), ``responses`` (token ids), ``response_length``, ``reward`` (a
toy score).
"""

from __future__ import annotations

import torch

EOS = 0


def build_policy(vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 4, max_len: int = 320,
                 sharpness: float = 6.0, eos_bias: float = 2.5, seed: int = 0):
    """A freshly initialised Llama-style causal LM with peaked next-token distributions.

    A random init at the usual scale gives near-uniform predictions; scaling the (tied) embedding
    by ``sharpness`` makes the logits spread like a trained model's (entropy of a few nats), and
    lengthening the end-of-sequence embedding by ``eos_bias`` sets a typical response length.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_len, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=EOS, pad_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(sharpness)
        emb[EOS].mul_(eos_bias)
    return model.eval()


@torch.no_grad()
def teacher_forced_log_probs(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B, T) fp32 log π(yₜ | x, y<ₜ) of the response part of ``tokens`` (B, prompt_len + T)."""
    logits = model(tokens[:, :-1], use_cache=False).logits[:, prompt_len - 1:].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)


def generate_example(n_rows: int = 512, max_new_tokens: int = 256, prompt_len: int = 16,
                     precision: str = "bf16", quant: str = "int4", batch: int = 128, seed: int = 0,
                     vocab_size: int = 256) -> dict[str, list]:
    """Samples ``n_rows`` responses with the reduced-precision engine; returns ragged columns."""
    from rollout_correction.demo.engine import RolloutEngine

    policy = build_policy(vocab_size=vocab_size, max_len=prompt_len + max_new_tokens + 8, seed=seed)
    engine = RolloutEngine(policy, precision=precision, quant=quant)
    engine.sync(policy)
    gen = torch.Generator().manual_seed(seed)
    cols: dict[str, list] = {k: [] for k in ("rollout_log_probs", "old_log_probs", "responses", "response_length",
                                             "reward")}
    for start in range(0, n_rows, batch):
        b = min(batch, n_rows - start)
        prompts = torch.randint(2, vocab_size, (b, prompt_len), generator=gen)
        responses, rollout_lp = engine.generate(prompts, max_new_tokens, generator=gen)
        old_lp = teacher_forced_log_probs(policy, torch.cat([prompts, responses], dim=1), prompt_len)
        is_eos = responses == EOS
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full((b,), max_new_tokens))
        for i in range(b):
            n = int(first[i])
            cols["rollout_log_probs"].append(rollout_lp[i, :n].tolist())
            cols["old_log_probs"].append(old_lp[i, :n].tolist())
            cols["responses"].append(responses[i, :n].tolist())
            cols["response_length"].append(n)
            # A toy reward: the share of even token ids in the response.
            cols["reward"].append(float((responses[i, :n] % 2 == 0).float().mean()))
    return cols


def write_example(path: str, **kwargs) -> str:
    """Generates an example and writes it as Parquet (``.parquet``) or JSONL (``.jsonl``)."""
    cols = generate_example(**kwargs)
    if path.endswith(".jsonl"):
        import json

        keys = list(cols)
        with open(path, "w") as fh:
            for i in range(len(cols[keys[0]])):
                fh.write(json.dumps({k: cols[k][i] for k in keys}) + "\n")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "rollout_log_probs": pa.array(cols["rollout_log_probs"], type=pa.list_(pa.float32())),
        "old_log_probs": pa.array(cols["old_log_probs"], type=pa.list_(pa.float32())),
        "responses": pa.array(cols["responses"], type=pa.list_(pa.int32())),
        "response_length": pa.array(cols["response_length"], type=pa.int32()),
        "reward": pa.array(cols["reward"], type=pa.float32()),
    })
    pq.write_table(table, path)
    return path

