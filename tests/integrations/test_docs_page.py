"""Issue 31, item 5: docs/integrations.md runs as written.

Its Python blocks (Lightning, ``SDPTrainer``, the accelerate recipe) run verbatim, in page
order, in one scratch folder, on 2 gloo workers forked once (as under ``torchrun``: each
framework finds torch elastic's environment and joins the process group that exists), so the
page costs one start-up instead of a ``torchrun`` per block. The page has no other runnable
block: a shell block would need this test to run it too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dist.harness import run_workers
from tests.docs.test_code_blocks import SHELL, TESTED_ELSEWHERE, blocks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _run_page(rank: int, world: int, codes: list[str], folder: str) -> list[str]:
    os.environ.update({"TORCHELASTIC_RUN_ID": "docs", "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"})  # the group exists: no port is opened
    os.chdir(folder)
    for i, code in enumerate(codes):
        exec(compile(code, f"{PAGE.name} python block {i + 1}", "exec"), {"__name__": "__main__"})
    return sorted(os.listdir(folder))


def test_integrations_page_runs_as_written(tmp_path: Path) -> None:
    assert "docs/integrations.md" in TESTED_ELSEWHERE  # the page test leaves it to this one
    page = blocks(PAGE)
    assert not [b.where for b in page if b.lang in SHELL]
    codes = [b.code for b in page if b.lang == "python"]
    assert len(codes) == 3 and "SDPStrategy" in codes[0] and "SDPTrainer" in codes[1]
    files = run_workers(_run_page, 2, codes, str(tmp_path))[0]
    # what the page says it writes
    assert {"net.ckpt", "net.sdp", "hf-run", "hf-llama", "acc-run"} <= set(files)
    assert (tmp_path / "hf-run" / "checkpoint-2" / "sdp").is_dir()
