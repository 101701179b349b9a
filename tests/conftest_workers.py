"""The suite on two workers (the README's ``-n 2 --dist loadfile``): which tests run together, and in what order.

Alone the suite keeps ~57% of the 2 cores busy (measured: 1,898 s user + 309 s sys in 1,933 s): most tests wait on
process starts, engines and evaluations. Two workers fill the other core.

* **A unit per file, except one.** xdist's ``loadfile`` sends a whole file to one worker, so a file's module
  fixtures start once. The files of ``SHARED_SESSION_FILES`` form a single unit: they share the session's real
  SGLang server and the quickstart's warm start (an SFT of ~70-110 s), which are then built once, and the real
  SGLang servers (each busy-polls a core while idle) never run two at a time. ``pytest_collection_modifyitems``
  fails the run when a test outside those files asks for either fixture.
* **Longest first.** The units are handed out in collection order, so the collection is sorted to start with the
  shared unit and the longest files (``LONGEST_FIRST``, from a ``--durations`` run): neither worker is left
  running a long file alone at the end.

(xdist's ``loadgroup`` would say the same with markers, but pytest-xdist 3.8 tags a group by setting
``item._nodeid``, which pytest 9.2's ``Node.nodeid`` no longer reads: every group was ignored.)
"""

from __future__ import annotations

import pytest

SHARED_SESSION_FILES = ("test_sglang_real.py", "test_sglang_quickstart.py", "test_judge.py", "test_run.py")
SHARED_FIXTURES = ("sglang_server", "quickstart_warm_start")
LONGEST_FIRST = (  # after the shared unit (~570 s): measured seconds on the 2-core machine, alone
    "test_bench_smoke.py",  # 257
    "test_visual_env.py",  # 198
    "test_run_faults.py",  # 72
    "test_weight_push_engine.py",  # 62
    "test_code_quality.py",  # 47
    "test_chaos.py",  # 44
)
SHARED_UNIT = "shared session: " + ", ".join(SHARED_SESSION_FILES)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the shared unit."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNIT if path.rsplit("/", 1)[-1] in SHARED_SESSION_FILES else path


def _rank(item: pytest.Item) -> int:
    name = item.path.name
    if name in SHARED_SESSION_FILES:
        return 0
    return 1 + LONGEST_FIRST.index(name) if name in LONGEST_FIRST else 1 + len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    strays = sorted({i.nodeid for i in items if i.path.name not in SHARED_SESSION_FILES and _uses_a_shared_fixture(i)})
    if strays:
        raise pytest.UsageError(
            f"{strays[0]} uses {' or '.join(SHARED_FIXTURES)} but its file is not in SHARED_SESSION_FILES "
            "(tests/conftest_workers.py): on two workers the fixture would be built twice"
        )
    items.sort(key=_rank)  # stable: every file keeps its own order


def _uses_a_shared_fixture(item: pytest.Item) -> bool:
    from tests.conftest_sglang import uses_the_server

    return uses_the_server(item) or "quickstart_warm_start" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedSessionScheduling(LoadFileScheduling):
        """``loadfile``, with the shared unit, handed out in collection order."""

        def __init__(self, config: pytest.Config, log=None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # collection order: the longest units first

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return SharedSessionScheduling(config, log)
