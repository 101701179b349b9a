"""The docs cannot drift from the code: every code pointer they hold must resolve in the tree.

* ``docs/architecture.md`` stays an overview a newcomer reads in one sitting (at most 400 lines).
* Every ``agentrl/...py`` path in README.md, docs/*.md and tests/README.md exists; a path followed by
  ``:name`` (``agentrl/episode/rollout.py:run_episode``, ``...:Class.method``) names something defined there.
* Every dotted ``agentrl.<module>`` name resolves to a module of the tree, and what follows the module
  (``agentrl.actors.metrics.RewardErrors``, ``agentrl.envs.calculator:CalculatorEnv``) is defined in it.
* Every repository path (``tests/...``, ``bench/...``, ``examples/...``, ``scripts/...``, ``sandboxes/...``), every
  test module named by its file name (``test_chaos.py``) and every relative markdown link exists, and so does every
  ``docs/<page>.md`` named.
* Every module docstring under agentrl/ is at most 30 lines: what the module is for and its invariants; the
  rest belongs to the docs pages.

Names are read with ``ast`` (nothing is imported), so the test is fast and needs no optional dependency.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_ARCHITECTURE_LINES = 400
MAX_DOCSTRING_LINES = 30

PATH = re.compile(r"\bagentrl/[\w/]+\.py(?::([A-Za-z_][\w.]*))?")
# not part of a file name (DIR/agentrl.yaml) nor of a longer word
DOTTED = re.compile(r"(?<![\w/.-])agentrl((?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_][\w.]*))?")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOCS_PAGE = re.compile(r"\bdocs/[\w-]+\.md\b")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|bench|examples|scripts|sandboxes|\.ci)/[\w./-]*\w)")
TEST_FILE = re.compile(r"(?<![\w/.-])((?:test_|conftest|_[a-z])\w*\.py)\b")


def doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@functools.cache
def top_level(path: Path) -> dict[str, ast.AST]:
    """The names a module defines at top level (functions, classes, assignments, imports)."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(item.name)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
    # attributes set in methods (self.x = ...)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                members.add(sub.attr)
    return members


def defines(module: Path, dotted: str) -> bool:
    """Whether ``module`` defines ``dotted`` (``name``, or ``Class.member`` for a class of its own)."""
    first, *rest = dotted.split(".")
    node = top_level(module).get(first)
    if node is None:
        return False
    if rest and isinstance(node, ast.ClassDef):
        return rest[0] in class_members(node)
    return True  # a member of something that is not a class of this module: not checked further


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def dotted_problem(name: str, colon: str | None) -> str:
    """Why ``agentrl.<name>`` (optionally ``:colon``) does not resolve, or ``""``."""
    parts = ["agentrl", *name.split(".")]
    for cut in range(len(parts), 1, -1):
        module = module_file(parts[:cut])
        if module is None:
            continue
        attr = ".".join(parts[cut:])
        if attr and not defines(module, attr):
            return f"{module.relative_to(ROOT)} defines no {attr.split('.')[0]!r}"
        if colon and not defines(module, colon):
            return f"{module.relative_to(ROOT)} defines no {colon!r}"
        return ""
    return f"no module {'.'.join(parts[:2])} in the tree"


def pointer_problems(text: str) -> list[str]:
    problems = []
    for m in PATH.finditer(text):
        path = ROOT / m.group(0).split(":")[0]
        if not path.is_file():
            problems.append(f"{m.group(0)}: no such file")
        elif m.group(1) and not defines(path, m.group(1)):
            problems.append(f"{m.group(0)}: {m.group(1)!r} is not defined there")
    for m in DOTTED.finditer(text):
        problem = dotted_problem(m.group(1)[1:], m.group(2))
        if problem:
            problems.append(f"{m.group(0)}: {problem}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_pointer_resolves(doc: Path):
    problems = pointer_problems(doc_text(doc))
    assert not problems, f"{doc.relative_to(ROOT)} points at code that is not there:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_page_and_repository_path_exists(doc: Path):
    text = doc_text(doc)
    missing = [
        target
        for target in LINK.findall(text)
        if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists()
    ]
    missing += [page for page in DOCS_PAGE.findall(text) if not (ROOT / page).is_file()]
    missing += [path for path in REPO_PATH.findall(text) if not (ROOT / path).exists()]
    missing += [name for name in TEST_FILE.findall(text) if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {sorted(set(missing))}"


def test_the_architecture_overview_is_read_in_one_sitting():
    lines = doc_text(ROOT / "docs" / "architecture.md").count("\n")
    assert lines <= MAX_ARCHITECTURE_LINES, (
        f"docs/architecture.md has {lines} lines (at most {MAX_ARCHITECTURE_LINES}): move the detail to a subsystem page"
    )


def test_module_docstrings_are_short():
    long = []
    for path in sorted((ROOT / "agentrl").rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if docstring and docstring.strip("\n").count("\n") + 1 > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)}: {docstring.strip(chr(10)).count(chr(10)) + 1} lines")
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the rest to docs/):\n" + "\n".join(long)


def test_the_checks_catch_a_moved_pointer():
    """The checks themselves: a path, a dotted name and a defined name that are not in the tree fail."""
    assert pointer_problems("`agentrl/actors/rollout.py`")
    assert pointer_problems("`agentrl.actors.serve`")
    assert pointer_problems("`agentrl/episode/chat.py:NoSuchThing`")
    assert pointer_problems("`agentrl.episode.chat.NoSuchThing`")
    assert pointer_problems("`agentrl.envs.calculator:NoSuchEnv`")
    assert not pointer_problems("`agentrl/episode/chat.py:TokenChat.close_turn_and_add` `agentrl.episode.chat`")
    assert not pointer_problems("`DIR/agentrl.yaml` and `agentrl.envs.calculator:CalculatorEnv`")
    assert REPO_PATH.findall("see `bench/chaos.py` and tests/_fuzz.py") == ["bench/chaos.py", "tests/_fuzz.py"]
    assert TEST_FILE.findall("`test_chaos.py`, `tests/test_run.py`, `conftest_engine.py`") == [
        "test_chaos.py",
        "conftest_engine.py",
    ]
