"""Test configuration: each area registers its fixtures module here.

**A slow test fails alone.** pytest-timeout's SIGALRM raises in whatever frame runs; inside
``trio.run`` that is mostly trio's I/O wait, outside any task: the exception leaves ``trio.run``
without unwinding its tasks (no cancellation, so no cleanup: children keep running) and leaves
trio's run state set, so every later ``trio.run`` of the session fails with "Attempted to call
run() from inside a run()". Two nets:

* While a test's timeout runs, a ``trio.run`` in the main thread is cancelled from inside trio a
  little before the timeout (``CLEANUP_MARGIN_S``, at most a quarter of it): its tasks unwind as on
  any cancellation (the supervisor stops its children) and the test fails with a message saying so.
* If the timeout fires inside ``trio.run`` anyway (cleanup slower than the margin, a task stuck in
  a blocking call), the interrupted run is closed as trio closes an abandoned run, so that the
  next test can call ``trio.run``; the failure says so.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

import pytest

pytest_plugins = ["tests.conftest_engine", "tests.conftest_sglang", "tests.conftest_workers", "pytester"]

CLEANUP_MARGIN_S = 30.0  # what a cancelled run gets to stop its children before pytest-timeout fires

_deadline: list[tuple[float, float, float]] = []  # the current test's (deadline, timeout, margin), while its timer runs
_real_trio_run = None
_abandoned_runs: list = []  # runs a timeout interrupted from outside trio (see _close_interrupted_trio_run)


def _bounded_trio_run(async_fn, *args, **kwargs):
    import trio

    if not _deadline or threading.current_thread() is not threading.main_thread() or "clock" in kwargs:
        return _real_trio_run(async_fn, *args, **kwargs)  # a test's own clock keeps its own time
    deadline, timeout, margin = _deadline[0]

    async def bounded():
        with trio.move_on_after(max(0.0, deadline - time.monotonic())):
            return await async_fn(*args)
        pytest.fail(
            f"too slow: trio.run was cancelled {margin:g} s before this test's {timeout:g} s timeout "
            "(its tasks were cancelled and cleaned up)",
            pytrace=False,
        )

    return _real_trio_run(bounded, **kwargs)


def pytest_configure(config):
    global _real_trio_run
    import trio

    _real_trio_run = trio.run
    trio.run = _bounded_trio_run


def pytest_unconfigure(config):
    import trio

    if _real_trio_run is not None:
        trio.run = _real_trio_run


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout starts the test's timer now: note when trio runs must have ended (returns None,
    so pytest-timeout's own timer starts too)."""
    margin = min(CLEANUP_MARGIN_S, settings.timeout / 4)
    _deadline[:] = [(time.monotonic() + settings.timeout - margin, settings.timeout, margin)]


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    _deadline.clear()


def _close_interrupted_trio_run(exc: BaseException) -> bool:
    """Close a ``trio.run`` that ``exc`` left from outside its tasks; whether there was one."""
    trio = sys.modules.get("trio")
    if trio is None or not trio.lowlevel.in_trio_run():
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _real_trio_run.__code__:
        tb = tb.tb_next
    if tb is not None:
        local = tb.tb_frame.f_locals
        # Its tasks never unwound, and their finalizers fail outside a run; one that runs inside a later
        # ast.parse (pytest formats failures with it) breaks CPython 3.11's AST constructor ("recursion
        # depth mismatch"). So they are kept, never finalized.
        _abandoned_runs.append(local.get("runner"))
        gen = local.get("gen")
        if gen is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gen.close()  # trio.run's loop: trio closes the run as an abandoned one (signals, I/O, hooks)
    if trio.lowlevel.in_trio_run():  # not found in the traceback: forget the run as trio does at its end
        _abandoned_runs.append(dict(trio._core._run.GLOBAL_RUN_CONTEXT.__dict__))
        trio._core._run.GLOBAL_RUN_CONTEXT.__dict__.clear()
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except BaseException as exc:
        if _close_interrupted_trio_run(exc):
            exc.add_note(
                "agentrl tests: this exception interrupted trio.run outside its tasks (its tasks did not "
                "unwind; processes they started may be left); the run was closed so later tests can run"
            )
        raise
