"""Shape rules of issue 43 over src/, counted: a strategy is asked what it means, never which
level it is, outside strategy.py; no hand-written strategy-name list; functions fit a screen."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from subnetdp.strategy import SDP_NAMES

SRC = Path(__file__).resolve().parents[2] / "src" / "subnetdp"
# lines naming neuron_level outside strategy.py: at most this many (issue 43's done-when)
MAX_LEVEL_SITES = 5
# h-config rewrites these files (issue 43 items 1-2); the lead tightens at merge
H_CONFIG_FILES = {"train/config.py", "train/applies.py", "train/init_from.py",
                  "commands/train_cmd.py", "commands/plan_cmd.py"}
MAX_FUNCTION_LINES = 80
# h-config rewrites these two (issue 43 items 1-2); the lead tightens at merge
H_CONFIG_FUNCTIONS = {"commands/train_cmd.py::add_train_arguments",
                      "commands/plan_cmd.py::add_parser"}


def _parse(root: Path) -> tuple[tuple[str, ast.Module], ...]:
    return tuple((path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
                 for path in sorted(root.rglob("*.py")))


_parse_src = functools.cache(lambda: _parse(SRC))  # src/ parsed once per session


def _modules(root: Path = SRC) -> tuple[tuple[str, ast.Module], ...]:
    return _parse_src() if root == SRC else _parse(root)


def level_sites(root: Path = SRC) -> list[str]:
    """Every line outside strategy.py that names ``neuron_level`` (``s.neuron_level``, a
    keyword of that name: the issue's grep), as ``file:line``."""
    return [f"{path.relative_to(root).as_posix()}:{i}"
            for path in sorted(root.rglob("*.py")) if path != root / "strategy.py"
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bneuron_level\b", line)]


def name_lists(root: Path = SRC) -> list[str]:
    """Literal tuples, lists, sets and dict keys outside strategy.py naming two or more SDP
    strategies (alone or composed: ``"b-sdp+fsdp"``), as ``file:line``."""
    found = []
    for name, tree in _modules(root):
        if name == "strategy.py":
            continue
        for node in ast.walk(tree):
            items: list[ast.expr | None]
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                items = list(node.elts)
            elif isinstance(node, ast.Dict):
                items = list(node.keys)
            else:
                continue
            named = [i.value for i in items if isinstance(i, ast.Constant)
                     and isinstance(i.value, str) and i.value.split("+")[0] in SDP_NAMES]
            if len(named) >= 2:
                found.append(f"{name}:{node.lineno}")
    return found


def long_functions(root: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``file::function`` -> lines (decorators, docstring and body) of each one over
    ``limit``."""
    out = {}
    for name, tree in _modules(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                if lines > limit:
                    out[f"{name}::{node.name}"] = lines
    return out


def test_strategy_level_is_asked_in_strategy_py_only() -> None:
    """Callers ask the strategy what it means (``splits_layers``, ``fsdp_keeps_gathered``,
    ``balanceable``, ...), so a new level changes strategy.py and its own module."""
    sites = [s for s in level_sites() if s.split(":")[0] not in H_CONFIG_FILES]
    assert len(sites) <= MAX_LEVEL_SITES, (
        f"{len(sites)} `neuron_level` sites outside strategy.py (at most {MAX_LEVEL_SITES}): "
        f"{', '.join(sites)}; ask a named property of Strategy instead")


def test_no_hand_written_strategy_name_list() -> None:
    """The advisor's options and the study's methods come from the strategy table."""
    found = name_lists()
    assert not found, ("strategy names listed by hand (derive them from strategy.STRATEGIES): "
                       + ", ".join(found))


def test_functions_fit_a_screen() -> None:
    over = long_functions()
    assert set(over) <= H_CONFIG_FUNCTIONS, (
        f"functions over {MAX_FUNCTION_LINES} lines: "
        + ", ".join(f"{k} ({v})" for k, v in sorted(over.items()) if k not in H_CONFIG_FUNCTIONS))


def test_the_counters_find_what_they_count(tmp_path: Path) -> None:
    """Each rule's counter sees a site of its own kind (so a pass is not an empty search)."""
    (tmp_path / "m.py").write_text(
        "OPTIONS = ('ddp', 'b-sdp', 'n-sdp+fsdp')\n"
        "STYLE = {'b-sdp': 1, 'bb-sdp': 2}\n"
        "ONE = ('ddp', 'b-sdp')\n"
        "def f(s):\n" + "    x = s.neuron_level\n" * (MAX_FUNCTION_LINES - 1),
        encoding="utf-8")
    (tmp_path / "strategy.py").write_text("X = ('b-sdp', 'n-sdp')\nY = s.neuron_level\n",
                                          encoding="utf-8")
    assert name_lists(tmp_path) == ["m.py:1", "m.py:2"]
    assert len(level_sites(tmp_path)) == MAX_FUNCTION_LINES - 1
    assert long_functions(tmp_path) == {}
    (tmp_path / "m.py").write_text((tmp_path / "m.py").read_text() + "    return x\n")
    assert long_functions(tmp_path) == {"m.py::f": MAX_FUNCTION_LINES + 1}
