"""HealthMonitorCallback inside a real ``transformers.Trainer`` loop on CPU (tiny Llama, 40 steps),
reporting to TensorBoard through the Trainer's own TensorBoardCallback.

The trainer is an RL-style ``Trainer`` subclass that logs ``rollout_corr/*`` metrics the way TRL's
trainers do (metrics gathered during the step, merged into ``log``). Its "rollout engine" log-probs
are the trainer's own shifted by a known δ per token, so every metric is known in closed form:
δ = 0.01 up to step 25 and 0.05 after, i.e. |k1| = δ.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rollout_correction import compute_offpolicy_metrics, metrics_to_floats  # noqa: E402
from rollout_correction.monitor import HealthMonitor, read_history  # noqa: E402
from rollout_correction.monitor.callback import HealthMonitorCallback  # noqa: E402

P = "rollout_corr/"


def _delta(step: int) -> float:
    return 0.01 if step <= 25 else 0.05


class ToyRLTrainer(transformers.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rc_metrics: dict[str, float] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        logits = model(input_ids=ids).logits[:, :-1].float()
        log_prob = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = torch.ones_like(log_prob)
        # this step will be logged as global_step + 1
        rollout_log_prob = log_prob.detach() - _delta(self.state.global_step + 1)
        self._rc_metrics = metrics_to_floats(compute_offpolicy_metrics(log_prob.detach(), rollout_log_prob, mask))
        loss = -(log_prob * mask).mean()
        return (loss, None) if return_outputs else loss

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log: add this step's correction metrics (as TRL does)
            logs = {**logs, **self._rc_metrics}
        super().log(logs, start_time)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 16, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def test_callback_in_a_trainer_loop_reports_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=40, per_device_train_batch_size=8, logging_steps=1,
        report_to=["tensorboard"], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, disable_tqdm=True, learning_rate=1e-3)
    trainer = ToyRLTrainer(model=model, args=args, train_dataset=Tokens())
    cb = HealthMonitorCallback(HealthMonitor(trend_factor=2.0, window=10), save_path="health.jsonl").add_to(trainer)
    assert trainer.callback_handler.callbacks[0] is cb
    trainer.train()

    mon = cb.monitor
    steps = [h["step"] for h in mon.history]
    assert steps == list(range(1, 41))  # one entry per training log, not the final summary log
    assert [h[P + "kl"] for h in mon.history] == pytest.approx([-_delta(s) for s in steps], rel=1e-5)
    # F = 2, W = 10: baseline steps 1–20 (|k1| = 0.01); δ = 0.05 from step 26; 5 of the last 10
    # values are high at step 30 (median 0.03 > 2 × 0.01); D = 5 consecutive steps -> step 34
    first = {}
    for a in mon.alerts:
        first.setdefault(a.name, a.step)
    assert first["kl_rising"] == 34
    assert min(first.values()) == 34 and all(a.kind == "trend" for a in mon.alerts)

    # the health numbers reached the Trainer's own TensorBoard reporter at the right steps
    tb = dict(read_history(tmp_path / "out", "tensorboard"))  # the run folder under out/
    assert tb[33]["train/rollout_corr/health/kl_rising"] == 0.0
    assert tb[34]["train/rollout_corr/health/kl_rising"] == 1.0
    assert tb[34]["train/rollout_corr/health/status"] == 1.0
    assert tb[40]["train/rollout_corr/health/alerts"] == float(len(mon.alerts))
    # ...and replaying what TensorBoard recorded gives the same alerts (float32 values)
    replay = HealthMonitor(log_alerts=False, trend_factor=2.0, window=10)
    replay.replay(sorted(tb.items()))
    assert [(a.name, a.step) for a in replay.alerts] == [(a.name, a.step) for a in mon.alerts]
    # the history file written at the end of training
    saved = HealthMonitor.load(tmp_path / "out" / "health.jsonl")
    assert saved.alerts == mon.alerts
    assert math.isclose(saved.history[-1][P + "kl"], -0.05, rel_tol=1e-5)


def test_callback_in_trls_grpo_trainer_with_the_adapter(tmp_path):
    """TRL's real GRPOTrainer (through this library's adapter) logs rollout_corr/* metrics each
    step; the callback feeds each of those logs to the monitor, at the step TRL logged it."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rollout_correction.integrations.trl import RolloutCorrectionGRPOTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(97 + i): i + 2 for i in range(12)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", max_steps=3,
                          max_completion_length=8, logging_steps=1, bf16=False, disable_tqdm=True)
    trainer = RolloutCorrectionGRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [float(len(set(c))) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": ["abc", "def", "ghi", "jkl", "bad", "cab", "fed", "hig"]}),
        processing_class=tokenizer, rollout_correction="decoupled_token_is")
    cb = HealthMonitorCallback().add_to(trainer)
    trainer.train()
    logged = [e for e in trainer.state.log_history if P + "kl" in e]
    assert [h["step"] for h in cb.monitor.history] == [e["step"] for e in logged] == [1, 2, 3]
    for h, e in zip(cb.monitor.history, logged):
        for key in (P + "kl", P + "rollout_is_eff_sample_size", P + "chi2_token"):
            assert h[key] == pytest.approx(e[key])
