"""Shared pieces of the sandbox tests: availability checks and the containment programs."""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(reason: str | None) -> None:
    """Skip with ``reason`` locally; fail in CI, where every backend must be testable."""
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI must be able to run this test: {reason}")
    pytest.skip(reason)


@contextmanager
def changed_settings(sandbox, **changes):
    """Run a sandbox with some settings changed (e.g. a longer wall time for a CPU-limit test:
    on a loaded machine one CPU second can take several wall-clock seconds)."""
    old = sandbox.settings
    sandbox.settings = dataclasses.replace(old, **changes)
    try:
        yield sandbox.settings
    finally:
        sandbox.settings = old


READ_OUTSIDE = """
import os
targets = {paths!r}
for p in targets:
    try:
        if os.path.isdir(p):
            print("LISTED", p, os.listdir(p)[:3])
        else:
            print("READ", p, open(p).read(40))
    except OSError as e:
        print("DENIED", p, type(e).__name__)
try:
    open("/usr/agentrl-test", "w")
    print("WROTE /usr")
except OSError as e:
    print("DENIED /usr", type(e).__name__)
print("ENV", sorted(os.environ))
"""

CONNECT = """
import socket
for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        print("CONNECTED", host)
    except OSError as e:
        print("BLOCKED", host, e.errno)
try:
    socket.getaddrinfo("example.com", 80)
    print("RESOLVED")
except OSError:
    print("NO DNS")
"""

COUNT_FORKS = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("forks", n, e.errno)
"""

FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

ALLOCATE = "x = bytearray(1024 * 1024 * 1024)\nprint('allocated 1 GB')"
SPIN = "while True:\n    pass"
SLEEP = "import time\ntime.sleep(120)"
FLOOD = "while True:\n    print('y' * 1000)"
ESCAPE = """
import os, subprocess, time
subprocess.Popen(["{python}", "-c", "import os, time; os.setsid(); time.sleep(300)"])
time.sleep(1)  # let it leave this session before the run ends
print("left a sleeper behind")
"""
