"""The release contract (docs/api.md): one source of the version, a changelog that names it, a
reference page that lists every public name, and declared Python / torch versions that CI tests."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

import rollout_correction
import rollout_correction_core

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CORE_PYPROJECT = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text(encoding="utf-8"))
#: The core's public modules; the toolkit re-exports each under its own name (TOOLKIT_NAME).
SEAMS = ("rollout_correction_core", "rollout_correction_core.primitives", "rollout_correction_core.reductions",
         "rollout_correction_core.vocabulary")
TOOLKIT_NAME = {m: m.replace("rollout_correction_core", "rollout_correction") for m in SEAMS}
EXTENSIONS = ("rollout_correction.staleness", "rollout_correction.moe", "rollout_correction.supports",
              "rollout_correction.advantages", "rollout_correction.settings", "rollout_correction.packed")
#: The conveniences the toolkit adds after the core's names (they live in EXTENSIONS).
TOOLKIT_ADDS = {"rollout_correction": ["config_value", "compute_rollout_correction_packed"],
                "rollout_correction.primitives": ["lengths_from_cu_seqlens", "pack_index", "to_padded"]}


@pytest.mark.parametrize("path", ["pyproject.toml", "core/pyproject.toml"])
def test_both_pyprojects_read_the_version_from_the_core(path):
    from setuptools.config.pyprojecttoml import read_configuration

    pyproject = tomllib.loads((ROOT / path).read_text(encoding="utf-8"))
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "rollout_correction_core.__version__"}
    # what setuptools writes into the built distribution's metadata
    expanded = read_configuration(ROOT / path, expand=True)
    assert expanded["project"]["version"] == rollout_correction_core.__version__ == rollout_correction.__version__


def test_the_core_distribution_declares_torch_alone_and_no_entry_point():
    project = CORE_PYPROJECT["project"]
    assert project["name"] == "rollout-correction-core"
    assert [d for d in project["dependencies"]] == [d for d in PYPROJECT["project"]["dependencies"]
                                                    if d.startswith("torch")] == ["torch>=2.4"]
    assert not {"scripts", "gui-scripts", "entry-points", "optional-dependencies"} & set(project)
    assert project["requires-python"] == PYPROJECT["project"]["requires-python"]
    assert "verl.plugins" in PYPROJECT["project"]["entry-points"]  # the entry point stays with the toolkit


@pytest.mark.parametrize("module", SEAMS)
def test_the_toolkit_re_exports_the_core_unchanged(module):
    """The same objects under the toolkit's name, except the root's entry points that accept the 0.2
    keywords for one minor release (``rollout_correction._compat``): those are the wrappers."""
    from rollout_correction import _compat

    core, toolkit = importlib.import_module(module), importlib.import_module(TOOLKIT_NAME[module])
    assert list(toolkit.__all__) == list(core.__all__) + TOOLKIT_ADDS.get(TOOLKIT_NAME[module], [])
    wrapped = set(_compat.__all__) if module == "rollout_correction_core" else set()
    assert wrapped <= set(core.__all__) | set(TOOLKIT_ADDS.get(TOOLKIT_NAME[module], []))
    assert all(getattr(toolkit, n) is getattr(core, n) for n in core.__all__ if n not in wrapped)
    assert all(getattr(toolkit, n) is getattr(_compat, n) is not getattr(core, n, None) for n in wrapped)


def _releases() -> list[tuple[str, str]]:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, flags=re.M)


def test_changelog_names_the_version_newest_first():
    releases = _releases()
    assert releases, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' release heading"
    assert releases[0][0] == rollout_correction_core.__version__
    versions = [tuple(int(p) for p in v.split(".")) for v, _ in releases]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    dates = [d for _, d in releases]
    assert dates == sorted(dates, reverse=True)


def test_policy_states_the_deprecation_rule():
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert "one minor release in which using it raises a `DeprecationWarning`" in page
    assert "docs/api.md" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("module", SEAMS[1:] + EXTENSIONS)
def test_reference_page_lists_every_public_name(module):
    """docs/api.md has a section per provisional module of the core (its seams) and per extension of
    the toolkit whose table names every name of its ``__all__``, and no name that is not there. (The
    root's names are the promised ones, each with its signature: tests/test_promises.py.)"""
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
    """pyproject's torch floor is the version .ci/run installs beside the core's wheel."""
    (dep,) = [d for d in CORE_PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", dep).group(1)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    tested = re.search(r'^TORCH_FLOOR="(\d+\.\d+)\.\d+"', ci, flags=re.M)
    assert tested, ".ci/run does not set TORCH_FLOOR"
    assert tested.group(1) == floor


def _toolkit_imports(path: Path, seen: set[Path]) -> list[str]:
    """Imports of the toolkit (``rollout_correction``) by a test file, or by the test modules it imports."""
    import ast

    if path in seen:
        return []
    seen.add(path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            top = name.split(".")[0]
            if top == "rollout_correction":
                bad.append(f"{path.name}:{node.lineno} imports {name}")
            elif (ROOT / "tests" / f"{top}.py").is_file():
                bad += _toolkit_imports(ROOT / "tests" / f"{top}.py", seen)
    return bad


def test_ci_runs_the_core_tests_against_the_core_wheel_alone():
    """.ci/run builds the core's wheel and runs CORE_TESTS in an environment without the toolkit: no
    such file (nor a test module it imports) may import ``rollout_correction``."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip wheel -q --no-deps ./core" in ci and 'PYTHONPATH="" $FLOOR -m pytest' in ci
    files = re.findall(r"tests/\w+\.py", re.search(r"CORE_TESTS=\((.*?)\)", ci, flags=re.S).group(1))
    assert "tests/test_no_silent_fallback.py" in files and len(files) >= 10
    seen: set[Path] = {ROOT / "tests" / "conftest.py"}
    bad = [b for f in files for b in _toolkit_imports(ROOT / f, seen)] + _toolkit_imports(ROOT / "conftest.py", seen)
    assert not bad, "core test files that need the toolkit:\n" + "\n".join(bad)
