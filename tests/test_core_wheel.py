"""The two wheels, as pip installs them.

- The core's wheel (core/pyproject.toml, the distribution ``rollout-correction-core``) holds the core
  alone: its package's files, torch as its one requirement, no entry point.
- The toolkit's wheel (the root pyproject.toml, ``rollout-correction``) holds none of the core's
  files and requires the core at exactly the version ``rollout_correction_core.__version__`` names.
- Both carry the license text (``LICENSE``, the same file at the root and in core/).
- Installed together into a new virtual environment, uninstalling the toolkit leaves the core
  installed, whole and importable.

The wheels are built here from copies of the sources with the setuptools already installed (no
network, no build isolation); .ci/run builds the core's wheel the same way and runs the core's test
files against it in a virtual environment with torch alone. The virtual environment of the install
test has no pip and no torch of its own: this interpreter's pip installs into it and uninstalls
from it (``pip --python``), and its child processes import torch from this interpreter's
site-packages, appended after their own (so a copy of either package outside the environment can
never stand in for one inside it: every import is checked to come from the environment).
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CORE_PACKAGE = ROOT / "core" / "src" / "rollout_correction_core"
_COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")


def _build(source: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", str(source), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("*.whl")
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The core's wheel."""
    work = tmp_path_factory.mktemp("core")
    shutil.copytree(ROOT / "core", work / "core", ignore=_COPY_IGNORE)
    return _build(work / "core", work / "dist")


@pytest.fixture(scope="module")
def toolkit_wheel(tmp_path_factory) -> Path:
    """The toolkit's wheel, from a copy of what the root pyproject.toml builds from (core/ is there
    because the version attribute is read from the core's source)."""
    work = tmp_path_factory.mktemp("toolkit") / "repo"
    work.mkdir()
    for name in ("src", "core"):
        shutil.copytree(ROOT / name, work / name, ignore=_COPY_IGNORE)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, work / name)
    return _build(work, work.parent / "dist")


def _metadata(path: Path) -> email.message.Message:
    z = zipfile.ZipFile(path)
    info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    return email.message_from_bytes(z.read(info))


def test_the_wheel_holds_the_core_package_only(wheel):
    import rollout_correction_core

    names = zipfile.ZipFile(wheel).namelist()
    version = rollout_correction_core.__version__
    assert wheel.name == f"rollout_correction_core-{version}-py3-none-any.whl"
    info = f"rollout_correction_core-{version}.dist-info/"
    others = [n for n in names if not (n.startswith("rollout_correction_core/") or n.startswith(info))]
    assert not others, f"the core's wheel holds files outside its package: {others}"
    sources = sorted(Path(n).relative_to("rollout_correction_core").as_posix() for n in names
                     if n.startswith("rollout_correction_core/"))
    expected = sorted(p.relative_to(CORE_PACKAGE).as_posix() for p in CORE_PACKAGE.rglob("*.py"))
    assert sources == expected


def test_the_wheel_requires_torch_alone_and_has_no_entry_point(wheel):
    z = zipfile.ZipFile(wheel)
    metadata = _metadata(wheel)
    assert metadata["Name"] == "rollout-correction-core"
    requires = metadata.get_all("Requires-Dist") or []
    assert [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires] == ["torch"], requires
    assert metadata["Requires-Python"] == ">=3.11"
    assert not [n for n in z.namelist() if n.endswith("entry_points.txt")]


def test_the_toolkit_requires_the_core_at_its_own_version():
    """The root pyproject.toml writes the core's version out in the toolkit's requirement; it is the
    version ``rollout_correction_core.__version__`` names, the one both distributions are built at."""
    import rollout_correction_core

    version = rollout_correction_core.__version__
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    pins = [d for d in deps if re.match(r"rollout-correction-core\b", d)]
    assert pins == [f"rollout-correction-core=={version}"], pins


def test_the_toolkit_wheel_holds_none_of_the_core_files(toolkit_wheel):
    import rollout_correction_core

    version = rollout_correction_core.__version__
    assert toolkit_wheel.name == f"rollout_correction-{version}-py3-none-any.whl"
    names = zipfile.ZipFile(toolkit_wheel).namelist()
    assert not [n for n in names if n.split("/")[0] == "rollout_correction_core"]
    info = f"rollout_correction-{version}.dist-info/"
    package = ROOT / "src" / "rollout_correction"
    sources = sorted(n for n in names if not n.startswith(info))
    expected = sorted(f"rollout_correction/{p.relative_to(package).as_posix()}" for p in package.rglob("*")
                      if p.is_file() and p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts)
    assert sources == expected
    metadata = _metadata(toolkit_wheel)
    assert metadata["Name"] == "rollout-correction" and metadata["Version"] == version
    assert f"rollout-correction-core=={version}" in (metadata.get_all("Requires-Dist") or [])


def test_both_wheels_carry_the_license_text(wheel, toolkit_wheel):
    """One Apache-2.0 text, at the root and in core/ byte for byte, in each wheel's metadata."""
    text = (ROOT / "LICENSE").read_bytes()
    assert (ROOT / "core" / "LICENSE").read_bytes() == text
    words = text.decode("utf-8")
    assert words.split("\n", 3)[1:3] == [" " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]
    for section in ("1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                    "4. Redistribution.", "5. Submission of Contributions.", "6. Trademarks.",
                    "7. Disclaimer of Warranty.", "8. Limitation of Liability.",
                    "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert section in words, section
    for path in (wheel, toolkit_wheel):
        z = zipfile.ZipFile(path)
        (license_file,) = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
        assert z.read(license_file) == text, path.name
        assert _metadata(path)["License-Expression"] == "Apache-2.0", path.name


_IMPORT = """
import json, sys
sys.path.append(sys.argv[1])  # this interpreter's torch, after the environment's own site-packages
found = {}
for name in sys.argv[2:]:
    try:
        module = __import__(name)
    except ImportError:
        continue
    found[name] = module.__file__
if "rollout_correction_core" in found:
    import torch
    import rollout_correction_core as rc
    out = rc.compute_rollout_correction(torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.6, -1.0]]),
                                        torch.ones(1, 2, dtype=torch.bool), config=rc.RolloutCorrectionConfig.token_is())
    found["weights"] = out.weights.tolist()
print(json.dumps(found))
"""


def test_uninstalling_the_toolkit_leaves_the_core_importable(wheel, toolkit_wheel, tmp_path):
    """Both wheels installed into a new virtual environment, then ``pip uninstall rollout-correction``:
    the core's files are all still there, pip lists the core alone, and the core imports (from the
    environment) and computes."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    torch_site = str(Path(torch.__file__).resolve().parents[1])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH of this run

    def pip(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args],
                              capture_output=True, text=True, timeout=300, env=clean)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def imported() -> dict:
        done = subprocess.run([str(python), "-I", "-c", _IMPORT, torch_site, "rollout_correction",
                               "rollout_correction_core"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def listed() -> set[str]:
        return {d["name"] for d in json.loads(pip("list", "--format", "json"))}

    pip("install", "-q", "--no-deps", "--no-index", str(wheel), str(toolkit_wheel))
    core_files = sorted(p.relative_to(CORE_PACKAGE).as_posix() for p in CORE_PACKAGE.rglob("*.py"))
    before = imported()
    assert listed() == {"rollout-correction", "rollout-correction-core"}
    assert Path(before["rollout_correction"]).is_relative_to(site), before
    assert Path(before["rollout_correction_core"]).is_relative_to(site), before

    pip("uninstall", "-q", "-y", "rollout-correction")
    after = imported()
    assert listed() == {"rollout-correction-core"}
    assert not (site / "rollout_correction").exists()
    installed = sorted(p.relative_to(site / "rollout_correction_core").as_posix()
                       for p in (site / "rollout_correction_core").rglob("*.py"))
    assert installed == core_files, "uninstalling the toolkit removed files of the core"
    assert Path(after["rollout_correction_core"]).is_relative_to(site), after
    assert after["weights"] == before["weights"] and len(after["weights"][0]) == 2


def test_importing_the_core_has_no_side_effect():
    """Importing the core loads torch and the standard library only, and changes no warning filter,
    no torch setting and no environment variable."""
    code = """
import os, sys, warnings, torch
state = lambda: (list(warnings.filters), dict(os.environ), torch.get_default_dtype(), torch.get_num_threads(),
                 torch.are_deterministic_algorithms_enabled(), torch.is_grad_enabled())
before, modules = state(), set(sys.modules)
import rollout_correction_core
new = {m.split('.')[0] for m in set(sys.modules) - modules} - set(sys.stdlib_module_names)
assert new == {'rollout_correction_core'}, new
assert state() == before
"""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "core" / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
