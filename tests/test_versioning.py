"""The release contract (docs/api.md): one source of the version, a changelog that names it, a
reference page that lists every public name, and declared Python / torch versions that CI tests."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

import rollout_correction

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SEAMS = ("rollout_correction", "rollout_correction.primitives", "rollout_correction.reductions",
         "rollout_correction.vocabulary")


def test_pyproject_reads_the_version_from_the_package():
    from setuptools.config.pyprojecttoml import read_configuration

    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rollout_correction_core.__version__"}
    # what setuptools writes into the built distribution's metadata
    expanded = read_configuration(ROOT / "pyproject.toml", expand=True)
    assert expanded["project"]["version"] == rollout_correction.__version__


def _releases() -> list[tuple[str, str]]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, flags=re.M)


def test_changelog_names_the_version_newest_first():
    releases = _releases()
    assert releases, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' release heading"
    assert releases[0][0] == rollout_correction.__version__
    versions = [tuple(int(p) for p in v.split(".")) for v, _ in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    dates = [d for _, d in releases]
    assert dates == sorted(dates, reverse=True)


def test_policy_states_the_deprecation_rule():
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert "one minor release in which using it raises a `DeprecationWarning`" in page
    assert "docs/api.md" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("module", SEAMS)
def test_reference_page_lists_every_public_name(module):
    """docs/api.md has a section per seam module whose table names every name of its ``__all__``,
    and no name that is not there."""
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = page.split(f"### `{module}`\n", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([\w.]+)` \|", section, flags=re.M)
    public = importlib.import_module(module).__all__
    assert sorted(listed) == sorted(public)
    for name in public:
        assert hasattr(importlib.import_module(module), name), name


def test_declared_python_versions_are_the_tested_ones():
    import sys

    classifiers = [c for c in PYPROJECT["project"]["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    declared = {c.rsplit(" ", 1)[1] for c in classifiers}
    assert declared == {"3.11"}
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in declared


def test_torch_floor_is_the_version_ci_tests():
    """pyproject's torch floor is the version .ci/run installs in its second environment."""
    (dep,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", dep).group(1)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    tested = re.search(r'^TORCH_FLOOR="(\d+\.\d+)\.\d+"', ci, flags=re.M)
    assert tested, ".ci/run does not set TORCH_FLOOR"
    assert tested.group(1) == floor
