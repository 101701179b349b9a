"""The local (bubblewrap) sandbox for real, the pool, the python tool and the e2b adapter.

Containment cases that hold on every backend are in ``test_sandbox_escape.py``; here are the
local backend's own mechanics: the host tmpfs ``/work``, the per-run cgroup, and the
fallbacks where neither can be made.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from _sandbox_helpers import (
    ALLOCATE,
    COUNT_FORKS,
    DISK_FILL,
    FORK_BOMB,
    MEMORY_SPREAD,
    changed_settings,
    processes_of,
    require,
)
from trio.testing import wait_all_tasks_blocked

from agentrl.tools.base import ToolBox, ToolCall
from agentrl.tools.python_sandbox import PythonTool
from agentrl.tools.sandbox import SandboxPool, SandboxSettings, make_pool
from agentrl.tools.sandbox.base import CallResult, ExecResult, parse_calls, parse_report
from agentrl.tools.sandbox.e2b import E2BSandbox
from agentrl.tools.sandbox.local import LocalSandbox, bwrap_available

SETTINGS = SandboxSettings(
    cpu_time_s=1, wall_time_s=3, memory_mb=128, max_processes=16, max_output_chars=500, work_mb=16
)
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def sandbox():
    require(bwrap_available())
    sb = LocalSandbox(SETTINGS, slot=1)
    yield sb
    trio.run(sb.close)
    assert not sb.root.exists()


@pytest.fixture
def fresh():
    """A sandbox of its own, for tests that switch its limits to a fallback."""
    require(bwrap_available())
    sb = LocalSandbox(SETTINGS, slot=2)
    yield sb
    trio.run(sb.close)
    assert processes_of(sb.uid) == []


def run(sb, code, **kw) -> ExecResult:
    return trio.run(lambda: sb.run(code, **kw))


def test_runs_code_as_an_unprivileged_user(sandbox):
    result = run(sandbox, "import os\nprint(os.getuid(), os.getcwd())")
    assert result.ok and result.stdout.split()[1] == "/work"
    assert int(result.stdout.split()[0]) != 0
    assert result.render(SETTINGS) == result.stdout.strip()


def test_errors_files_stdin_and_reset(sandbox):
    result = run(sandbox, "import sys\nprint('before')\nsys.exit(3)")
    assert result.exit_code == 3 and result.render(SETTINGS) == "before\n[exit code 3]"
    trace = run(sandbox, "1 / 0")
    assert "ZeroDivisionError" in trace.render(SETTINGS) and "[exit code 1]" in trace.render(SETTINGS)
    echo = run(
        sandbox,
        "import sys, helper\nprint(helper.X, sys.stdin.read())",
        files={"helper.py": "X = 7"},
        stdin="from stdin",
    )
    assert echo.stdout == "7 from stdin\n"
    if sandbox.work_mounted:
        run(sandbox, "open('notes.txt', 'w').write('kept')")
        assert run(sandbox, "print(open('notes.txt').read())").stdout == "kept\n"  # files persist in an episode
        trio.run(sandbox.reset)
        assert "notes.txt" not in run(sandbox, "import os\nprint(os.listdir('.'))").stdout
    bad = run(sandbox, "print(1)", files={"../escape.py": "x"})
    assert bad.error and "leaves the work directory" in bad.error


def test_work_is_a_capped_tmpfs_on_the_host(sandbox):
    if not ROOT:
        require("agentrl is not root here: /work is bwrap's tmpfs of each run (test_unmounted_work_fallback)")
    assert sandbox.work_mounted
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    work = [m for m in mounts if m[1] == str(sandbox.workdir)]
    assert work and work[0][2] == "tmpfs" and "size=16384k" in work[0][3] and "nr_inodes=16384" in work[0][3]
    sb = LocalSandbox(SETTINGS, slot=3)
    root = sb.root
    trio.run(sb.close)
    assert not root.exists() and str(root) not in Path("/proc/mounts").read_text()


def test_every_run_gets_a_cgroup_that_is_removed_after(sandbox):
    if sandbox.limits != "cgroup":
        require(f"no cgroup here: {sandbox.cgroups}")
    result = run(sandbox, "print(open('/proc/self/cgroup').read())")
    assert result.ok
    layout = sandbox.cgroups
    assert not list(layout.memory_base.glob(f"run-{os.getpid()}-*"))
    assert not list(layout.pids_base.glob(f"run-{os.getpid()}-*"))
    with changed_settings(sandbox, wall_time_s=15):
        oom = run(sandbox, MEMORY_SPREAD)  # the kernel's OOM kills inside the group read as the memory limit
    assert oom.limit == "memory" and int(oom.stdout.split()[1]) * 80 <= SETTINGS.total_memory_mb


def test_rlimits_fallback_still_bounds_a_run(fresh):
    """Without a cgroup: the uid's process limit and each process's address space hold."""
    fresh.cgroups = "made unavailable by the test"
    assert fresh.limits == "rlimits"
    bomb = run(fresh, FORK_BOMB)
    assert not bomb.ok and bomb.limit in ("wall_time", "cpu_time", "processes")
    counted = run(fresh, COUNT_FORKS)
    assert 0 < int(counted.stdout.split()[1]) < SETTINGS.max_processes
    assert run(fresh, ALLOCATE).limit == "memory"
    with changed_settings(fresh, wall_time_s=15):
        spread = int(run(fresh, MEMORY_SPREAD).stdout.split()[1])  # the total is bounded only by the product
    assert spread * 80 <= (SETTINGS.max_processes + 8) * (SETTINGS.memory_mb + 256)


def test_unmounted_work_fallback(fresh):
    """Where no tmpfs can be mounted on the host, /work is bwrap's own capped tmpfs of each run."""
    fresh.work_mounted = False
    with changed_settings(fresh, cpu_time_s=5, wall_time_s=15):
        written = json.loads(run(fresh, DISK_FILL).stdout)
    assert written["/work"] <= SETTINGS.work_mb and written["/"] == 0
    run(fresh, "open('notes.txt', 'w').write('gone')")
    assert run(fresh, "import os\nprint(os.listdir('.'))").stdout == "['main.py']\n"  # nothing persists


def test_parse_report_rejects_what_the_runner_would_not_write():
    assert "did not report" in parse_report("", "bwrap: No permissions").error
    assert "unreadable" in parse_report("__AGENTRL_RESULT__{bad").error
    assert "unreadable" in parse_report("__AGENTRL_RESULT__[1, 2]").error
    assert "bad exit_code" in parse_report('__AGENTRL_RESULT__{"exit_code": "0"}').error
    report = parse_report('__AGENTRL_RESULT__{"exit_code": 0, "calls": [{"value": "1"}, {"error": "x"}, 3]}')
    assert parse_calls(report, 3) == [CallResult("1"), CallResult(None, "x"), CallResult(None, "no result")]
    assert all(c.value is None for c in parse_calls(report, 2))  # a report of another length counts for nothing
    assert all(c.value is None for c in parse_calls(ExecResult(exit_code=None, limit="wall_time"), 2))


# ------------------------------------------------------------------- tool and pool


def test_python_tool_through_toolbox(sandbox):
    tool = PythonTool(SETTINGS)
    box = ToolBox([tool], timeout_s=0.5)  # the tool's own limit (wall + margin) wins over the default
    state = {"sandbox": sandbox}
    ok = trio.run(box.execute, ToolCall("python", {"code": "print(6 * 7)"}), state)
    assert (ok.content, ok.is_error) == ("42", False)
    slow = trio.run(box.execute, ToolCall("python", {"code": "import time\ntime.sleep(0.8)\nprint('done')"}), state)
    assert slow.content == "done"
    missing = trio.run(box.execute, ToolCall("python", {"code": "print(1)"}), {})
    assert missing.is_error and "no sandbox" in missing.content


class FakeSandbox:
    def __init__(self, slot, fail_reset=False):
        self.slot, self.fail_reset, self.resets, self.closed, self.broken = slot, fail_reset, 0, False, False

    async def reset(self):
        self.resets += 1
        if self.fail_reset:
            raise RuntimeError("reset failed")

    async def close(self):
        self.closed = True


def test_pool_reuses_resets_and_closes():
    made: list[FakeSandbox] = []

    async def factory(slot):
        made.append(FakeSandbox(slot, fail_reset=slot == 3))
        return made[-1]

    async def main():
        pool = SandboxPool(factory, size=1)
        a, b = await pool.acquire(), await pool.acquire()
        await pool.release(a)
        await pool.release(b)  # the pool keeps one idle sandbox
        assert a.resets == 1 and not a.closed and b.closed
        assert await pool.acquire() is a
        c = await pool.acquire()  # slot 3: its reset fails, so it is closed
        await pool.release(c)
        assert c.closed and pool.stats["reset_failures"] == 1
        a.broken = True
        await pool.release(a)
        assert a.closed and a.resets == 1  # broken sandboxes are not reset but closed
        async with pool.session() as d:
            pass
        await pool.aclose()
        assert d.closed and pool.stats["created"] == 4 and pool._live == 0
        with pytest.raises(RuntimeError, match="closed"):
            await pool.acquire()

    trio.run(main)


def test_pool_release_survives_cancellation_and_max_live_waits():
    async def factory(slot):
        return FakeSandbox(slot)

    async def main():
        pool = SandboxPool(factory, size=2, max_live=1)
        with trio.move_on_after(0.1):
            async with pool.session() as sb:
                await trio.sleep(10)  # the episode is cancelled here; release still runs
        assert pool._idle == [sb] and sb.resets == 1
        first = await pool.acquire()
        got = []

        async def second():
            got.append(await pool.acquire())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await wait_all_tasks_blocked()
            assert got == []  # waits: one sandbox is the most allowed
            await pool.release(first)
        assert got == [first]

    trio.run(main)


def test_local_pool_end_to_end():
    require(bwrap_available())

    async def main():
        pool = make_pool({**SETTINGS.__dict__, "pool_size": 1})
        async with pool.session() as sb:
            assert (await sb.run("open('x', 'w').write('1')")).ok
            root = sb.root
        async with pool.session() as again:
            assert again is sb
            assert (await again.run("import os\nprint(os.listdir('.'))")).stdout == "['main.py']\n"
        await pool.aclose()
        assert not root.exists()

    trio.run(main)


def test_settings_validation():
    with pytest.raises(ValueError, match="unknown sandbox setting"):
        SandboxSettings.from_dict({"backend": "local", "gpus": 1})
    with pytest.raises(ValueError, match="local, docker or e2b"):
        SandboxSettings.from_dict({"backend": "vm"})


# --------------------------------------------------------------------------- e2b


class FakeCommandExit(Exception):
    def __init__(self, stdout, stderr, exit_code):
        super().__init__(f"exit {exit_code}")
        self.stdout, self.stderr, self.exit_code = stdout, stderr, exit_code


class TimeoutException(Exception):
    """Named like e2b's, which the adapter recognises by name."""


class FakeE2B:
    """Stands in for ``e2b.Sandbox``: files and commands act on this machine, inside a tmp dir.

    It records what the adapter asks for. Reset and calls payloads are checked and then run
    without the process sweep (here the runner runs on the host, not in a VM of its own).
    """

    def __init__(self, kwargs):
        self.kwargs, self.killed, self.writes, self.ran = kwargs, False, [], []
        self.files = self
        self.commands = self
        self.timeout_next = False
        self.crash_next = False

    @classmethod
    def create(cls, **kwargs):
        cls.last = cls(kwargs)
        return cls.last

    def write(self, path, data, user=None):  # files.write
        self.writes.append((path, user))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(data)

    def run(self, cmd, timeout=None):  # commands.run
        self.ran.append(cmd)
        if self.timeout_next:
            raise TimeoutException("command timed out")
        if self.crash_next:
            raise FakeCommandExit("", "runner crashed", 1)
        argv = shlex.split(cmd)
        payload_path = Path(argv[-1])
        payload = json.loads(payload_path.read_text())
        if payload["action"] in ("reset", "calls"):
            assert payload["sweep_uid"] is True
            payload_path.write_text(json.dumps({**payload, "sweep_uid": False}))
        argv[0] = sys.executable
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if out.returncode:
            raise FakeCommandExit(out.stdout, out.stderr, out.returncode)
        return type("CommandResult", (), {"stdout": out.stdout, "stderr": out.stderr, "exit_code": 0})()

    def kill(self):
        self.killed = True


def test_e2b_adapter(tmp_path):
    settings = SandboxSettings(backend="e2b", e2b_template="agentrl-py", wall_time_s=3, cpu_time_s=1, lifetime_s=600)

    async def main():
        sb = await E2BSandbox.create(
            settings, sandbox_cls=FakeE2B, control_dir=str(tmp_path / "ctl"), workdir=str(tmp_path / "work")
        )
        fake = FakeE2B.last
        assert fake.kwargs == {
            "template": "agentrl-py",
            "timeout": 600,
            "allow_internet_access": False,
            "metadata": {"agentrl": "sandbox"},
        }
        assert fake.writes == [(str(tmp_path / "ctl" / "runner.py"), "root")]
        result = await sb.run("import os\nprint(os.getcwd())\nopen('f.txt', 'w').write('1')")
        assert result.ok and result.stdout.strip() == str(tmp_path / "work")
        assert fake.writes[-1] == (str(tmp_path / "ctl" / "payload-1.json"), "root")  # not writable by the code
        assert fake.ran[-1] == f"python3 -I {tmp_path / 'ctl'}/runner.py {tmp_path / 'ctl'}/payload-1.json"
        assert (tmp_path / "work" / "f.txt").exists()
        failing = await sb.run("import sys\nsys.exit(4)")
        assert failing.exit_code == 4
        called = await sb.call_function("def f(x):\n    return [x, x > 1]", "f", [[1], [2]])
        assert called == [CallResult("[1, false]"), CallResult("[2, true]")]
        await sb.reset()
        assert not (tmp_path / "work" / "f.txt").exists()
        fake.crash_next = True
        crashed = await sb.run("print(1)")  # CommandExitException: reported, not raised
        assert crashed.error.startswith("the sandbox runner did not report (runner crashed")
        fake.crash_next, fake.timeout_next = False, True
        lost = await sb.run("print(1)")
        assert lost.limit == "wall_time" and sb.broken
        assert (await sb.run("print(1)")).error == "the e2b sandbox is gone"
        await sb.close()
        assert fake.killed

    trio.run(main)


def test_e2b_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="E2B_API_KEY"):
        trio.run(lambda: E2BSandbox.create(SandboxSettings(backend="e2b")))


def test_make_pool_reads_a_config_section():
    from agentrl.config import load_config

    cfg = load_config(None, ["sandbox.pool_size=2", "sandbox.memory_mb=64"])
    pool = make_pool(cfg.sandbox.model_dump())
    assert pool.size == 2 and pool.max_live == 0
