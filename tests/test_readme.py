"""The README's first screen: at most 60 lines, exactly two commands — the demo with its install
line, and the tests — and those two are what .ci/run and docs/demo.md run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _bash_blocks(text: str) -> list[list[str]]:
    return [[line for line in b.strip().splitlines()] for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_first_screen_is_at_most_60_lines():
    assert len(README.splitlines()) <= 60


def test_readme_has_exactly_the_two_commands():
    assert _bash_blocks(README) == [
        ['pip install torch==2.13.0 && pip install -e ./core -e ".[demo]" && rollout-correction demo'],
        ["bash .ci/run"],
    ]


def test_demo_command_is_the_one_the_demo_page_and_ci_use():
    (demo_line,), _ = _bash_blocks(README)
    install, extra, command = demo_line.split(" && ")
    # docs/demo.md opens with the same install line and the same command
    page = _bash_blocks((ROOT / "docs" / "demo.md").read_text(encoding="utf-8"))[0]
    assert page[0] == f"{install} && {extra}"
    assert page[1].split("#")[0].strip() == command
    # .ci/run installs the same torch, and the core and the toolkit from this checkout the same way,
    # with an extra that includes the demo's requirements
    (pin,) = re.findall(r"torch==([\d.]+)", install)
    assert re.findall(r'^python -m pip install -q -c "\$CONSTRAINTS" "torch==([\d.]+)"$', CI, re.M) == [pin]
    assert re.search(r'^python -m pip install -q -c "\$CONSTRAINTS" -e \./core -e "\.\[dev\]"$', CI, re.M)
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert extra == 'pip install -e ./core -e ".[demo]"' and set(extras["demo"]) <= set(extras["dev"])


def test_test_command_runs_what_the_readme_says():
    assert "`python -m pytest -q`" in README
    assert re.search(r"^python -m pytest -q$", CI, re.M)
    # what the README says .ci/run installs and where, it installs there
    for name in ("verl", "ray", "trl", "openrlhf", "diffusers", "areal"):
        assert re.search(rf'pip install -q[^\n]*"{name}==', CI, re.I), name
    assert "python -m venv .ci/.torch-floor" in CI and "apt-get install -y -qq --no-install-recommends chromium" in CI
    for claim in ("into the current Python environment", "`.ci/`", "torch 2.4.1", "Chromium without its recommended"):
        assert claim in README, claim
    (floor,) = re.findall(r'^TORCH_FLOOR="([\d.]+)"$', CI, re.M)
    assert f"torch {floor}" in README
