"""Every code block of README.md and docs/*.md runs as written.

A page's fenced blocks run in page order in one scratch folder (so a page can train, then
resume, then export), with the package's venv on PATH and this checkout's ``src`` first:

- ```bash, ```sh: a shell script (``set -e``); ```console: its ``$ `` lines only;
- ```python: a script, under ``torchrun --nproc-per-node N`` when it says ``# torchrun: N`` or
  uses torch.distributed (N = 2), else plain ``python``;
- any block whose first line is ``# file: NAME`` is written to NAME first (a config file);
- every other language (text, toml, json, ...) is only shown.

Only sizes and placeholders change (``SIZES``; applied per command, so a new page needs no
entry); the commands in ``SKIPPED`` are not run, each for the reason it gives. Anything else that
fails fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

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


def steps_map(page_commands: list[str]) -> dict[int, int]:
    """Each distinct ``--steps N`` of a page -> 2, 4, 6, ...: tiny runs that keep the page's
    order, so a resume still has two steps to go (one to warm up, one to time)."""
    values = sorted({int(v) for c in page_commands for v in re.findall(r"--steps[ =](\d+)", c)})
    return {v: 2 + 2 * k for k, v in enumerate(values)}


def sized(command: str, steps: dict[int, int], workspace: Path, port: int) -> str:
    """SIZES: the only changes made to a command, all of sizes and placeholders."""
    c = re.sub(r"--steps([ =])(\d+)", lambda m: f"--steps{m[1]}{steps[int(m[2])]}", command)
    c = re.sub(r"--nproc([ =])\d+", r"--nproc\g<1>2", c)  # 2 cores
    c = re.sub(r"--nproc-per-node([ =])\d+", r"--nproc-per-node\g<1>2", c)
    c = re.sub(r"--nnodes([ =])\S+", r"--nnodes\g<1>1", c)  # multi-node: one node, local endpoint
    c = re.sub(r"\bHOST:\d+", f"127.0.0.1:{port}", c)
    c = re.sub(r"(?<![\w.])/shared/", f"{workspace}/shared/", c)  # a filesystem all nodes share
    c = re.sub(r"--limit([ =])\d+", r"--limit\g<1>2", c)  # documents per downstream task
    if re.search(_TRAINS, c):
        c = re.sub(_PAPER_SCALE, "llama-tiny", c)
        c = re.sub(r"--seq-len([ =])(\d+)",
                   lambda m: f"--seq-len{m[1]}{min(int(m[2]), 128)}", c)
        if re.search(r"\bbench (?:step|all)\b", c):  # bench step starts --world workers
            c = re.sub(r"--world([ =])\d+", r"--world\g<1>2", c)
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


def runnable(page: Path) -> bool:
    return any(b.lang in SHELL | {"python"} or b.code.startswith("# file: ")
               for b in blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    env = scratch(tmp_path)
    page_blocks = blocks(page)
    shell_cmds = [c for b in page_blocks if b.lang in SHELL for c in commands(b)]
    steps = steps_map([c for c in shell_cmds if not skipped(c)])
    port = free_port()
    for n, block in enumerate(page_blocks):
        first = block.code.split("\n", 1)[0]
        if first.startswith("# file: "):
            (tmp_path / first[len("# file: "):].strip()).write_text(block.code + "\n")
        if block.lang in SHELL:
            lines = [f": skipped: {shlex.quote(c)}" if skipped(c)
                     else sized(c, steps, tmp_path, port) for c in commands(block)]
            run_block(block, "set -eo pipefail\n" + "\n".join(lines), tmp_path, env)
        elif block.lang == "python":
            script = tmp_path / f"block{n}.py"
            script.write_text(block.code + "\n")
            procs = torchrun_procs(block.code)
            launch = (f"python -m torch.distributed.run --standalone --nproc-per-node {procs}"
                      if procs > 1 else "python")
            run_block(block, f"{launch} {script.name}", tmp_path, env)


def test_every_fence_names_its_language() -> None:
    """Output samples and trees are ```text, commands ```bash, so the block test knows what to
    run: a bare fence would be silently skipped."""
    known = SHELL | SHOWN | {"python"}
    bad = [f"{b.where}: ```{b.lang}" for p in PAGES for b in blocks(p) if b.lang not in known]
    assert not bad, ("fences without a known language (use ```text for output, ```bash for "
                     "commands): " + "; ".join(bad))
