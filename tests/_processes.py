"""Stopping the processes a test starts, so that a test that fails (or runs out of time) leaves none behind."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_agentrl_run(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop an ``agentrl run`` the way its users do: SIGTERM, on which it stops every child it started
    (each in a session of its own, which killing the run's process group would miss); SIGKILL its group
    (or it) only if it is still there after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session=True
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
