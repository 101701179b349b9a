"""The code checks CI runs with the tests: the layer contract, ruff (lint and format) and the type checker.

Each runs the pinned tool (``pyproject.toml``, ``[project.optional-dependencies] dev``) over the tree as it is;
the layer test also plants an upward import in a copy of the package and checks the contract catches it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CHECKED = ["agentrl", "tests", "bench", "examples"]


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}: bash scripts/install.sh installs the dev extras")
    return str(path)


def run(argv: list[str], cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_the_layers_run_one_way():
    res = run([tool("lint-imports")])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("agentrl/engine/server.py", "agentrl.agents.chat_service"),  # an engine that imports a role
        ("agentrl/learner/loop.py", "agentrl.engine.client"),  # a learner that talks to engines by import
        ("agentrl/episode/chat.py", "agentrl.actors.actor"),  # the episode reaching up into a role
        ("agentrl/config.py", "agentrl.transport"),  # the core importing the wire
    ],
)
def test_an_import_against_the_layers_breaks_the_contract(tmp_path, module, upward):
    """Plant one upward import (inside a function, where lazy imports hide) in a copy of the package."""
    shutil.copytree(ROOT / "agentrl", tmp_path / "agentrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as f:
        f.write(f"\n\ndef _planted() -> None:\n    import {upward}  # noqa: F401\n")
    res = subprocess.run(
        [tool("lint-imports"), "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": str(BIN), "PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode != 0, res.stdout[-2000:]
    assert upward in res.stdout


def import_cycles(package: str) -> list[list[str]]:
    """Strongly connected groups of more than one module in ``package``'s import graph (function-level
    imports included), by Tarjan's algorithm."""
    import grimp

    graph = grimp.build_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_anywhere():
    """With no cycle, no import sits inside a function to dodge one (the lazy ones are for start-up speed)."""
    assert import_cycles("agentrl") == []


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclepkg import a\n")
    (pkg / "c.py").write_text("from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclepkg") == [["cyclepkg.a", "cyclepkg.b"]]


def test_ruff_lint_is_clean():
    res = run([tool("ruff"), "check", "--no-cache", *CHECKED])
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def test_ruff_format_is_clean():
    res = run([tool("ruff"), "format", "--check", "--no-cache", *CHECKED])
    assert res.returncode == 0, "run `.venv/bin/ruff format` on:\n" + res.stdout[-6000:]


def test_the_type_checker_is_clean():
    res = run([tool("basedpyright")], timeout=600)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
