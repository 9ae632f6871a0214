"""ROLL's own test and ROLL's own correction function against ``rollout_correction.compat.roll``.

    python tools/roll_suite.py PATH_TO_ROLL_CHECKOUT [--batches 400] [--seed 0] [--commit SHA]

(``--commit`` names the commit of a checkout that is not a git work tree, e.g. one made with
``git archive``.)

ROLL is not on PyPI and its package needs Ray, Megatron, vLLM and more to import. Two runs, each in
a child process, from a temporary folder outside this repository; nothing of ROLL is edited or
copied here:

1. **suite** — ROLL's ``tests/agentic/test_segment_masked_mean.py``, unmodified (byte-compared with
   the checkout's), collected by pytest with a ``conftest.py`` that puts ``compat.roll`` in
   ``sys.modules`` under the name the file imports from
   (``roll.pipeline.agentic.agentic_actor_worker``): every test calls the drop-in. A control run
   puts ROLL's own ``roll.pipeline.agentic.utils`` there instead (loaded through the shim of 2).
2. **side by side** — ROLL's real ``roll/utils/train_infer_corrections.py`` (with its real
   ``roll/utils/functionals.py``, ``roll/pipeline/agentic/utils.py``, ``roll/configs/base_config.py``
   and ``roll/utils/logging.py``) against the drop-in on random batches and random configs
   (ROLL's own config dataclasses). The import shim stubs only modules these files import for
   other purposes (listed in ``STUBS``: ROLL's distributed protocol, worker / platform / pipeline
   configs, the dump helpers, ``imageio``, and the ``__init__`` of ``roll.configs``, which loads
   the model-argument classes); a stubbed name resolves to an empty placeholder class.
   Compared: is_weight and filter_mask at valid positions, and every metric; on batches with
   padding, the token shares (``is_weight_clipfrac@sum``, ``*_mask_mean@sum``) are left out, since
   ROLL counts padding positions in them (see compat/roll.py). A filter decision may differ only
   where ROLL's statistic lies within 1e-5 (relative) of the band's bound (float32 rounding).
   ROLL's ``compute_segment_masked_mean`` is compared with the drop-in's on the same number of
   random masks and values (float32 and float64).

Prints one line per run and exits non-zero on any failure. The integrator's generic peer-suite
table can call :func:`suite` and :func:`side_by_side` with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SUITE = "tests/agentic/test_segment_masked_mean.py"
MODULE = "roll.pipeline.agentic.agentic_actor_worker"
ROOT = Path(__file__).resolve().parents[1]

#: Modules the shim replaces by placeholders: imported by ROLL's correction files for other purposes.
STUBS = ("roll.configs.worker_config", "roll.platforms", "roll.utils.config_utils", "roll.utils.telemetry",
         "roll.pipeline.rlvr.rlvr_config", "roll.pipeline.rlvr.utils", "roll.pipeline.agentic.agentic_config",
         "roll.distributed", "imageio")
#: Packages whose ``__init__`` is skipped (their submodules still load from the checkout).
EMPTY_PACKAGES = ("roll.configs", "roll.pipeline.rlvr")

SHIM = textwrap.dedent('''
    """Import shim for ROLL's correction files (tools/roll_suite.py): placeholders for STUBS."""
    import importlib.abc, importlib.machinery, os, sys, types

    ROLL = os.environ["ROLL_CHECKOUT"]
    STUBS = {stubs!r}
    EMPTY_PACKAGES = {empty!r}


    class _Placeholder(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {{}})
            setattr(self, name, value)
            return value


    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if any(name == s or name.startswith(s + ".") for s in STUBS) or name in EMPTY_PACKAGES:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = _Placeholder(spec.name)
            if spec.name in EMPTY_PACKAGES:
                module.__path__ = [os.path.join(ROLL, *spec.name.split("."))]
            else:
                module.__path__ = []
            return module

        def exec_module(self, module):
            pass


    sys.meta_path.insert(0, _Finder())
    sys.path.insert(0, ROLL)
''')

CONFTEST = textwrap.dedent('''
    import sys

    if {control!r}:
        import roll_shim  # noqa: F401
        import roll.pipeline.agentic.utils as module  # ROLL's own function
    else:
        import rollout_correction.compat.roll as module
    sys.modules["{module}"] = module  # in this test process only
''')

SIDE_BY_SIDE = textwrap.dedent('''
    import json, math, sys
    import torch
    import roll_shim  # noqa: F401
    from roll.configs.base_config import TrainInferCorrectionConfig, TrainInferFilterConfig, TrainInferISWeightConfig
    import roll.utils.train_infer_corrections as theirs
    import rollout_correction.compat.roll as ours

    AGGS = ["token", "geometric", "sequence", "segment"]
    SHARES = ("is_weight_clipfrac@sum", "_mask_mean@sum")
    n_batches, seed = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: float(torch.rand((), generator=g))
    pick = lambda xs: xs[int(torch.randint(len(xs), (), generator=g))]
    report = {{"batches": 0, "padded": 0, "tensor_mismatches": 0, "tie_mismatches": 0, "metric_mismatches": [],
              "metrics_compared": 0, "padded_share_differences": 0, "configs_with_filters": 0, "roll_file": theirs.__file__}}

    def config():
        isw = TrainInferISWeightConfig(enabled=rnd() < 0.8, weight_type=pick(AGGS),
                                       upper_bound=pick([None, 1.2, 2.0, 5.0]), detach=True)
        filters = []
        for _ in range(int(torch.randint(0, 4, (), generator=g))):
            filters.append(TrainInferFilterConfig(
                enabled=rnd() < 0.85, agg_type=pick(AGGS), ratio_enabled=rnd() < 0.7,
                ratio_low=0.3 + 0.69 * rnd(), ratio_high=1.01 + 1.5 * rnd(), diff_enabled=rnd() < 0.6,
                diff_low=-0.01 - 0.3 * rnd(), diff_high=0.01 + 0.3 * rnd()))
        return TrainInferCorrectionConfig(is_weight=isw, filters=filters)

    def batch(padded):
        B, T = 1 + int(torch.randint(6, (), generator=g)), 1 + int(torch.randint(24, (), generator=g))
        infer = torch.rand(B, T, generator=g).clamp_min(0.02).log()
        noise = torch.randn(B, T, generator=g) * pick([0.02, 0.1, 0.3])
        old = (infer + noise).clamp_max(0.0)
        if padded:
            mask = (torch.rand(B, T, generator=g) < pick([0.3, 0.6, 0.85])).long()
        else:
            mask = torch.ones(B, T, dtype=torch.long)
        return mask, old, infer

    def near(stat, lo, hi):
        return ((stat - lo).abs() <= 1e-5 * (1 + abs(lo))) | ((stat - hi).abs() <= 1e-5 * (1 + abs(hi)))

    for i in range(n_batches):
        padded = i % 2 == 1
        mask, old, infer = batch(padded)
        cfg = config()
        w_r, f_r, m_r = theirs.compute_train_infer_correction(cfg, mask, old, infer)
        w_o, f_o, m_o = ours.compute_train_infer_correction(cfg, mask, old, infer)
        report["batches"] += 1
        report["padded"] += padded
        report["configs_with_filters"] += any(f.enabled for f in cfg.filters)
        valid = mask.bool()
        tie = torch.zeros_like(valid)
        stats = theirs._compute_all_granularity(old, infer, mask)
        for f in cfg.filters:
            if f.enabled and f.ratio_enabled:
                tie |= near(stats["ratio"][f.agg_type], f.ratio_low, f.ratio_high)
            if f.enabled and f.diff_enabled:
                tie |= near(stats["diff"][f.agg_type], f.diff_low, f.diff_high)
        differ = valid & ((f_r * mask) != (f_o * mask))
        report["tie_mismatches"] += int((differ & tie).sum())
        report["tensor_mismatches"] += int((differ & ~tie).sum())
        if not torch.allclose(w_r[valid].float(), w_o[valid], rtol=1e-5, atol=1e-7):
            report["tensor_mismatches"] += 1
        keys = set(m_r) | set(m_o)
        for k in sorted(keys):
            if padded and k.endswith(SHARES):  # ROLL counts padding positions: reported, not compared
                a, b = m_r.get(k), m_o.get(k)
                report["padded_share_differences"] += a is None or b is None or not math.isclose(a, b, rel_tol=1e-5)
                continue
            if bool((differ & tie).any()) and k.endswith(SHARES + ("final_mask_mean",)):
                continue
            report["metrics_compared"] += 1
            a, b = m_r.get(k), m_o.get(k)
            if a is None or b is None or not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6):
                report["metric_mismatches"].append([i, k, a, b])
    from roll.pipeline.agentic.utils import compute_segment_masked_mean as their_mean
    report["segment_mean_cases"] = report["segment_mean_mismatches"] = 0
    for i in range(n_batches):
        mask, old, _ = batch(padded=True)
        x = old.double() if i % 2 else old
        a, b = their_mean(x, mask), ours.compute_segment_masked_mean(x, mask)
        report["segment_mean_cases"] += 1
        report["segment_mean_mismatches"] += not (a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-6, atol=1e-7))
    print(json.dumps(report))
''')


_COMMIT: dict = {}


def _commit(checkout: Path) -> str:
    if checkout in _COMMIT:
        return _COMMIT[checkout]
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git work tree)"


def _workdir(checkout: Path) -> Path:
    work = Path(tempfile.mkdtemp(prefix="roll_suite_"))
    (work / "roll_shim.py").write_text(SHIM.format(stubs=STUBS, empty=EMPTY_PACKAGES))
    (work / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
    return work


def _env(work: Path, checkout: Path) -> dict:
    path = [str(work), str(ROOT / "src"), str(ROOT / "core" / "src"), *[p for p in sys.path if p]]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # ROLL's tests: none of the caller's options
    return {**env, "PYTHONPATH": os.pathsep.join(path), "ROLL_CHECKOUT": str(checkout)}


def suite(checkout: Path, control: bool = False) -> dict:
    """ROLL's test file, unmodified, on the drop-in (``control``: on ROLL's own function)."""
    work = _workdir(checkout)
    try:
        source = checkout / SUITE
        shutil.copyfile(source, work / source.name)
        assert (work / source.name).read_bytes() == source.read_bytes()
        (work / "conftest.py").write_text(CONFTEST.format(control=control, module=MODULE))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", source.name],
                              cwd=work, env=_env(work, checkout), capture_output=True, text=True, timeout=600)
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail)}
        return {"run": "control (ROLL's own function)" if control else "drop-in", "file": SUITE,
                "commit": _commit(checkout), "returncode": done.returncode, "counts": counts, "summary": tail,
                "output": "" if done.returncode == 0 else done.stdout[-4000:] + done.stderr[-2000:]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def side_by_side(checkout: Path, batches: int = 400, seed: int = 0) -> dict:
    """ROLL's compute_train_infer_correction against the drop-in on random batches and configs."""
    work = _workdir(checkout)
    try:
        (work / "side_by_side.py").write_text(SIDE_BY_SIDE.format())
        done = subprocess.run([sys.executable, "side_by_side.py", str(batches), str(seed)], cwd=work,
                              env=_env(work, checkout), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return {"returncode": done.returncode, "output": done.stdout[-2000:] + done.stderr[-4000:]}
        report = json.loads(done.stdout.strip().splitlines()[-1])
        report["commit"], report["returncode"] = _commit(checkout), 0
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a ROLL checkout (its root holds roll/ and tests/)")
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    if args.commit:
        _COMMIT[checkout] = args.commit
    ok = True
    for control in (False, True):
        r = suite(checkout, control)
        print(json.dumps({k: v for k, v in r.items() if k != "output"}))
        ok &= r["returncode"] == 0 and not set(r["counts"]) - {"passed"}
        if r["output"]:
            print(r["output"], file=sys.stderr)
    r = side_by_side(checkout, args.batches, args.seed)
    print(json.dumps(r))
    ok &= r["returncode"] == 0 and not r["tensor_mismatches"] and not r["metric_mismatches"] and \
        not r["segment_mean_mismatches"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
