"""Every code block of docs/api.md, docs/context-parallel.md and core/README.md runs, so that a page
cannot name a function, an argument or a setting that does not exist.

The rule: each code block is preceded (blank lines allowed) by an HTML comment naming what it is given,

    <!-- doc-test: FIXTURE (name, name, ...) -->

FIXTURE is one of the fixtures below, and the parenthesised names are exactly the variables it puts in
the block's namespace (checked against the fixture), so that a reader sees every name the block uses
without defining it. A block without the comment, or with an unknown fixture, fails.

* ``none ()``: an empty namespace; the block is self-contained.
* ``batch (old_log_prob, rollout_log_prob, response_mask, log_prob, advantages)``: one process; a
  batch of B = 4 rows of T = 8 tokens: float32 log-probs of the trainer (``old_log_prob``) and of the
  engine (``rollout_log_prob``), a bool ``response_mask`` with an empty row and holes, ``log_prob``
  (float32, with gradient) and ``advantages``.
* ``cp2 (... the batch's names ..., dp_group, cp_group, max_response_length)``: the block runs on 2 gloo
  ranks, each a ``python -c`` child with a deadline; each rank holds its contiguous half of every row of
  the same batch, ``cp_group`` holds both ranks, ``dp_group`` this rank's data-parallel group without
  context parallelism (itself), ``max_response_length`` is T.
* ``checkout ()``: a bash block, run line by line from a temporary copy of the checkout (its core/),
  each line ending with exit status 0; a ``pip install`` line runs offline into a fresh target directory
  (``--no-deps --no-build-isolation --no-index --target``) instead of the test's environment, and the
  other lines run with that directory first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PAGES = ["docs/api.md", "docs/context-parallel.md", "core/README.md"]
DEADLINE_S = 120
BATCH_NAMES = ["old_log_prob", "rollout_log_prob", "response_mask", "log_prob", "advantages"]
FIXTURES = {"none": [], "batch": BATCH_NAMES, "cp2": BATCH_NAMES + ["dp_group", "cp_group", "max_response_length"],
            "checkout": []}


def blocks(text: str) -> list[tuple[str, list[str], str, str]]:
    """(fixture, names, language, source) of every fenced code block of ``text``; the fixture is None
    when no doc-test comment precedes the block."""
    out = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S):
        before = text[:match.start()].rstrip().rsplit("\n", 1)[-1]
        marker = re.fullmatch(r"<!-- doc-test: (\w+) \(([\w, ]*)\) -->", before.strip())
        fixture, names = (marker.group(1), [n.strip() for n in marker.group(2).split(",") if n.strip()]) \
            if marker else (None, [])
        out.append((fixture, names, match.group(1), match.group(2)))
    return out


CASES = [(page, i, *block) for page in PAGES
         for i, block in enumerate(blocks((ROOT / page).read_text(encoding="utf-8")))]


def test_the_pages_have_blocks_and_the_parser_sees_them():
    assert {page for page, *_ in CASES} == set(PAGES)
    sample = "text\n<!-- doc-test: none () -->\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
    assert blocks(sample) == [("none", [], "python", "x = 1\n"), (None, [], "bash", "ls\n")]


def batch() -> dict[str, torch.Tensor]:
    """The ``batch`` fixture (the same tensors on every rank of ``cp2``)."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 8, generator=g) * 2 - 0.05
    old = (rollout + 0.1 * torch.randn(4, 8, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.rand(4, 8, generator=g) > 0.2
    mask[2] = False  # an empty row
    log_prob = (old + 0.05 * torch.randn(4, 8, generator=g)).clamp(max=0.0).requires_grad_(True)
    return dict(old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, log_prob=log_prob,
                advantages=torch.randn(4, 8, generator=g))


def rank_main(source_path: str, rank: int, port: int, out: str) -> None:
    """One rank of a ``cp2`` block: writes {"ok": true} or the error and its traceback to ``out``."""
    import traceback

    import torch.distributed as dist

    from gloo import init_dp_cp

    result: dict = {}
    try:
        _, cp_rank, cp_group, dp_group = init_dp_cp(rank, 2, 2, port)
        full = batch()
        half = full["old_log_prob"].shape[1] // 2
        namespace = {k: v.detach()[:, cp_rank * half:(cp_rank + 1) * half].clone() for k, v in full.items()}
        namespace["log_prob"].requires_grad_(True)
        namespace.update(dp_group=dp_group, cp_group=cp_group, max_response_length=2 * half)
        exec(compile(Path(source_path).read_text(), source_path, "exec"), namespace)  # noqa: S102 - the page's block
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - what the rank ended with is the result
        result.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    Path(out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_cp2(source: str, tmp_path: Path) -> None:
    """The block on two ranks, each a child process logging to a file, both killed at the deadline."""
    from gloo import _free_port

    source_path = tmp_path / "block.py"
    source_path.write_text(source)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    logs = [tmp_path / f"{r}.log" for r in range(2)]
    procs = []
    for r, log in enumerate(logs):
        call = f"t.rank_main({str(source_path)!r}, {r}, {port}, {str(tmp_path / f'{r}.json')!r})"
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", f"import test_doc_blocks as t; {call}"], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + DEADLINE_S
    finished = [_wait(p, deadline) for p in procs]
    for r in range(2):
        assert finished[r], f"rank {r} is still running after {DEADLINE_S} s (a hang)"
        path = tmp_path / f"{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{logs[r].read_text()[-3000:]}"
        result = json.loads(path.read_text())
        assert result.get("ok"), f"rank {r}: {result.get('error')}\n{result.get('traceback')}"


def _wait(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether ``proc`` ended before ``deadline`` (it is killed otherwise)."""
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def run_checkout(source: str, tmp_path: Path) -> None:
    checkout, target = tmp_path / "checkout", tmp_path / "site"
    shutil.copytree(ROOT / "core", checkout / "core",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for line in (ln.split(" #", 1)[0].strip() for ln in source.splitlines()):
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        if words[:2] == ["pip", "install"]:
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                       "--target", str(target), *words[2:]]
            done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
        else:
            done = subprocess.run(["bash", "-c", line], cwd=checkout, env=dict(env, PYTHONPATH=str(target)),
                                  capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("page,index,fixture,names,language,source", CASES,
                         ids=[f"{page}#{i}" for page, i, *_ in CASES])
def test_every_block_runs(page, index, fixture, names, language, source, tmp_path):
    assert fixture in FIXTURES, (f"{page}, block {index + 1}: precede it with '<!-- doc-test: FIXTURE (names) -->' "
                                 f"naming one of {sorted(FIXTURES)}")
    assert names == FIXTURES[fixture], f"{page}, block {index + 1}: {fixture} gives {FIXTURES[fixture]}, not {names}"
    if fixture == "checkout":
        assert language == "bash"
        run_checkout(source, tmp_path)
        return
    assert language == "python", f"{page}, block {index + 1}: a {fixture} block is Python"
    if fixture == "cp2":
        run_cp2(source, tmp_path)
        return
    namespace = batch() if fixture == "batch" else {}
    exec(compile(source, f"{page}#{index + 1}", "exec"), namespace)  # noqa: S102 - the page's own block
