"""Run an engine's own unit tests, unmodified, against this library's drop-in for its module.

    python tools/peer_suites.py ENGINE CHECKOUT [--python PYTHON] [--commit SHA] [--json OUT]
    python tools/peer_suites.py --list

ENGINE is a key of :data:`SUITES`; CHECKOUT is the root of a source checkout of that engine (its
test files are read from there, never copied or edited). The suite's test files are collected by
pytest in a child process (``--python``: the interpreter, e.g. a virtual environment the engine's
package imports in) whose first plugin puts this library's drop-in into ``sys.modules`` under the
engine's module name before any test module is imported, so every call the tests make to that
module reaches the drop-in. The engine's own ``conftest.py`` files are not loaded (``--noconftest``)
unless the suite says so, and its pytest settings are not read. Nothing is redirected in this
process or in any other.

The report gives the counts (passed / failed / errors / skipped), the checkout's commit, and, for
each test module, the names it imported that resolve to the drop-in, which is the evidence that the
engine's tests exercised this library (engine modules that bind a drop-in name, such as a loss
module importing the drop-in's function, are listed too). The exit status is 0 when every collected test passed and
the count equals the suite's ``expected`` (when it has one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

__all__ = ["PeerSuite", "SUITES", "run_suite", "main"]

SRC = Path(__file__).resolve().parents[1] / "src"
CORE_SRC = SRC.parent / "core" / "src"


@dataclass(frozen=True)
class PeerSuite:
    """An engine's test files and the module this library's drop-in stands in for.

    modules: engine module name → drop-in module name (this library's); tests: the test files,
    relative to the checkout; paths: checkout directories put first on the child's ``sys.path`` (the
    engine's packages import from the checkout); preload: engine modules imported before the swap
    (a package whose import registers plugins, as the engine's own processes do); expected: the
    number of tests the suite holds, as recorded in docs/integrations.md; conftest: load the
    engine's ``conftest.py`` files; setup: how to prepare an environment the suite imports in.
    """

    engine: str
    modules: Mapping[str, str]
    tests: tuple[str, ...]
    paths: tuple[str, ...] = (".",)
    preload: tuple[str, ...] = ()
    expected: Optional[int] = None
    conftest: bool = False
    setup: str = ""
    extra_args: tuple[str, ...] = field(default=())


#: engine key → its suite. The commands and the counts of the last run are in docs/integrations.md.
SUITES: dict[str, PeerSuite] = {
    "verl": PeerSuite(
        "verl", {"verl.trainer.ppo.rollout_corr_helper": "rollout_correction.compat.verl"},
        ("tests/trainer/ppo/test_rollout_corr.py", "tests/trainer/ppo/test_rollout_corr_integration.py"),
        preload=("verl",), expected=30,
        setup="a verl 0.9.1 source tree (or the installed wheel's directory, which ships these tests); "
              "the environment of .ci/run"),
    "verl-omni": PeerSuite(
        "verl-omni", {"verl.trainer.ppo.rollout_corr_helper": "rollout_correction.compat.verl"},
        ("tests/trainer/diffusion/test_rollout_correction_on_cpu.py",),
        preload=("verl",),
        setup="a verl-omni checkout; verl at verl-omni's pinned commit, vllm_omni and what its diffusion trainer "
              "imports, in a throwaway environment (importing verl_omni writes a .pth file into site-packages)"),
    "skyrl": PeerSuite(
        "SkyRL", {"skyrl.backends.skyrl_train.utils.off_policy_correction_utils": "rollout_correction.compat.skyrl"},
        ("tests/train/algorithms/test_off_policy_correction.py",),
        paths=(".", "skyrl-gym"), expected=29,
        setup="Python >= 3.12 (SkyRL's package requires it): a virtual environment with torch, pytest and "
              "the packages SkyRL's config and loss modules import (see docs/integrations.md)"),
    "areal": PeerSuite(
        "AReaL", {"areal.utils.functional": "rollout_correction.compat.areal"},
        ("tests/test_rejection_sampling.py",), expected=43,
        setup="an AReaL checkout (v1.0.4 or later) and the packages areal.api.cli_args imports"),
}

#: The child's first plugin: swaps the modules, then records the outcome of every test.
_PLUGIN = textwrap.dedent('''
    import importlib, json, os, sys

    _SPEC = json.loads(os.environ["ROLLOUT_CORRECTION_PEER_SPEC"])
    for _name in _SPEC["preload"]:
        importlib.import_module(_name)
    _OURS = {}
    for _engine_name, _ours in _SPEC["modules"].items():
        _OURS[_engine_name] = sys.modules[_engine_name] = importlib.import_module(_ours)


    def pytest_sessionfinish(session, exitstatus):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        outcomes = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
        counts = {k: len(v) for k, v in (reporter.stats if reporter else {}).items() if k in outcomes and v}
        uses = {}
        prefixes = tuple(m.__name__ for m in _OURS.values())
        for mod_name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None) or ""
            if not any(path.startswith(os.path.join(root, "")) for root in _SPEC["roots"]):
                continue
            names = sorted(n for n, v in vars(mod).items()
                           if getattr(v, "__module__", None) in prefixes or any(v is m for m in _OURS.values()))
            if names:
                uses[mod_name] = names
        swapped = {n: getattr(sys.modules.get(n), "__name__", None) for n in _SPEC["modules"]}
        with open(_SPEC["report"], "w") as f:
            json.dump({"counts": counts, "exitstatus": int(exitstatus), "modules": swapped, "uses": uses}, f)
''')


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout; pass --commit)"


def run_suite(key: str, checkout: Path, python: str = sys.executable, commit: Optional[str] = None,
              timeout: float = 900.0) -> dict:
    """Run suite ``key`` from ``checkout`` in a child ``python``; returns the report (see module doc)."""
    suite = SUITES[key]
    checkout = checkout.resolve()
    tests = [checkout / t for t in suite.tests]
    missing = [str(t) for t in tests if not t.is_file()]
    if missing:
        raise FileNotFoundError(f"{suite.engine}: no such test file(s) in {checkout}: {missing}")
    with tempfile.TemporaryDirectory(prefix="peer-suite-") as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "_rollout_correction_peer.py").write_text(_PLUGIN)
        (tmp_path / "pytest.ini").write_text("[pytest]\n")  # neither the engine's settings nor ours
        report = tmp_path / "report.json"
        spec = {"modules": dict(suite.modules), "preload": list(suite.preload), "report": str(report),
                "roots": [str(checkout)]}
        path = [str(tmp_path), *(str((checkout / p).resolve()) for p in suite.paths), str(SRC), str(CORE_SRC)]
        inherited = os.environ.get("PYTHONPATH")
        # the engine's suite runs with the options above only, not the caller's (e.g. .ci/run's xdist workers)
        env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "ROLLOUT_CORRECTION_PEER_SPEC": json.dumps(spec),
               "PYTHONPATH": os.pathsep.join(path + ([inherited] if inherited else []))}
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_rollout_correction_peer",
               "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(checkout), "-rfE",
               *([] if suite.conftest else ["--noconftest"]), *suite.extra_args, *map(str, tests)]
        done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
        result = json.loads(report.read_text()) if report.exists() else {"counts": {}, "modules": {}, "uses": {}}
    counts = result["counts"]
    ran = sum(counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"))
    ok = (done.returncode == 0 and counts.get("passed", 0) == ran > 0
          and (suite.expected is None or counts.get("passed", 0) == suite.expected)
          and all(v == suite.modules[k] for k, v in result["modules"].items()))
    return {"engine": suite.engine, "checkout": str(checkout), "commit": commit or _commit(checkout),
            "python": python, "tests": list(suite.tests), "expected": suite.expected, "ok": ok,
            "returncode": done.returncode, **result,
            "output_tail": (done.stdout[-6000:] + done.stderr[-3000:]) if not ok else done.stdout[-400:]}


def _summary(r: dict) -> str:
    c = r["counts"]
    counts = ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
                       if c.get(k))
    expected = f" (expected {r['expected']})" if r["expected"] is not None else ""
    swapped = "; ".join(f"{k} -> {v}" for k, v in r["modules"].items())
    return (f"{r['engine']} @ {r['commit']}: {counts or 'nothing ran'}{expected} [{'ok' if r['ok'] else 'FAILED'}]\n"
            f"  {', '.join(r['tests'])}\n  {swapped}\n"
            + "".join(f"  {m} uses the drop-in's {', '.join(n)}\n" for m, n in r["uses"].items()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", nargs="?", choices=sorted(SUITES))
    parser.add_argument("checkout", nargs="?", type=Path, help="root of the engine's source checkout")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the child (default: this one)")
    parser.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--list", action="store_true", help="list the suites and exit")
    args = parser.parse_args(argv)
    if args.list or args.engine is None:
        for key, s in SUITES.items():
            print(f"{key}: {', '.join(s.tests)}; {', '.join(f'{a} -> {b}' for a, b in s.modules.items())}"
                  f"{'' if s.expected is None else f'; {s.expected} tests'}\n    setup: {s.setup}")
        return 0
    if args.checkout is None:
        parser.error("give the engine's checkout")
    report = run_suite(args.engine, args.checkout, args.python, args.commit)
    print(_summary(report))
    if not report["ok"]:
        print(report["output_tail"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
