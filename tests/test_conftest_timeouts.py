"""tests/conftest.py's nets for slow tests, in a pytest of their own: a slow ``trio.run`` is cancelled
inside trio before the test's timeout (and the process it started is stopped); a timeout that fires
inside ``trio.run`` anyway leaves no run state behind for the next test."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_slow_trio_run_fails_alone(pytester, tmp_path):
    pytester.makeconftest(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.conftest import (pytest_configure, pytest_runtest_call, pytest_timeout_cancel_timer,  # noqa: F401
                                    pytest_timeout_set_timer, pytest_unconfigure)
    """)
    )
    pid_file = tmp_path / "child.pid"
    pytester.makepyfile(
        test_slow=textwrap.dedent(f"""
        import sys
        import pytest
        import trio
        import trio.testing

        @pytest.mark.timeout(6)
        def test_slow_run():
            async def main():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.run_process, [sys.executable, "-c",
                        "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(100)"])
                    await trio.sleep(100)
            trio.run(main)

        @pytest.mark.timeout(3)
        def test_timeout_inside_a_run_with_its_own_clock():
            trio.run(trio.sleep, 100, clock=trio.testing.MockClock())  # no deadline of ours: pytest-timeout fires

        def test_the_next_run_works():
            assert trio.run(trio.sleep, 0) is None and not trio.lowlevel.in_trio_run()
    """)
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore", timeout=120)
    result.assert_outcomes(failed=2, passed=1)
    out = result.stdout.str()
    assert "too slow: trio.run was cancelled 1.5 s before this test's 6 s timeout" in out
    assert "Timeout (>3.0s) from pytest-timeout" in out and "the run was closed so later tests can run" in out
    assert "Attempted to call run() from inside a run()" not in out
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass  # the cancelled run stopped its process
    else:
        raise AssertionError(f"the slow run's process {pid} is still alive")
