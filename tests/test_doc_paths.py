"""Every file of this repository that the documentation names exists.

The pages: README.md, core/README.md and docs/*.md. What counts as naming a file, and how it must
resolve:

1. **A relative link** ``[text](target)`` (no URL scheme, not only an ``#anchor``): the target,
   without its ``#anchor``, relative to the page's folder, is a file or folder inside the repository.
2. **A code span that is a path**: one token of letters, digits and ``_ . - / *`` (a
   ``::test_name`` suffix is dropped), checked by its shape:

   a. It starts with a top-level folder of this repository (``src/``, ``core/``, ``tests/``,
      ``benchmarks/``, ``tools/``, ``examples/``, ``docs/``, ``.ci/``): it exists relative to the
      repository root; with a ``*``, the pattern matches at least one path.
   b. Otherwise, when it ends with a source file's extension (``.py``, ``.sh``, ``.toml``,
      ``.yaml``, ``.yml``): it is the end, component by component, of the path of a file in the
      repository: of exactly one when it has a folder (``demo/task.py``), so that it names one
      file; of at least one when it is a bare name (``cli.py``: several folders have one, and a
      page names it where its folder is clear).

   Names of files the commands write (``summary.json``, ``report.md``, plots) have other
   extensions and are not checked by name; a path under a top-level folder (a) is checked whatever
   its extension.
3. **Not this repository's files**: a path whose first component is written in capitals is a
   placeholder (``OUT/demo-stale.json``); a path that starts with another project's package
   (``verl/``, ``slime/``…, :data:`OTHER_PACKAGES`) is that project's; and :data:`OTHER_FILES`
   lists the other projects' files named without their package, each with its project, which the
   paragraph naming the file also names. Such a file must not resolve here (then it would be
   checked as ours), and every entry of the list must still be named somewhere.

The rule reads only the pages and the files on disk: no network, no order, no clock.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "core" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = ("src/", "core/", "tests/", "benchmarks/", "tools/", "examples/", "docs/", ".ci/")
SOURCE_EXTENSIONS = (".py", ".sh", ".toml", ".yaml", ".yml")
#: Other projects' top-level packages: a path starting with one of them is that project's.
OTHER_PACKAGES = ("verl/", "slime/", "skyrl/", "roll/", "areal/", "nemo_rl/")
#: Other projects' files that the pages name without the project's package, and the project (named
#: in the same paragraph).
OTHER_FILES = {
    "agent_loop.py": "verl",
    "cp_utils.py": "slime",
    "mis.py": "slime",
    "ppo_actor.py": "OpenRLHF",
    "ppo_trainer.yaml": "verl",
    "utils/loss_utils.py": "OpenRLHF",
    "examples/train_infer_mismatch_helper/mis.py": "slime",
    "examples/math/gsm8k_kpop.yaml": "ROLL",
    "src/prime_rl/trainer/rl/loss.py": "prime-rl",
    "src/prime_rl/trainer/rl/train.py": "prime-rl",
    "tests/test_rejection_sampling.py": "AReaL",
    "tests/trainer/ppo/test_rollout_corr.py": "verl",
    "tests/trainer/ppo/test_rollout_corr_integration.py": "verl",
    "tests/train/algorithms/test_off_policy_correction.py": "SkyRL",
    "tests/trainer/diffusion/test_rollout_correction_on_cpu.py": "verl-omni",
    "tests/agentic/test_segment_masked_mean.py": "ROLL",
    "test_rollout_corr.py": "verl",
    "test_off_policy_correction.py": "SkyRL",
    "test_rejection_sampling.py": "AReaL",
    "test_rollout_correction_on_cpu.py": "verl-omni",
    "test_segment_masked_mean.py": "ROLL",
}
_PATH = re.compile(r"[\w.*/-]+")
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _files() -> list[str]:
    """The repository's files, less hidden folders (.git, the environments .ci/run makes under .ci/),
    virtual environments (a folder holding ``pyvenv.cfg``, e.g. one made inside the clone), caches and
    build outputs."""
    skip = {"__pycache__", "build", "dist", "node_modules"}
    out = []
    for folder, dirs, files in os.walk(ROOT):
        top = Path(folder) == ROOT
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")
                   and (not d.startswith(".") or (top and d == ".ci"))
                   and not (Path(folder) / d / "pyvenv.cfg").exists()]
        out += [(Path(folder) / f).relative_to(ROOT).as_posix() for f in files]
    return out


FILES = _files()


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n\s*\n", _FENCE.sub("", text))


def _named(page: Path) -> list[tuple[str, str, str]]:
    """(kind, token, paragraph) for every link target and path-shaped code span of the page."""
    out = []
    for para in _paragraphs(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(para):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                out.append(("link", target.split("#", 1)[0], para))
        for span in _SPAN.findall(para):
            token = span.strip().split("::", 1)[0]
            if _PATH.fullmatch(token) and (token.startswith(TOP_LEVEL) or token.endswith(SOURCE_EXTENSIONS)):
                out.append(("path", token, para))
    return out


def _resolves(token: str) -> list[str]:
    """The repository's files (or folders) the path-shaped token names, by rule 2."""
    if token.startswith(TOP_LEVEL):
        pattern = token.rstrip("/")
        if "*" in pattern:
            return [p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)]
        return [pattern] if (ROOT / pattern).exists() else []
    return [f for f in FILES if f == token or f.endswith("/" + token)]


def _problem(page: Path, kind: str, token: str, para: str) -> str | None:
    where = f"{page.relative_to(ROOT)}: `{token}`"
    if kind == "link":
        target = (page.parent / token).resolve()
        return None if target.exists() and target.is_relative_to(ROOT) else f"{where}: the link's target is missing"
    first = token.split("/", 1)[0]
    if "/" in token and first.isupper():
        return None  # a placeholder (OUT/…)
    if token.startswith(OTHER_PACKAGES) or token in OTHER_FILES:
        project = OTHER_FILES.get(token)
        if _resolves(token):
            return f"{where}: listed as another project's file, but it is a file of this repository"
        if project and project.lower() not in para.lower():
            return f"{where}: another project's file ({project}), but its paragraph does not name {project}"
        return None
    found = _resolves(token)
    if not found:
        return f"{where}: no such file in the repository"
    if "/" in token and not token.startswith(TOP_LEVEL) and len(found) > 1:
        return f"{where}: names {len(found)} files ({', '.join(found[:3])}); give more of the path"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_the_page_names_exists(page):
    problems = [p for kind, token, para in _named(page) if (p := _problem(page, kind, token, para))]
    assert not problems, "\n".join(problems)


def test_the_list_of_other_projects_files_is_in_use():
    named = {token for page in PAGES for _, token, _ in _named(page)}
    assert set(OTHER_FILES) <= named, sorted(set(OTHER_FILES) - named)


@pytest.mark.parametrize("token, expected", [
    ("demo/engine.py", "src/rollout_correction/demo/engine.py"),
    ("rollout_engine.py", None),                            # the name docs/demo.md once gave the engine
    ("docs/results/cpu-0.3.0*.json", "docs/results/cpu-0.3.0-bf16.json"),
    ("config.py", "src/rollout_correction/demo/config.py"),  # a bare name: one of several
])
def test_the_rule_on_known_paths(token, expected):
    found = _resolves(token)
    assert (expected in found) if expected else not found, found
    page = ROOT / "docs" / "demo.md"
    assert (_problem(page, "path", token, "") is None) == (expected is not None)
