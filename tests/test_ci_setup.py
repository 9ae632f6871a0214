"""What makes a fresh clone's CI give the answer it gave before: pinned test dependencies, and
property tests whose examples do not depend on the run.

- ``.ci/run`` passes ``.ci/constraints.txt`` to every ``pip install``, and the file pins an exact
  version of every third-party package the tests import (under CI, the installed one).
- Every property test runs derandomized without an example database, except the ``nightly`` ones,
  which explore from random seeds (conftest.py says why each setting is there).
- A derandomized test draws the same examples whatever was imported before it in its process (the
  other tests that ran first): alone, after importing other modules of the toolkit, and in
  pytest-xdist's workers. Without the conftest's fix the examples do change with the imports (a
  control run checks it, so this test cannot pass for want of a difference to find).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: Imported by tests but not installed by pip, with where they come from.
NOT_INSTALLED = {
    "skyrl": ".ci/run unpacks SkyRL 0.4.0's wheel (tests/skyrl_reference.py loads its files)",
    "torch": ".ci/run names its version (2.13.0, and TORCH_FLOOR for the core alone)",
    "rollout_correction": "this repository", "rollout_correction_core": "this repository",
}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.+-]+", version), f"not an exact pin: {line!r}"
            pins[_normalized(name)] = version
    return pins


def _imported_by_tests() -> set[str]:
    """Top-level modules the test files and the conftest files import (statically, or through
    ``pytest.importorskip("name")``), less the standard library and the test helpers themselves."""
    local = {p.stem for d in ("tests", "tools", "benchmarks") for p in (ROOT / d).glob("*.py")}
    names = set()
    for path in [*sorted((ROOT / "tests").glob("*.py")), ROOT / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names.add(str(node.args[0].value).split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def test_every_pip_install_of_ci_takes_the_constraints():
    assert re.search(r"^CONSTRAINTS=\.ci/constraints\.txt$", CI_RUN, re.M)
    installs = [line for line in CI_RUN.splitlines() if re.search(r"\bpip install\b", line)
                and not line.lstrip().startswith("#")]
    assert len(installs) >= 10
    unpinned = [line for line in installs if '-c "$CONSTRAINTS"' not in line]
    assert not unpinned, unpinned
    # the oldest-torch environment too
    assert any(line.startswith("$FLOOR -m pip install") for line in installs)


def test_the_constraints_pin_every_package_the_tests_import():
    """Each imported module's distribution has an exact pin; under CI (.ci/run installed from the
    file) the installed version is the pinned one."""
    pins = _pins()
    assert "torch" not in pins  # .ci/run names torch: 2.13.0, and the floor for the core
    distributions = md.packages_distributions()
    missing, different = [], []
    for module in sorted(_imported_by_tests() - set(NOT_INSTALLED)):
        names = distributions.get(module)
        if not names:
            missing.append(f"{module} (not installed here)")
            continue
        for name in names:
            pin = pins.get(_normalized(name))
            if pin is None:
                missing.append(f"{module} ({name})")
            elif _IN_CI and md.version(name) != pin:
                different.append(f"{name} {md.version(name)} installed, {pin} pinned")
    assert not missing, f"imported by the tests, not pinned in .ci/constraints.txt: {missing}"
    assert not different, different
    for name in ("hypothesis", "pytest", "pytest-xdist", "numpy", "transformers", "matplotlib", "setuptools"):
        assert name in pins, name


def _property_tests() -> list[tuple[str, object]]:
    tests = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if "hypothesis" not in path.read_text(encoding="utf-8"):
            continue
        module = importlib.import_module(path.stem)
        tests += [(f"{path.stem}.{n}", f) for n, f in vars(module).items()
                  if n.startswith("test_") and getattr(f, "is_hypothesis_test", False)]
    return tests


def test_property_tests_are_derandomized_without_a_database_except_nightly():
    from hypothesis import settings

    assert settings.default.derandomize and settings.default.database is None
    tests = _property_tests()
    assert len(tests) >= 30
    nightly = [name for name, f in tests if any(m.name == "nightly" for m in getattr(f, "pytestmark", []))]
    assert "test_fuzz.test_fuzz_segments_nightly" in nightly
    for name, f in tests:
        s = f._hypothesis_internal_use_settings
        if name in nightly:  # open-ended exploration: random seeds, only under -m nightly
            assert not s.derandomize and s.database is None, name
        else:
            assert s.derandomize and s.database is None, name
    fuzz = dict(tests)
    assert fuzz["test_fuzz.test_fuzz_segments_nightly"]._hypothesis_internal_use_settings.max_examples >= 1000


# Draws 100 derandomized examples of tests/test_fuzz.py's batch strategy and prints their digest.
PROBE = '''
import hashlib

from hypothesis import given, settings, strategies as st

import test_fuzz


def digest() -> str:
    seen = []

    @settings(max_examples=100, derandomize=True, database=None, deadline=None)
    @given(st.data())
    def draw(data):
        old, roll, mask = data.draw(test_fuzz.batches())
        seen.append(repr((old.tolist(), roll.tolist(), mask.tolist(), str(old.dtype))))

    draw()
    return hashlib.sha256("\\n".join(seen).encode()).hexdigest()
'''

# Modules of the toolkit that the probe alone does not import (other tests would, first).
OTHER_MODULES = ("rollout_correction.diagnose.cli", "rollout_correction.diagnose.report", "rollout_correction.monitor")

# The probe's digest, then the other modules imported, then the digest again.
SCRIPT = '''
import importlib, sys
if sys.argv[1] == "fixed":
    import conftest  # a copy of the repository's: the repeatable profile, the local-literal pool emptied
else:  # the settings alone, as before the fix
    from hypothesis import settings
    settings.register_profile("plain", derandomize=True, database=None, deadline=None)
    settings.load_profile("plain")
import probe_draws
before = probe_draws.digest()
for name in sys.argv[2:]:
    importlib.import_module(name)
print(before, probe_draws.digest())
'''

XDIST_TESTS = '''
import importlib, json, os, pathlib

import probe_draws

OUT = pathlib.Path(os.environ["PROBE_OUT"])


def test_after_other_modules():
    for name in {modules!r}:
        importlib.import_module(name)
    (OUT / "after.json").write_text(json.dumps(probe_draws.digest()))


def test_alone():
    (OUT / "alone.json").write_text(json.dumps(probe_draws.digest()))
'''


def test_draws_do_not_depend_on_what_was_imported_before(tmp_path):
    (tmp_path / "probe_draws.py").write_text(PROBE)
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text(encoding="utf-8"))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

    def digests(mode: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode, *OTHER_MODULES], capture_output=True,
                              text=True, timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-2:]

    alone, after = digests("fixed")
    assert after == alone
    # the control: with the settings alone, the same imports change the examples
    before, after = digests("plain")
    assert after != before

    (tmp_path / "test_probe_xdist.py").write_text(XDIST_TESTS.format(modules=OTHER_MODULES))
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist", "-n", "2",
                           "--rootdir", str(tmp_path), "-o", "addopts=", str(tmp_path / "test_probe_xdist.py")],
                          capture_output=True, text=True, timeout=600, env={**env, "PROBE_OUT": str(out)},
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "alone.json").read_text()) == alone
    assert json.loads((out / "after.json").read_text()) == alone
