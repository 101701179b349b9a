"""Shared pieces of the sandbox tests: availability checks, host checks, the attack programs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from contextlib import contextmanager

import pytest
import trio

from agentrl.tools.sandbox import SandboxSettings, create_sandbox

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(reason: str | None) -> None:
    """Skip with ``reason`` locally; fail in CI, where every backend must be testable."""
    if reason is None:
        return
    if IN_CI:
        pytest.fail(f"CI must be able to run this test: {reason}")
    pytest.skip(reason)


BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]
IMAGE = os.environ.get("AGENTRL_SANDBOX_IMAGE", "agentrl-python:latest")


def unavailable(settings: SandboxSettings) -> str | None:
    if settings.backend == "local":
        from agentrl.tools.sandbox.local import bwrap_available

        return bwrap_available()
    from agentrl.tools.sandbox.docker import docker_unavailable

    return docker_unavailable(settings)


def open_sandbox(backend: str, slot: int, **settings):
    """A real sandbox of ``backend`` (skipped locally, failed in CI, when it cannot run here)."""
    s = SandboxSettings(backend=backend, image=IMAGE, lifetime_s=600, **settings)
    require(unavailable(s))
    return trio.run(create_sandbox, s, slot)


def processes_of(uid: int | None) -> list[str]:
    """Every host process of ``uid``, zombies included."""
    if uid is None:
        return []
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-u", str(uid)], capture_output=True, text=True)
    return out.stdout.splitlines()


def orphan_zombies() -> set[tuple[int, str]]:
    """Zombies left to pid 1 (which may never reap them), as (pid, command)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,comm="], capture_output=True, text=True)
    found = set()
    for line in out.stdout.splitlines():
        pid, ppid, stat, comm = (line.split(None, 3) + [""])[:4]
        if ppid == "1" and stat.startswith("Z"):
            found.add((int(pid), comm))
    return found


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

# --------------------------------------------------------------- aggregate limits and escapes

MEMORY_SPREAD = """
import os, select, time
N, MB = 8, 80
kids = []
for i in range(N):  # one after the other: each child allocates (or dies) before the next starts
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            block = b"x" * (MB << 20)  # every page touched
        except MemoryError:
            os._exit(1)
        os.write(w, b"+")
        time.sleep(30)
        os._exit(0)
    os.close(w)
    select.select([r], [], [], 2.0)  # its byte, or EOF when it died
    os.close(r)
    kids.append(pid)
time.sleep(0.5)  # let the kernel finish the kills it has begun
print("held", sum(1 for pid in kids if not os.waitpid(pid, os.WNOHANG)[0]))
"""

DISK_FILL = """
import json, os
chunk = b"z" * (1 << 20)
report = {}
for d in ("/work", "/tmp", "/dev/shm", "/", "/usr", "/dev"):
    written = 0
    try:
        for i in range(256):  # up to 2 GB per place, in files of 8 MB
            with open(os.path.join(d, "fill-%d" % i), "wb", buffering=0) as f:
                for _ in range(8):
                    written += f.write(chunk)
    except OSError:
        pass
    report[d] = written >> 20
files = 0
try:
    for i in range(100000):
        open("/work/f%d" % i, "w").close()
        files += 1
except OSError:
    pass
report["files"] = files
print(json.dumps(report))
"""

PROBE_PARENT = """
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
me, seen = os.getpid(), {{}}
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == me:
        continue
    pid, got = int(name), []
    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        got.append("ATTACHED")
        libc.ptrace(17, pid, 0, 0)
    for what in ("environ", "mem", "fd/1"):
        try:
            with open("/proc/%d/%s" % (pid, what), "rb") as f:
                f.read(1)
            got.append(what)
        except OSError:
            pass
    seen[pid] = got
killed = []
for pid in {host_pids!r}:  # agentrl and a sentinel, on the host
    try:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    except OSError:
        pass
print(json.dumps({{"parent": os.getppid(), "seen": seen, "killed": killed}}))
"""

KILL_EVERYTHING = "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')"
STOP_THE_RUNNER = "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(60)"
