"""The core's wheel (core/pyproject.toml, the distribution ``rollout-correction-core``) holds the core
alone: its package's files, torch as its one requirement, no entry point. Built here from a copy of
core/ with the setuptools already installed (no network); .ci/run builds it the same way and runs
the core's test files against it in a virtual environment with torch alone."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("core")
    shutil.copytree(ROOT / "core", work / "core", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    out = work / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", str(work / "core"), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("*.whl")
    return path


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
    package = ROOT / "core" / "src" / "rollout_correction_core"
    expected = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py"))
    assert sources == expected


def test_the_wheel_requires_torch_alone_and_has_no_entry_point(wheel):
    z = zipfile.ZipFile(wheel)
    info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(z.read(info))
    assert metadata["Name"] == "rollout-correction-core"
    requires = metadata.get_all("Requires-Dist") or []
    assert [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires] == ["torch"], requires
    assert metadata["Requires-Python"] == ">=3.11"
    assert not [n for n in z.namelist() if n.endswith("entry_points.txt")]


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
