"""`rollout-correction diagnose`: readers in every format and layout, streamed numbers against the
core computed on the whole batch, and statistics against direct numpy computations."""

import json
import math
import zipfile

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from rollout_correction import compute_offpolicy_metrics, compute_rollout_correction, metrics_to_floats
from rollout_correction import RolloutCorrectionConfig
from rollout_correction.diagnose import Columns, diagnose_file, diagnose_tensors, iter_chunks
from rollout_correction.diagnose.histograms import Histogram, KeyedSums, key_bin_edges

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------- data


def make_rows(n=37, t_max=23, seed=0, noise=0.05):
    """Ragged rows: lengths 0..t_max (one empty row), rollout log-probs ≤ 0, trainer = rollout + noise."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t_max + 1, size=n)
    lengths[3] = 0
    lengths[5] = t_max
    roll = [(-rng.exponential(1.0, size=L)).astype(np.float32) for L in lengths]
    old = [np.minimum(r + noise * rng.standard_normal(L), 0.0).astype(np.float32) for r, L in zip(roll, lengths)]
    ids = [rng.integers(0, 50, size=L) for L in lengths]
    rewards = rng.random(n)
    versions = rng.integers(0, 3, size=n)
    return dict(old=old, roll=roll, lengths=lengths, ids=ids, rewards=rewards, versions=versions)


def padded(rows, width=None, pad_value=0.0):
    lengths = rows["lengths"]
    T = width or int(lengths.max())
    B = len(lengths)
    old = np.full((B, T), pad_value, np.float32)
    roll = np.full((B, T), pad_value, np.float32)
    ids = np.zeros((B, T), np.int64)
    mask = np.zeros((B, T), np.float32)
    for i, L in enumerate(lengths):
        old[i, :L], roll[i, :L], ids[i, :L], mask[i, :L] = rows["old"][i], rows["roll"][i], rows["ids"][i], 1
    return old, roll, mask, ids


def reference(rows):
    old, roll, mask, _ = padded(rows)
    return metrics_to_floats(compute_offpolicy_metrics(torch.from_numpy(old), torch.from_numpy(roll),
                                                       torch.from_numpy(mask)))


def write_parquet_ragged(rows, path):
    pq.write_table(pa.table({
        "rollout_log_probs": pa.array([r.tolist() for r in rows["roll"]], type=pa.list_(pa.float32())),
        "old_log_probs": pa.array([o.tolist() for o in rows["old"]], type=pa.list_(pa.float64())),
        "responses": pa.array([i.tolist() for i in rows["ids"]], type=pa.list_(pa.int64())),
        "reward": pa.array(rows["rewards"]),
        "policy_version": pa.array(rows["versions"]),
    }), path, row_group_size=8)


def write_parquet_padded(rows, path):
    old, roll, mask, _ = padded(rows, width=30, pad_value=-7.0)  # padding values must not matter
    old[~mask.astype(bool)] = np.nan
    pq.write_table(pa.table({
        "rollout_log_probs": pa.array(list(roll), type=pa.list_(pa.float32(), 30)),  # fixed-size lists
        "old_log_probs": pa.array(list(old), type=pa.list_(pa.float32(), 30)),
        "response_mask": pa.array(list(mask.astype(bool)), type=pa.list_(pa.bool_(), 30)),
    }), path, row_group_size=5)


def write_parquet_lengths(rows, path):
    old, roll, _, _ = padded(rows, width=25, pad_value=-3.0)
    pq.write_table(pa.table({
        "rollout_log_probs": [r.tolist() for r in roll], "old_log_probs": [o.tolist() for o in old],
        "response_length": rows["lengths"],
    }), path)


def write_jsonl_ragged(rows, path):
    with open(path, "w") as fh:
        for i in range(len(rows["lengths"])):
            fh.write(json.dumps({"rollout_log_probs": rows["roll"][i].tolist(), "old_log_probs": rows["old"][i].tolist(),
                                 "reward": float(rows["rewards"][i]), "policy_version": int(rows["versions"][i]),
                                 "prompt": "ignored"}) + "\n")


def write_jsonl_padded(rows, path):
    old, roll, mask, _ = padded(rows, width=26, pad_value=-1.0)
    with open(path, "w") as fh:
        for i in range(len(rows["lengths"])):
            fh.write(json.dumps({"rollout_log_probs": roll[i].tolist(), "old_log_probs": old[i].tolist(),
                                 "response_mask": mask[i].astype(int).tolist()}) + "\n")
            if i == 4:
                fh.write("\n")  # blank lines are skipped


def write_pt_padded(rows, path):
    old, roll, mask, ids = padded(rows)
    torch.save({"rollout_log_probs": torch.from_numpy(roll).to(torch.bfloat16).float(),
                "old_log_probs": torch.from_numpy(old).double(), "response_mask": torch.from_numpy(mask).bool(),
                "responses": torch.from_numpy(ids)}, path)


def write_pt_ragged(rows, path):
    torch.save({"rollout_log_probs": [torch.from_numpy(r) for r in rows["roll"]],
                "old_log_probs": [o.tolist() for o in rows["old"]],
                "reward": torch.from_numpy(rows["rewards"])}, path)


def write_pt_flat(rows, path):
    torch.save({"rollout_log_probs": torch.from_numpy(np.concatenate(rows["roll"])),
                "old_log_probs": torch.from_numpy(np.concatenate(rows["old"])),
                "response_length": torch.from_numpy(rows["lengths"])}, path)


def write_npz_padded(rows, path, compressed):
    old, roll, mask, _ = padded(rows, width=24)
    (np.savez_compressed if compressed else np.savez)(path, rollout_log_probs=roll, old_log_probs=old,
                                                       response_mask=mask.astype(np.int8))


def write_npz_flat(rows, path):
    np.savez(path, rollout_log_probs=np.concatenate(rows["roll"]), old_log_probs=np.concatenate(rows["old"]),
             response_length=rows["lengths"], responses=np.concatenate(rows["ids"]))


WRITERS = {
    "parquet_ragged.parquet": write_parquet_ragged,
    "parquet_padded.parquet": write_parquet_padded,
    "parquet_lengths.parquet": write_parquet_lengths,
    "jsonl_ragged.jsonl": write_jsonl_ragged,
    "jsonl_padded.jsonl": write_jsonl_padded,
    "pt_padded.pt": write_pt_padded,
    "pt_ragged.pt": write_pt_ragged,
    "pt_flat.pt": write_pt_flat,
    "npz_padded.npz": lambda r, p: write_npz_padded(r, p, compressed=False),
    "npz_padded_compressed.npz": lambda r, p: write_npz_padded(r, p, compressed=True),
    "npz_flat.npz": write_npz_flat,
}


# ---------------------------------------------------------------------------------------- readers


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("chunk_rows", [1, 6, 1000])
def test_every_format_streams_the_same_rows(tmp_path, name, chunk_rows):
    rows = make_rows()
    path = str(tmp_path / name)
    WRITERS[name](rows, path)
    chunks = list(iter_chunks(path, chunk_rows=chunk_rows))
    assert sum(c.num_rows for c in chunks) == len(rows["lengths"])
    assert all(c.num_rows <= chunk_rows for c in chunks)
    got_len = np.concatenate([c.response_mask.sum(1) for c in chunks])
    np.testing.assert_array_equal(got_len, rows["lengths"])
    i = 0
    for c in chunks:
        for b in range(c.num_rows):
            L = rows["lengths"][i]
            m = c.response_mask[b]
            assert m[:L].all() and not m[L:].any()
            np.testing.assert_allclose(c.old_log_probs[b, :L], rows["old"][i], rtol=0, atol=1e-7)
            tol = 4e-3 if name == "pt_padded.pt" else 0  # that file stores the rollout column via bf16
            np.testing.assert_allclose(c.rollout_log_probs[b, :L], rows["roll"][i], rtol=tol, atol=0)
            assert (c.old_log_probs[b, L:] == 0).all()
            i += 1


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_streamed_offpolicy_metrics_equal_the_core_on_the_whole_batch(tmp_path, name):
    rows = make_rows(seed=1)
    path = str(tmp_path / name)
    WRITERS[name](rows, path)
    if name == "pt_padded.pt":  # the file holds bf16-rounded rollout log-probs: compare with those
        rows["roll"] = [torch.from_numpy(r).to(torch.bfloat16).float().numpy() for r in rows["roll"]]
    diag = diagnose_file(path, chunk_rows=5, presets=["decoupled_seq_is_rs", "geo_rs"])
    ref = reference(rows)
    assert set(ref) <= set(diag.profile.metrics)
    for k, v in ref.items():
        assert diag.profile.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_what_if_metrics_equal_compute_rollout_correction(tmp_path):
    rows = make_rows(n=60, seed=2, noise=0.3)
    path = str(tmp_path / "r.parquet")
    write_parquet_ragged(rows, path)
    presets = ["decoupled_token_is", "decoupled_seq_is_rs", "decoupled_token_icepop", "decoupled_k3_rs_token_tis",
               "geo_mis", "bypass_pg_is"]
    diag = diagnose_file(path, chunk_rows=7, presets=presets)
    old, roll, mask, _ = padded(rows)
    old_t, roll_t, mask_t = (torch.from_numpy(x) for x in (old, roll, mask))
    valid = mask_t.bool()
    for entry in diag.profile.what_if:
        cfg = RolloutCorrectionConfig.from_preset(entry["preset"])
        out = compute_rollout_correction(old_t, roll_t, mask_t, config=cfg)
        ref = out.metrics_as_floats()
        assert set(ref) == set(entry["metrics"]), entry["preset"]
        for k, v in ref.items():
            assert entry["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (entry["preset"], k)
        # ESS of the final weights (IS weight × kept), over all valid tokens
        w = out.weights if out.weights is not None else torch.ones_like(old_t)
        wf = torch.where(out.response_mask.bool() & valid, w, 0.0).double()[valid]
        ess = float(wf.sum() ** 2 / (wf.numel() * (wf ** 2).sum())) if float((wf ** 2).sum()) > 0 else 0.0
        assert entry["ess"] == pytest.approx(ess, rel=1e-6), entry["preset"]
        assert entry["rejected_token_fraction"] == pytest.approx(ref.get("rollout_corr/rollout_rs_masked_fraction", 0.0))
    same = {e["preset"]: e["same_as"] for e in diag.profile.what_if}
    assert same["bypass_pg_is"] is None  # first of its kind here; decoupled_seq_is is not in the list
    assert same["decoupled_seq_is_rs"] is None


def test_presets_sharing_weights_and_masks_are_computed_once():
    g = torch.Generator().manual_seed(0)
    roll = -torch.rand(8, 12, generator=g)
    old = (roll + 0.1 * torch.randn(8, 12, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    diag = diagnose_tensors(old, roll, torch.ones(8, 12), presets=["decoupled_seq_is", "bypass_pg_is", "pg_is"])
    by = {e["preset"]: e for e in diag.profile.what_if}
    assert by["bypass_pg_is"]["same_as"] == "decoupled_seq_is"
    assert by["pg_is"]["same_as"] == "decoupled_seq_is"
    assert by["pg_is"]["metrics"] == by["decoupled_seq_is"]["metrics"]


def test_own_statistics_match_direct_numpy(tmp_path):
    rows = make_rows(n=50, seed=3, noise=0.2)
    path = str(tmp_path / "r.parquet")
    write_parquet_ragged(rows, path)
    res = diagnose_file(path, chunk_rows=9, presets=[]).profile
    # the log-ratio is formed in float32, as the core does; everything after that in float64
    lr = [(o - r).astype(np.float64) for o, r in zip(rows["old"], rows["roll"])]
    tok = np.concatenate(lr)
    w = np.exp(np.clip(tok, -20, 20))
    assert res.levels["token"]["n"] == tok.size
    assert res.levels["token"]["mean"] == pytest.approx(w.mean(), rel=1e-9)
    assert res.levels["token"]["std"] == pytest.approx(w.std(), rel=1e-7)
    assert res.levels["token"]["ess"] == pytest.approx(w.sum() ** 2 / (w.size * (w ** 2).sum()), rel=1e-9)
    assert res.levels["token"]["fraction_outside"] == pytest.approx(np.mean(np.abs(tok) > math.log(2)))
    s = np.array([x.sum() for x in lr if x.size])
    ws = np.exp(np.clip(s, -20, 20))
    assert res.levels["sequence"]["n"] == s.size == len(rows["lengths"]) - 1  # the empty row is left out
    assert res.levels["sequence"]["ess"] == pytest.approx(ws.sum() ** 2 / (ws.size * (ws ** 2).sum()), rel=1e-9)
    assert res.levels["sequence"]["log_std"] == pytest.approx(s.std(), rel=1e-7)
    g = np.array([x.mean() for x in lr if x.size])
    assert res.levels["geometric"]["mean"] == pytest.approx(np.exp(g).mean(), rel=1e-9)
    # by position: mean |log ρ| at position 0 and 4
    for p in (0, 4):
        vals = np.array([x[p] for x in lr if x.size > p])
        assert res.position.count[p] == vals.size
        assert res.position.mean("abs_log_ratio")[p] == pytest.approx(np.abs(vals).mean(), rel=1e-9)
    # by response length
    L = rows["lengths"][0]
    same_len = [x for x in lr if x.size == L]
    assert res.length.count[L] == len(same_len)
    assert res.length.mean("abs_seq_log_ratio")[L] == pytest.approx(np.mean([abs(x.sum()) for x in same_len]))
    # by policy version, by token id, reward correlation
    for v in range(3):
        sel = [x for x, ver in zip(lr, rows["versions"]) if ver == v]
        assert res.version[v]["tokens"] == sum(x.size for x in sel)
        assert res.version[v]["log_ratio"] == pytest.approx(sum(x.sum() for x in sel), rel=1e-9)
    ids = np.concatenate(rows["ids"])
    assert res.token.count[7] == np.sum(ids == 7)
    assert res.token.sums["log_ratio"][7] == pytest.approx(tok[ids == 7].sum(), rel=1e-9, abs=1e-12)
    keep = rows["lengths"] > 0
    corr = np.corrcoef(rows["rewards"][keep], s)[0, 1]
    assert res.extras["reward_seq_log_ratio_corr"] == pytest.approx(corr, rel=1e-6)
    # histograms hold every token / row once
    assert res.histograms["token"].total == tok.size
    assert res.histograms["sequence"].total == s.size
    assert res.linear["token"].total == tok.size


def test_rows_with_nonfinite_log_probs_are_excluded_and_counted():
    g = torch.Generator().manual_seed(4)
    roll = -torch.rand(10, 6, generator=g)
    old = (roll + 0.05 * torch.randn(10, 6, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(10, 6)
    old[2, 3] = float("nan")
    roll[7, 0] = float("-inf")
    roll[8, 5] = float("nan")
    mask[8, 5] = 0  # at a padding position: harmless
    diag = diagnose_tensors(old, roll, mask, presets=["decoupled_token_is"])
    c = diag.profile.counters
    assert c.rows_nonfinite == 2 and c.rows_used == 8 and c.tokens == 8 * 6 - 1
    ref = metrics_to_floats(compute_offpolicy_metrics(old, roll, mask))
    for k, v in ref.items():
        assert diag.profile.metrics[k] == pytest.approx(v, rel=1e-6), k
    keep = [i for i in range(10) if i not in (2, 7)]
    ref_clean = metrics_to_floats(compute_offpolicy_metrics(old[keep], roll[keep], mask[keep]))
    assert diag.profile.metrics["rollout_corr/kl"] == pytest.approx(ref_clean["rollout_corr/kl"], rel=1e-6)
    verdicts = {h.name: h.verdict for h in diag.health}
    assert verdicts["rows with NaN/inf log-probs (excluded)"] == "warn"
    assert all(math.isfinite(v) for v in diag.profile.metrics.values())


# ---------------------------------------------------------------------------------------- bad input


def test_padded_arrays_without_mask_are_refused_unless_all_valid(tmp_path):
    rows = make_rows(seed=5)
    old, roll, _, _ = padded(rows)
    path = str(tmp_path / "nomask.npz")
    np.savez(path, rollout_log_probs=roll, old_log_probs=old)
    with pytest.raises(ValueError, match="no response mask or lengths column"):
        list(iter_chunks(path))
    chunks = list(iter_chunks(path, Columns(all_valid=True)))
    assert sum(c.response_mask.sum() for c in chunks) == old.size


def test_misaligned_ragged_rows_name_the_row(tmp_path):
    path = str(tmp_path / "bad.jsonl")
    with open(path, "w") as fh:
        fh.write(json.dumps({"rollout_log_probs": [-1.0, -2.0], "old_log_probs": [-1.0, -2.0]}) + "\n")
        fh.write(json.dumps({"rollout_log_probs": [-1.0, -2.0], "old_log_probs": [-1.0]}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: 'old_log_probs' has 1 values but 'rollout_log_probs' has 2"):
        list(iter_chunks(path))


def test_missing_columns_and_bad_masks_give_clear_errors(tmp_path):
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"lp_rollout": [[-1.0]], "old_log_probs": [[-1.0]]}), path)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['rollout_log_probs'\].*lp_rollout"):
        list(iter_chunks(path))
    assert len(list(iter_chunks(path, Columns(rollout_log_probs="lp_rollout")))) == 1
    with pytest.raises(ValueError, match="'my_mask' \\(given for response_mask\\) not found"):
        list(iter_chunks(path, Columns(rollout_log_probs="lp_rollout", response_mask="my_mask")))
    path2 = str(tmp_path / "m.npz")
    np.savez(path2, rollout_log_probs=-np.ones((2, 3)), old_log_probs=-np.ones((2, 3)),
             response_mask=np.array([[1, 2, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="only 0/1"):
        list(iter_chunks(path2))
    path3 = str(tmp_path / "l.npz")
    np.savez(path3, rollout_log_probs=-np.ones((2, 3)), old_log_probs=-np.ones((2, 3)), response_length=[2, 4])
    with pytest.raises(ValueError, match=r"row 1: 'response_length' = 4 is outside \[0, 3\]"):
        list(iter_chunks(path3))
    path4 = str(tmp_path / "f.npz")
    np.savez(path4, rollout_log_probs=-np.ones(5), old_log_probs=-np.ones(5), response_length=[2, 2])
    with pytest.raises(ValueError, match="has 5 values but the lengths column sums to 4"):
        list(iter_chunks(path4))
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        list(iter_chunks(str(csv)))
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(iter_chunks(str(tmp_path / "absent.parquet")))


def test_jsonl_errors_name_the_line(tmp_path):
    path = str(tmp_path / "b.jsonl")
    with open(path, "w") as fh:
        fh.write(json.dumps({"rollout_log_probs": [-1.0], "old_log_probs": [-1.0]}) + "\n")
        fh.write("{not json\n")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        list(iter_chunks(path))
    with open(path, "w") as fh:
        fh.write(json.dumps({"rollout_log_probs": [-1.0], "old_log_probs": [-1.0]}) + "\n")
        fh.write(json.dumps({"rollout_log_probs": [-1.0]}) + "\n")
    with pytest.raises(ValueError, match="line 2: column 'old_log_probs' is missing"):
        list(iter_chunks(path))


def test_an_empty_or_fully_masked_file_is_an_error_not_nan(tmp_path):
    path = str(tmp_path / "e.npz")
    np.savez(path, rollout_log_probs=-np.ones((3, 4)), old_log_probs=-np.ones((3, 4)), response_mask=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="no valid response token"):
        diagnose_file(path, presets=[])
    path2 = str(tmp_path / "empty.parquet")
    pq.write_table(pa.table({"rollout_log_probs": pa.array([], pa.list_(pa.float32())),
                             "old_log_probs": pa.array([], pa.list_(pa.float32()))}), path2)
    with pytest.raises(ValueError, match="no rows"):
        diagnose_file(path2, presets=[])


def test_npz_members_are_memory_mapped_when_stored(tmp_path):
    from rollout_correction.diagnose.readers import _npy_stream_column

    path = str(tmp_path / "s.npz")
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.savez(path, a=arr)
    with zipfile.ZipFile(path) as zf:
        col = _npy_stream_column("a", zf, zf.getinfo("a.npy"), path)
        first = col.read(3)
        assert isinstance(first, np.memmap) or isinstance(first.base, np.memmap)
        np.testing.assert_array_equal(first, arr[:3])
        np.testing.assert_array_equal(col.read(3), arr[3:])


# ---------------------------------------------------------------------------------------- histograms


def test_histogram_bins_by_hand():
    h = Histogram(np.array([0.0, 1.0, 2.0]))
    h.update(torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, -1.0]))
    np.testing.assert_array_equal(h.counts, [3, 3])  # [0,1): 0, .5, (−1 clipped); [1,2]: 1, 1.5, (2 clipped)
    assert (h.underflow, h.overflow) == (1, 1)
    with pytest.raises(ValueError, match="finite"):
        h.update(torch.tensor([float("nan")]))


def test_histogram_does_not_depend_on_chunking():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.1
    from rollout_correction.diagnose.profile import LOG_RATIO_EDGES

    a, b = Histogram(LOG_RATIO_EDGES), Histogram(LOG_RATIO_EDGES)
    a.update(x)
    for part in x.split(37):
        b.update(part)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert a.total == 1000


def test_keyed_sums_grow_and_rebin():
    k = KeyedSums(("v",))
    k.update(np.array([0, 2, 2]), v=np.array([1.0, 2.0, 4.0]))
    k.update(np.array([5]), v=np.array([10.0]))
    np.testing.assert_array_equal(k.count[:6], [1, 0, 2, 0, 0, 1])
    assert k.mean("v")[2] == 3.0 and math.isnan(k.mean("v")[1])
    b = k.binned(np.array([0, 2, 6]))
    np.testing.assert_array_equal(b["count"], [1, 3])
    np.testing.assert_array_equal(b["v"], [1.0, 16.0])
    e = key_bin_edges(1000, n_bins=48)
    assert e[0] == 0 and e[-1] == 1001 and np.all(np.diff(e) > 0) and e.size <= 50
    np.testing.assert_array_equal(key_bin_edges(5), np.arange(7))


def test_adaptive_linear_histogram_matches_numpy_and_counts_the_outside():
    from rollout_correction.diagnose.histograms import AdaptiveLinearHistogram

    g = torch.Generator().manual_seed(1)
    warm = 0.01 * torch.randn(500, generator=g, dtype=torch.float64)
    later = torch.cat([0.01 * torch.randn(2000, generator=g, dtype=torch.float64), torch.tensor([5.0, -7.0, 1.0])])
    h = AdaptiveLinearHistogram(bins=31, warmup=400)
    h.update(warm)  # fixes the range from these values
    h.update(later.float())
    h.finish()
    e = h.hist.edges
    a = 2.0 * max(abs(float(torch.quantile(warm, 0.005))), abs(float(torch.quantile(warm, 0.995))))
    assert e[0] == pytest.approx(-a) and e[-1] == pytest.approx(a) and e.size == 32
    x = np.concatenate([warm.numpy(), later.float().double().numpy()])
    inside = x[(x >= e[0]) & (x < e[-1])]
    np.testing.assert_array_equal(h.hist.counts, np.histogram(inside, bins=e)[0])
    assert h.underflow == np.sum(x < e[0]) >= 1 and h.overflow == np.sum(x >= e[-1]) >= 2
    assert h.total == x.size


@pytest.mark.parametrize("uniform", [False, True])
def test_blocking_of_rows_does_not_change_any_number(uniform):
    from rollout_correction.diagnose.profile import MismatchProfile
    from rollout_correction.diagnose.readers import Chunk

    rows = make_rows(n=150, t_max=40, seed=6, noise=0.1)
    if uniform:
        rows["lengths"][:] = 40
        rows["old"] = [np.resize(o, 40) if o.size else np.full(40, -1.0, np.float32) for o in rows["old"]]
        rows["roll"] = [np.resize(r, 40) if r.size else np.full(40, -1.0, np.float32) for r in rows["roll"]]
        rows["ids"] = [np.resize(i, 40) if i.size else np.zeros(40, np.int64) for i in rows["ids"]]
    old, roll, mask, ids = padded(rows)
    chunk = Chunk(old, roll, mask.astype(bool), rows["rewards"], rows["versions"], ids)
    presets = ["decoupled_seq_is_rs", "decoupled_k3_rs_token_tis"]
    whole = MismatchProfile(presets, max_block_elements=10 ** 9)
    whole.update(chunk)
    split = MismatchProfile(presets, max_block_elements=200)  # a few rows per block
    split.update(chunk)
    a, b = whole.result(), split.result()
    for k, v in a.metrics.items():
        assert b.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for wa, wb in zip(a.what_if, b.what_if):
        for k, v in wa["metrics"].items():
            assert wb["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (wa["preset"], k)
        assert wb["ess"] == pytest.approx(wa["ess"], rel=1e-9)
    for level in ("token", "sequence", "geometric"):
        for k, v in a.levels[level].items():
            assert b.levels[level][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (level, k)
        np.testing.assert_array_equal(a.histograms[level].counts, b.histograms[level].counts)
    n = int(rows["lengths"].max()) + 1  # the keyed arrays grow in steps; compare the used part
    np.testing.assert_allclose(b.position.sums["abs_log_ratio"][:n], a.position.sums["abs_log_ratio"][:n],
                               rtol=1e-12)
    np.testing.assert_array_equal(b.length.count[:n], a.length.count[:n])
    assert b.length.count[n:].sum() == a.length.count[n:].sum() == 0
    assert a.version.keys() == b.version.keys()
    for v, e in a.version.items():
        assert b.version[v] == pytest.approx(e, rel=1e-12)
    for k, v in vars(a.counters).items():
        assert getattr(b.counters, k) == pytest.approx(v, rel=1e-12), k


def test_half_precision_inputs_are_widened(tmp_path):
    g = torch.Generator().manual_seed(7)
    roll = (-torch.rand(6, 9, generator=g)).to(torch.bfloat16)
    old = (roll.float() + 0.02 * torch.randn(6, 9, generator=g)).clamp(max=0).to(torch.bfloat16)
    mask = torch.ones(6, 9, dtype=torch.bool)
    ref = metrics_to_floats(compute_offpolicy_metrics(old.float(), roll.float(), mask))
    from_tensors = diagnose_tensors(old, roll, mask, presets=[])
    path = tmp_path / "half.pt"
    torch.save({"rollout_log_probs": roll, "old_log_probs": old.half(), "response_mask": mask}, path)
    old_half = old.half().float()
    ref_file = metrics_to_floats(compute_offpolicy_metrics(old_half, roll.float(), mask))
    from_file = diagnose_file(str(path), presets=[])
    for k in ref:
        assert from_tensors.profile.metrics[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
        assert from_file.profile.metrics[k] == pytest.approx(ref_file[k], rel=1e-6, abs=1e-9), k
