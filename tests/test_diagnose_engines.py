"""`rollout-correction diagnose` on the files RL engines write, each built here by re-implementing the
engine's writer as read in its code:

* slime (THUDM/slime, main 624b824a, 2026-08-21): ``slime/observability/train_data_utils.py``
  ``save_debug_train_data`` / ``_build_dump_payload`` (``format_version`` 2: per-sample dicts under
  ``samples``, ``dp_shards``, whole-batch ``raw_reward``), and its form before commit 681b3adc
  (2026-08-12), ``torch.save({rollout_id, rank, rollout_data})``; the columns come from
  ``slime/ray/rollout.py`` (``tokens`` = prompt + response, ``response_lengths``, ``loss_masks`` and
  ``rollout_log_probs`` over the response) and the actor's ``log_probs``;
* NeMo-RL (NVIDIA-NeMo/RL, main 7ea279ab, 2026-08-22): ``nemo_rl/algorithms/grpo.py`` builds
  ``log_data`` (``token_ids``, ``token_loss_mask``, ``sample_loss_mask``, ``generation_logprobs``,
  ``prev_logprobs``, … right-padded over prompt + response) and ``nemo_rl/utils/logger.py``
  ``log_batched_dict_as_jsonl`` writes one line per row from ``make_microbatch_iterator(1)``, i.e.
  each value sliced as ``value[i:i+1]`` (a one-element list), plus ``idx``;
* prime-rl (PrimeIntellect-ai/prime-rl, main 559b4477, 2026-08-21):
  ``src/prime_rl/trainer/rl/token_export.py`` ``TokenExporter`` writes one record per sequence to
  ``token_exports/step_{step}/rank_{rank}.jsonl`` (``json.dumps(allow_nan=False)``, non-finite
  values as ``null``), every per-token column over prompt + completion;
* SkyRL (NovaSky-AI/SkyRL, main a9564572, 2026-08-21): ``skyrl/train/trainer.py`` ``dump_data``
  pickles the ``TrainingInputBatch``; ``skyrl/backends/skyrl_train/training_batch.py``
  ``TensorBatch.__reduce__`` → ``_rebuild_tensor_batch(cls, __getstate__())`` with each tensor as
  numpy bytes (``torch.save`` bytes for bfloat16); ``skyrl/train/dataset/preprocess.py``
  right-aligns the response tensors in (B, max_response); ``pad_training_input_batch`` appends
  copies of row 0 with a zero loss mask. Before Jan 2026 (commit f4b8cad8) the class had no
  ``__reduce__``: the dict items were pickled too, through torch's storage pickling.

Every file holds the same 6 responses (37 response tokens, prompts of 24 tokens); each must give
the token count and the metrics of the same data as a plain (B, T) ``.pt``.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import sys
import types

import numpy as np
import pytest
import torch

from rollout_correction.cli import main as cli_main
from rollout_correction.diagnose import Columns, diagnose_file, iter_chunks
from rollout_correction.diagnose.certify import certify_file
from rollout_correction.diagnose.report import build_blocks, render_markdown, summary_dict

torch.set_num_threads(1)

PROMPTS = [3, 5, 2, 4, 4, 6]  # 24 prompt tokens
RESPONSES = [5, 8, 4, 7, 6, 7]  # 37 response tokens
VOCAB = 50
PRESETS = ["decoupled_token_is", "decoupled_seq_is_rs"]


def responses(seed=0, noise=0.05):
    """Per row: prompt ids, response ids, rollout and trainer log-probs of the response tokens."""
    g = np.random.default_rng(seed)
    rows = []
    for p, r in zip(PROMPTS, RESPONSES):
        roll = -g.exponential(1.0, size=r).astype(np.float32)
        old = np.minimum(roll + noise * g.standard_normal(r), 0.0).astype(np.float32)
        rows.append(dict(prompt=g.integers(0, VOCAB, size=p), response=g.integers(0, VOCAB, size=r),
                         roll=roll, old=old, reward=float(g.random())))
    return rows


def write_plain(rows, path, valid=None):
    """The same data as (B, T) tensors over the response, ``valid`` the response tokens that count."""
    T = max(len(r["roll"]) for r in rows)
    old, roll, mask = torch.zeros(len(rows), T), torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        n = len(r["roll"])
        old[i, :n], roll[i, :n] = torch.from_numpy(r["old"]), torch.from_numpy(r["roll"])
        mask[i, :n] = 1 if valid is None else torch.as_tensor(valid[i], dtype=torch.float32)
    torch.save({"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask}, path)
    return path


def assert_same(got, want):
    """Same tokens, same counters, same metrics and the same tokens per response position."""
    cg, cw = got.profile.counters, want.profile.counters
    assert (cg.rows_used, cg.tokens, cg.rows_nonfinite) == (cw.rows_used, cw.tokens, cw.rows_nonfinite)
    n = max(got.profile.position.count.size, want.profile.position.count.size)
    pad = lambda a: np.pad(a, (0, n - a.size))  # noqa: E731
    np.testing.assert_array_equal(pad(got.profile.position.count), pad(want.profile.position.count))
    np.testing.assert_allclose(pad(got.profile.position.sums["abs_log_ratio"]),
                               pad(want.profile.position.sums["abs_log_ratio"]), rtol=1e-6, atol=1e-9)
    assert set(got.profile.metrics) == set(want.profile.metrics)
    for k, v in want.profile.metrics.items():
        assert got.profile.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k  # as test_diagnose.py


# ------------------------------------------------------------------------------------ slime


def slime_rollout_data(rows):
    """What slime's trainer holds for a rollout (slime/ray/rollout.py + the actor's log_probs), on CPU."""
    return {
        "tokens": [torch.from_numpy(np.concatenate([r["prompt"], r["response"]])) for r in rows],
        "response_lengths": [len(r["response"]) for r in rows],
        "total_lengths": [len(r["prompt"]) + len(r["response"]) for r in rows],
        "rewards": [r["reward"] for r in rows],
        "raw_reward": [r["reward"] for r in rows],
        "truncated": [0] * len(rows),
        "sample_indices": list(range(len(rows))),
        "rollout_ids": list(range(len(rows))),
        "loss_masks": [torch.ones(len(r["response"]), dtype=torch.int) for r in rows],
        "rollout_mask_sums": torch.tensor([float(len(r["response"])) for r in rows]),
        "rollout_log_probs": [torch.from_numpy(r["roll"]) for r in rows],
        "log_probs": [torch.from_numpy(r["old"]) for r in rows],
        "partition": list(range(len(rows))),
        "num_microbatches": [2],
        "global_batch_sizes": [len(rows)],
    }


def slime_payload_v2(rollout_data, rollout_id):
    """slime's _build_dump_payload for one DP shard (format_version 2)."""
    n = len(rollout_data["response_lengths"])
    id_columns = {"sample_indices": "sample_index", "partition": "rollout_position"}
    layout = {"rank": 0, "data_parallel_rank": 0, **{c: list(rollout_data[c]) for c in id_columns}}
    whole, per_sample = {}, {}
    for key, value in rollout_data.items():
        if key in id_columns:
            continue
        if key == "raw_reward":
            whole[key] = value
        elif key in ("micro_batch_indices", "num_microbatches", "global_batch_sizes") or not (
                (torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == n)
                or (isinstance(value, (list, tuple)) and len(value) == n)):
            layout[key] = value
        else:
            per_sample[key] = value
    samples = []
    for i in range(n):
        s = {"data_parallel_rank": 0, **{k: rollout_data[c][i] for c, k in id_columns.items()}}
        s.update({k: v[i] for k, v in per_sample.items()})
        samples.append(s)
    samples.sort(key=lambda s: s["rollout_position"])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": samples, "dp_shards": [layout],
            **whole}


def test_slime_both_layouts(tmp_path):
    rows = responses(seed=1)
    data = slime_rollout_data(rows)
    data["loss_masks"][2][1] = 0  # a masked response token (e.g. a tool output)
    valid = [m.numpy() for m in data["loss_masks"]]
    want = diagnose_file(write_plain(rows, str(tmp_path / "plain.pt"), valid), presets=PRESETS)
    new = str(tmp_path / "train_data" / "3.pt")
    os.makedirs(os.path.dirname(new))
    torch.save(slime_payload_v2(data, rollout_id=3), new)
    old = str(tmp_path / "train_3.pt")
    torch.save({"rollout_id": 3, "rank": 0, "rollout_data": data}, old)
    for path in (new, old):
        got = diagnose_file(path, presets=PRESETS, chunk_rows=4)
        assert got.source["engine"] == "slime"
        assert got.profile.counters.tokens == 36
        assert_same(got, want)
    # token ids: the response part of slime's tokens
    chunk = next(iter_chunks(new, chunk_rows=6))
    np.testing.assert_array_equal(chunk.token_ids[1, :8], rows[1]["response"])


def test_slime_context_parallel_slices_are_refused(tmp_path):
    data = slime_rollout_data(responses())
    data["log_probs"][0] = data["log_probs"][0][:3]  # a CP rank's slice (the form before Aug 2026)
    path = str(tmp_path / "0.pt")
    torch.save({"rollout_id": 0, "rank": 0, "rollout_data": data}, path)
    with pytest.raises(ValueError, match=r"sample 0: 'log_probs' has 3 values for a response of 5 tokens"):
        diagnose_file(path)


# ------------------------------------------------------------------------------------ NeMo-RL


def nemo_rl_log_data(rows, sample_mask):
    """grpo.py's log_data: right-padded (B, T) over prompt + response, as lists."""
    T = max(len(r["prompt"]) + len(r["response"]) for r in rows) + 2  # the batch pads past the longest row
    B = len(rows)
    ids, mask = np.zeros((B, T), np.int64), np.zeros((B, T), np.int64)
    gen, prev = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
    g = np.random.default_rng(9)
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        ids[i, :p + n] = np.concatenate([r["prompt"], r["response"]])
        mask[i, p:p + n] = 1  # token_loss_mask: the assistant message's tokens
        gen[i, p:p + n] = r["roll"]  # generation log-probs exist for the assistant tokens only
        prev[i, 1:p] = -g.exponential(1.0, size=p - 1)  # the trainer scores the prompt too (position 0: 0)
        prev[i, p:p + n] = r["old"]
    return {"content": [f"conversation {i}" for i in range(B)], "rewards": [r["reward"] for r in rows],
            "input_lengths": [len(r["prompt"]) + len(r["response"]) for r in rows], "token_ids": ids.tolist(),
            "token_loss_mask": mask.tolist(), "sample_loss_mask": list(sample_mask),
            "advantages": np.zeros((B, T)).tolist(), "generation_logprobs": gen.tolist(), "prev_logprobs": prev.tolist()}


def write_nemo_rl(log_data, path):
    """logger.log_batched_dict_as_jsonl: one line per row of make_microbatch_iterator(1)."""
    n = len(log_data["rewards"])
    with open(path, "w") as f:
        for i in range(n):
            sample = {k: v[i:i + 1] for k, v in log_data.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")


def test_nemo_rl_train_data_jsonl(tmp_path):
    rows = responses(seed=2)
    sample_mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # row 3 left out by its sample-level mask
    path = str(tmp_path / "train_data_step4.jsonl")
    write_nemo_rl(nemo_rl_log_data(rows, sample_mask), path)
    valid = [np.full(len(r["roll"]), m) for r, m in zip(rows, sample_mask)]
    want = diagnose_file(write_plain(rows, str(tmp_path / "plain.pt"), valid), presets=PRESETS)
    got = diagnose_file(path, presets=PRESETS, chunk_rows=4)
    assert got.source["engine"] == "nemo-rl"
    assert got.profile.counters.tokens == 37 - RESPONSES[3]
    assert_same(got, want)
    chunk = next(iter_chunks(path, chunk_rows=6))
    np.testing.assert_array_equal(chunk.token_ids[0, :5], rows[0]["response"])  # response positions


# ------------------------------------------------------------------------------------ prime-rl


def prime_rl_records(rows, step, nonfinite_row=None):
    """TokenExporter.export records: every per-token column over prompt + completion."""
    recs = []
    log_v = math.log(1.0 / VOCAB)
    g = np.random.default_rng(step)
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        trainer = np.concatenate([[log_v], -g.exponential(1.0, size=p - 1), r["old"]]).astype(np.float32)
        if i == nonfinite_row:
            trainer[p + 1] = np.nan
        inference = np.concatenate([np.zeros(p, np.float32), r["roll"]])
        floats = lambda a: [None if not math.isfinite(v) else float(v) for v in np.asarray(a, np.float32).tolist()]  # noqa: E731
        recs.append({
            "schema_version": 1, "step": step, "rank": 0, "micro_step": 0, "micro_sequence_idx": i,
            "export_sequence_idx": i, "env_name": "gsm8k",
            "token_ids": [int(t) for t in np.concatenate([r["prompt"], r["response"]])],
            "position_ids": list(range(p + n)), "loss_mask": [False] * p + [True] * n,
            "advantages": [0.0] * (p + n), "inference_logprobs": floats(inference), "trainer_logprobs": floats(trainer),
            "entropy": [0.5] * (p + n), "mismatch_kl": [None] * (p + n), "log_importance_ratio": [None] * (p + n),
            "importance_ratio": [None] * (p + n), "prob_delta": [None] * (p + n), "is_masked": [None] * (p + n),
            "is_masked_high": [None] * (p + n), "is_masked_low": [None] * (p + n), "rl_weights": [None] * (p + n),
            "ce_weights": [None] * (p + n), "ref_kl_weights": [None] * (p + n)})
    return recs


def write_prime_rl(recs, root, step, rank=0):
    path = os.path.join(root, "token_exports", f"step_{step}", f"rank_{rank}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for rec in recs:
            f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
    return path


def test_prime_rl_token_export_with_a_null(tmp_path):
    rows = responses(seed=3)
    path = write_prime_rl(prime_rl_records(rows, step=5, nonfinite_row=4), str(tmp_path), step=5)
    plain = write_plain(rows, str(tmp_path / "plain.pt"))
    data = torch.load(plain)
    data["old_log_probs"][4, 1] = float("nan")  # what the null stands for
    torch.save(data, plain)
    want = diagnose_file(plain, presets=PRESETS)
    got = diagnose_file(path, presets=PRESETS, chunk_rows=4)
    assert got.source["engine"] == "prime-rl"
    assert got.profile.counters.rows_nonfinite == 1  # the row is dropped and counted, as a NaN is
    assert got.profile.counters.tokens == 37 - RESPONSES[4]
    assert_same(got, want)


def test_prime_rl_rows_without_a_mask_are_refused_not_miscounted(tmp_path, capsys):
    rows = responses(seed=4)
    recs = prime_rl_records(rows, step=1)
    path = write_prime_rl(recs, str(tmp_path), step=1)
    # the columns named, the mask not: 61 positions (prompt included) would be counted
    code = cli_main(["diagnose", path, "--rollout-col", "inference_logprobs", "--old-col", "trainer_logprobs",
                     "--out", str(tmp_path / "r"), "--quiet"])
    assert code == 2
    assert "--mask-col loss_mask" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r" / "summary.json")
    # a record without its loss mask
    for rec in recs:
        del rec["loss_mask"]
    bare = write_prime_rl(recs, str(tmp_path / "bare"), step=1)
    code = cli_main(["diagnose", bare, "--out", str(tmp_path / "r2"), "--quiet"])
    assert code == 2
    assert "'loss_mask'" in capsys.readouterr().err
    # recognised by its keys, or named with --engine, the mask gives the response tokens
    assert diagnose_file(path, presets=[]).profile.counters.tokens == 37
    named = Columns(rollout_log_probs="inference_logprobs", old_log_probs="trainer_logprobs")
    assert diagnose_file(path, named, presets=[], engine="prime-rl").profile.counters.tokens == 37
    # the plain reader with the mask named counts the same tokens (at row positions)
    assert diagnose_file(path, Columns(**{**named.__dict__, "response_mask": "loss_mask"}),
                         presets=[]).profile.counters.tokens == 37


@pytest.mark.parametrize("fmt", ["parquet", "pt"])
def test_the_prompt_check_covers_every_ragged_reader(tmp_path, fmt):
    """The prime-rl columns copied into Parquet list columns or a .pt of per-row lists: the same refusal."""
    recs = prime_rl_records(responses(seed=4), step=1)
    cols = {k: [r[k] for r in recs] for k in ("inference_logprobs", "trainer_logprobs", "loss_mask", "token_ids")}
    path = str(tmp_path / f"rows.{fmt}")
    if fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table(cols), path)
    else:
        torch.save({k: [torch.tensor(v) for v in vals] for k, vals in cols.items()}, path)
    named = Columns(rollout_log_probs="inference_logprobs", old_log_probs="trainer_logprobs")
    with pytest.raises(ValueError, match="pass --mask-col loss_mask"):
        diagnose_file(path, named, presets=[])
    masked = Columns(**{**named.__dict__, "response_mask": "loss_mask"})
    assert diagnose_file(path, masked, presets=[]).profile.counters.tokens == 37


def test_prompt_and_completion_columns_show_the_prompt(tmp_path, capsys):
    rows = responses(seed=5)
    path = str(tmp_path / "rows.jsonl")
    with open(path, "w") as f:
        for r in rows:
            p = len(r["prompt"])
            f.write(json.dumps({"rollout_log_probs": [0.0] * p + r["roll"].tolist(),
                                "old_log_probs": [-1.0] * p + r["old"].tolist(),
                                "prompt_ids": r["prompt"].tolist(), "completion_ids": r["response"].tolist()}) + "\n")
    assert cli_main(["diagnose", path, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "'prompt_ids' + 'completion_ids'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ SkyRL


def _serialize_tensor(value):
    """training_batch._serialize_tensor: numpy bytes, torch.save bytes where numpy has no dtype."""
    try:
        arr = value.numpy()
        return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}
    except TypeError:
        buf = io.BytesIO()
        torch.save(value, buf)
        return {"format": "torch", "data": buf.getvalue()}


@pytest.fixture
def skyrl_module(monkeypatch):
    """A module at SkyRL's import path holding its TrainingInputBatch pickling (and the one before
    Jan 2026 at skyrl_train.training_batch), so that pickle writes the names SkyRL's files carry."""
    made = {}
    for name in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.training_batch",
                 "skyrl_train", "skyrl_train.training_batch"):
        made[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, made[name])
    new, old = made["skyrl.backends.skyrl_train.training_batch"], made["skyrl_train.training_batch"]

    def _rebuild_tensor_batch(cls, state):
        raise AssertionError("the reader must not call SkyRL's code")

    class TensorBatch(dict):
        metadata = None

        def __getstate__(self):
            return {"batch_dict": {k: None if v is None else _serialize_tensor(v) for k, v in self.items()},
                    "batch_size": len(next(iter(self.values()))), "device": torch.device("cpu"),
                    "metadata": self.metadata}

        def __reduce__(self):
            return (_rebuild_tensor_batch, (type(self), self.__getstate__()))

    class TrainingInputBatch(TensorBatch):
        pass

    class OldTrainingInputBatch(dict):  # no __reduce__: dict items pickled too, through torch's storage
        metadata = None
        __getstate__ = TensorBatch.__getstate__

    OldTrainingInputBatch.__name__ = "TrainingInputBatch"
    for cls, mod in ((TrainingInputBatch, new), (OldTrainingInputBatch, old)):
        cls.__module__, cls.__qualname__ = mod.__name__, "TrainingInputBatch"
        mod.TrainingInputBatch = cls
    _rebuild_tensor_batch.__module__, _rebuild_tensor_batch.__qualname__ = new.__name__, "_rebuild_tensor_batch"
    new._rebuild_tensor_batch = _rebuild_tensor_batch
    return new, old


def skyrl_batch(cls, rows, pad_size=2, bf16_old=False):
    """trainer.py's TrainingInputBatch after the forward passes: preprocess.py's right-aligned layout,
    then pad_training_input_batch (rows appended as copies of row 0, loss mask 0)."""
    B, R = len(rows), max(len(r["response"]) for r in rows)
    total = max(len(r["prompt"]) + len(r["response"]) for r in rows)
    seqs = np.zeros((B, total), np.int64)
    resp_mask, loss_mask = np.zeros((B, R), np.int64), np.zeros((B, R), np.float32)
    roll, old = np.zeros((B, R), np.float32), np.zeros((B, R), np.float32)
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        seqs[i, total - p - n:] = np.concatenate([r["prompt"], r["response"]])
        resp_mask[i, R - n:] = 1
        loss_mask[i, R - n:] = 1
        roll[i, R - n:], old[i, R - n:] = r["roll"], r["old"]
    t = {"sequences": seqs, "attention_mask": (seqs != 0).astype(np.int64), "response_mask": resp_mask,
         "loss_mask": loss_mask, "rollout_logprobs": roll, "action_log_probs": old,
         "advantages": np.zeros((B, R), np.float32)}
    batch = cls({k: torch.from_numpy(v) for k, v in t.items()})
    if bf16_old:
        batch["action_log_probs"] = batch["action_log_probs"].to(torch.bfloat16)
    batch["rollout_expert_indices"] = None
    for k, v in list(batch.items()):
        if v is not None:
            pad = v[[0] * pad_size].clone()
            batch[k] = torch.cat([v, torch.zeros_like(pad) if k == "loss_mask" else pad])
    batch.metadata = {"policy_mini_batch_boundaries": [(0, B)], "policy_prompt_boundaries": [(0, 3), (3, B)],
                      "response_length": R, "avg_response_length": 37 / 6, "pad_size": pad_size}
    return batch


def test_skyrl_training_input_pickle(tmp_path, skyrl_module):
    new, old = skyrl_module
    rows = responses(seed=6)
    want = diagnose_file(write_plain(rows, str(tmp_path / "plain.pt")), presets=PRESETS)
    for cls, name in ((new.TrainingInputBatch, "global_step_2_training_input.pkl"),
                      (old.TrainingInputBatch, "global_step_1_training_input.pkl")):
        path = str(tmp_path / "dumped_data" / name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(skyrl_batch(cls, rows), f)  # TensorBatch.save
        got = diagnose_file(path, presets=PRESETS, chunk_rows=4)
        assert got.source["engine"] == "skyrl"
        assert got.profile.counters.rows == 6 and got.profile.counters.tokens == 37  # padding rows dropped
        assert_same(got, want)
        chunk = next(iter_chunks(path, chunk_rows=6))
        np.testing.assert_array_equal(chunk.token_ids[2, :4], rows[2]["response"])  # right-aligned → positions
    # a bfloat16 column travels as torch.save bytes, read with weights_only
    path = str(tmp_path / "bf16.pkl")
    with open(path, "wb") as f:
        pickle.dump(skyrl_batch(new.TrainingInputBatch, rows, bf16_old=True), f)
    assert diagnose_file(path, presets=[]).profile.counters.tokens == 37


class _WritesAFile:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (exec, (f"open({self.target!r}, 'w').write('ran')",))


@pytest.mark.parametrize("suffix", [".pkl", ".pt"])
def test_an_arbitrary_pickle_is_refused_and_runs_no_code(tmp_path, suffix, capsys):
    target = str(tmp_path / "written_by_the_pickle")
    path = str(tmp_path / f"dump{suffix}")
    if suffix == ".pkl":
        with open(path, "wb") as f:
            pickle.dump({"batch_dict": _WritesAFile(target)}, f)
    else:
        torch.save({"rollout_log_probs": _WritesAFile(target)}, path)
    assert cli_main(["diagnose", path, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "refused" in capsys.readouterr().err
    assert not os.path.exists(target)
    with pytest.raises(ValueError, match="refused"):
        certify_file(path)
    assert not os.path.exists(target)


# ------------------------------------------------------------------------------------ folders, positions


def test_a_folder_of_dumps_is_their_concatenation(tmp_path):
    parts = [responses(seed=s) for s in (7, 8, 9)]
    root = str(tmp_path / "run")
    for step, rows in zip((1, 2, 10), parts):
        write_prime_rl(prime_rl_records(rows, step=step), root, step=step)
    allrows = [r for rows in parts for r in rows]
    want = diagnose_file(write_plain(allrows, str(tmp_path / "plain.pt")), presets=PRESETS)
    got = diagnose_file(root, presets=PRESETS, chunk_rows=5)
    assert got.profile.counters.tokens == 3 * 37
    assert_same(got, want)
    files = got.source["files"]
    assert [f["step"] for f in files] == [1, 2, 10]  # natural order: step_2 before step_10
    assert [f["tokens"] for f in files] == [37, 37, 37]
    for f, rows in zip(files, parts):
        one = diagnose_file(write_plain(rows, str(tmp_path / "one.pt")), presets=[])
        assert f["kl"] == pytest.approx(one.profile.metrics["rollout_corr/kl"], rel=1e-6)
    # a glob gives the same; the report has the per-file table
    pattern = os.path.join(root, "token_exports", "step_*", "rank_0.jsonl")
    assert diagnose_file(pattern, presets=[]).profile.counters.tokens == 3 * 37
    md = render_markdown(build_blocks(got, []))
    assert "By file" in md and "step_10" in md
    assert [e["step"] for e in summary_dict(got)["input"]["files"]] == [1, 2, 10]


def test_certify_and_positions_count_in_the_response(tmp_path):
    """NeMo-RL rows hold prompt + response: the first diverging position is the response's."""
    rows = responses(seed=10)
    for r in rows:
        r["old"] = r["roll"].copy()  # a true on-policy run ...
    rows[2]["old"][3] = rows[2]["roll"][3] - 0.25  # ... but for one token: row 2, response position 3
    path = str(tmp_path / "train_data_step1.jsonl")
    write_nemo_rl(nemo_rl_log_data(rows, [1.0] * 6), path)
    cert = certify_file(path)
    assert cert.tokens == 37 and cert.differing == 1
    assert cert.first == (2, 3)
    assert cert.largest[0]["position"] == 3
    assert len(cert.per_position) == max(RESPONSES) and cert.per_position[3][1] == 1
    diag = diagnose_file(path, presets=[])
    np.testing.assert_array_equal(diag.profile.position.count[:max(RESPONSES)],
                                  [sum(n > p for n in RESPONSES) for p in range(max(RESPONSES))])


def test_the_docs_engine_table_names_the_real_options():
    """docs/diagnose.md's engine table: every engine reader, and the adapters' dump options as the code
    spells them (read from the sources, so that no engine is imported here)."""
    import re

    from rollout_correction.diagnose.engines import ENGINES
    from rollout_correction.integrations import slime
    from rollout_correction.integrations.openrlhf import train_ppo_ray

    root = os.path.join(os.path.dirname(__file__), "..")
    page = open(os.path.join(root, "docs", "diagnose.md"), encoding="utf-8").read()
    table = page[page.index("## What your engine writes"):page.index("## Input")]
    rows = {line.split("|")[1].strip().split(" ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert {"slime", "NeMo-RL", "prime-rl", "SkyRL"} <= set(rows)
    assert set(ENGINES) == {"slime", "nemo-rl", "prime-rl", "skyrl"}
    src = os.path.join(root, "src", "rollout_correction", "integrations")
    verl_yaml = open(os.path.join(src, "verl", "config", "rollout_correction_ppo_trainer.yaml")).read()
    assert re.search(r"^trainer:\n(?:  #.*\n)*  rollout_correction_dump_dir: null", verl_yaml, re.M)
    assert "`trainer.rollout_correction_dump_dir=DIR`" in rows["verl"]
    assert f"`{train_ppo_ray.DUMP_OPTION} DIR`" in rows["OpenRLHF"]
    assert f"`{slime.DUMP_KEY}: DIR`" in table
    assert "rollout_correction_dump_dir: Optional[str] = None," in open(os.path.join(src, "trl.py")).read()
    assert "`rollout_correction_dump_dir=DIR`" in rows["TRL"]
    assert re.search(r"rollout-correction diagnose .*token_exports/", rows["prime-rl"])
