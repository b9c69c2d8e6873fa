"""Every code block of README.md and docs/*.md runs as written.

A page's fenced blocks run in page order in one scratch folder (so a page can train, then
resume, then export), with the package's venv on PATH and this checkout's ``src`` first:

- ```bash, ```sh: a shell script (``set -e``); ```console: its ``$ `` lines only;
- ```python: a script, under ``torchrun --nproc-per-node N`` when it says ``# torchrun: N`` or
  uses torch.distributed (N = 2), else plain ``python``;
- a block whose first line is ``# file: NAME`` is only written to NAME (a config file, or a
  script that a later command runs);
- every other language (text, toml, json, ...) is only shown.

Only sizes and placeholders change (``sized``, applied to every command, so a new page needs
no entry: steps, worker counts, validation batches, paper-scale recipes, ``HOST``,
``/shared/``); a ``pytest`` command is collected (``--collect-only``) in the checkout, not run;
the commands in ``SKIPPED`` are not run, each for the reason it gives. Anything else that fails
fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "console"}
SHOWN = {"text", "toml", "json", "yaml", "ini", "diff", "markdown"}
BLOCK_TIMEOUT_S = 300

# Not run, with the reason. Matched against one command (continuation lines joined).
SKIPPED: dict[str, str] = {
    r"^make\b": "make demo / make test / the benchmark and study targets: the demo, the whole "
                "suite this test belongs to, or jobs of minutes to hours",
    r"^(\S*/)?python3? benchmarks/": "benchmark scripts: minutes to hours each, and they write "
                                     "benchmarks/results (make bench runs them)",
    r"^(\S*/)?subnetdp compare\b": "the studies: a grid of training runs, 10 min (--quick) "
                                   "to hours",
    r"^(\S*/)?pip install\b": "changes the environment (make setup installs the extras)",
}

# Pages whose blocks another test runs as written, with an oracle of its own.
TESTED_ELSEWHERE: dict[str, str] = {
    "docs/own-model.md": "tests/runtime/test_python_api.py runs its commands as written (stop and "
                         "resume equal a straight run) and checks that each Python block is "
                         "the example's own code or runs on its own",
    "docs/integrations.md": "tests/integrations/test_docs_page.py runs its blocks as written, in "
                            "page order, on two forked gloo workers (no torchrun start-up "
                            "per block)",
}

_PAPER_SCALE = r"llama-(?:134m|500m|1b)"
# Commands that train or estimate by running training steps: their sizes shrink.
_TRAINS = r"\b(?:subnetdp(?:\.cli)? (?:train|bench|demo)\b|torchrun\b)"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (``` fences; info string's first word = language)."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{start + 1}: unclosed code fence")
        found.append(Block(page, start + 1, (info.split() or [""])[0].lower(), "\n".join(body)))
        i += 1
    return found


def commands(block: Block) -> list[str]:
    """A shell block's commands, continuation lines joined; comments and blank lines dropped."""
    text = block.code
    if block.lang == "console":
        kept, cont = [], False
        for line in text.splitlines():
            if line.startswith("$ ") or cont:
                kept.append(line[2:] if line.startswith("$ ") and not cont else line)
                cont = line.rstrip().endswith("\\")
        text = "\n".join(kept)
    joined = re.sub(r"\\\n\s*", " ", text)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def skipped(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, command)), None)


def sized(command: str, steps: int, workspace: Path, port: int) -> str:
    """SIZES: the only changes made to a command, all of sizes and placeholders."""
    c = re.sub(r"--steps([ =])\d+", rf"--steps\g<1>{steps}", command)
    c = re.sub(r"--nproc-per-node([ =])\d+", r"--nproc-per-node\g<1>2", c)
    c = re.sub(r"--nnodes([ =])\S+", r"--nnodes\g<1>1", c)  # multi-node: one node, local endpoint
    c = re.sub(r"\bHOST:\d+", f"127.0.0.1:{port}", c)
    c = re.sub(r"(?<![\w.])/shared/", f"{workspace}/shared/", c)  # a filesystem all nodes share
    c = re.sub(r"--((?:eval-)?limit)([ =])\d+", r"--\g<1>\g<2>2", c)  # documents per task
    if "--eval-batches" not in c:  # validation batches: 2, not the default 40
        c = re.sub(r"\b(subnetdp(?:\.cli)? (?:train|eval))\b", r"\g<1> --eval-batches 2", c)
    if re.search(_TRAINS, c):
        c = re.sub(_PAPER_SCALE, "llama-tiny", c)
        c = re.sub(r"--seq-len([ =])(\d+)",
                   lambda m: f"--seq-len{m[1]}{min(int(m[2]), 128)}", c)
        if re.search(r"\b(?:train|demo|bench (?:step|all))\b", c):  # these start workers: 2 cores
            c = re.sub(r"--(nproc|world)([ =])\d+", r"--\g<1>\g<2>2", c)
    if re.match(r"^(\S*/)?(python3? -m )?pytest\b", c):  # the suite: check the selection exists
        c = f"(cd {shlex.quote(str(REPO))} && {c} --collect-only -q)"
    return c


def torchrun_procs(code: str) -> int:
    marker = re.search(r"^#\s*torchrun:\s*(\d+)", code, re.M)
    if marker:
        return min(int(marker[1]), 2)
    uses_dist = re.search(r"torch\.distributed|init_process_group|init_distributed", code)
    return 2 if uses_dist else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scratch(workspace: Path) -> dict[str, str]:
    """The scratch folder a page runs in: the venv and the examples where the page expects
    them, and an environment that uses this checkout."""
    (workspace / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    (workspace / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env["WANDB_MODE"] = "offline"  # the documented default; a user's shell may say otherwise
    return env


def run_block(block: Block, script: str, workspace: Path, env: dict[str, str]) -> None:
    done = subprocess.run(["bash", "-c", script], cwd=workspace, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=BLOCK_TIMEOUT_S, check=False)
    if done.returncode:
        raise AssertionError(f"{block.where}: exit {done.returncode} running\n{script}\n"
                             f"--- output (last 3000 chars) ---\n{done.stdout[-3000:]}")


def run_page(page: Path, workspace: Path) -> None:
    """Run a page's blocks in order in ``workspace``; raise on the first that fails."""
    env = scratch(workspace)
    port, resumes = free_port(), 0
    for n, block in enumerate(blocks(page)):
        first = block.code.split("\n", 1)[0]
        if first.startswith("# file: "):
            (workspace / first[len("# file: "):].strip()).write_text(block.code + "\n")
        elif block.lang in SHELL:
            lines = []
            for c in commands(block):
                if skipped(c):
                    lines.append(f": skipped: {shlex.quote(c)}")
                    continue
                # A fresh run trains 2 steps; each resume of the page goes 2 further (one step
                # to warm up, one to time).
                resumes += "--resume" in c
                steps = 2 + 2 * resumes if "--resume" in c else 2
                lines.append(sized(c, steps, workspace, port))
            run_block(block, "set -eo pipefail\n" + "\n".join(lines), workspace, env)
        elif block.lang == "python":
            script = workspace / f"block{n}.py"
            script.write_text(block.code + "\n")
            procs = torchrun_procs(block.code)
            launch = (f"python -m torch.distributed.run --standalone --nproc-per-node {procs}"
                      if procs > 1 else "python")
            run_block(block, f"{launch} {script.name}", workspace, env)


def runnable(page: Path) -> bool:
    if str(page.relative_to(REPO)) in TESTED_ELSEWHERE:
        return False
    return any(b.lang in SHELL | {"python"} for b in blocks(page))


def page_cost(page: Path) -> int:
    return sum(len(commands(b)) if b.lang in SHELL else b.lang == "python" for b in blocks(page))


@pytest.fixture(scope="module")
def page_failures(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> dict[Path, str]:
    """Run the selected pages two at a time (a page mostly waits for processes to start, and
    the machine has 2 cores), the longest first; each page's own test reports its failure."""
    selected = [
        Path(item.callspec.params["page"]) for item in request.session.items  # type: ignore[arg-type]
        if isinstance(item, pytest.Function) and item.originalname == "test_page_blocks_run"]

    def attempt(page: Path) -> str | None:
        try:
            run_page(page, tmp_path_factory.mktemp(page.stem))
        except (AssertionError, subprocess.TimeoutExpired) as e:
            return str(e)
        return None

    order = sorted(selected, key=page_cost, reverse=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(order, pool.map(attempt, order), strict=True))
    return {page: error for page, error in results.items() if error}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_page_blocks_run(page: Path, page_failures: dict[Path, str]) -> None:
    if page in page_failures:
        pytest.fail(page_failures[page], pytrace=False)


def test_every_fence_names_its_language() -> None:
    """Output samples and trees are ```text, commands ```bash, so the block test knows what to
    run: a bare fence would be silently skipped."""
    known = SHELL | SHOWN | {"python"}
    bad = [f"{b.where}: ```{b.lang}" for p in PAGES for b in blocks(p) if b.lang not in known]
    assert not bad, ("fences without a known language (use ```text for output, ```bash for "
                     "commands): " + "; ".join(bad))


def test_readme_is_a_ten_minute_read() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move details to docs/"


def test_benchmarks_page_indexes_every_result_file() -> None:
    index = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    files = [*(REPO / "benchmarks" / "results").iterdir(), *(REPO / "docs" / "results").iterdir()]
    missing = sorted(f.name for f in files if f.is_file() and f.name not in index)
    assert not missing, f"docs/benchmarks.md does not index {', '.join(missing)}"
