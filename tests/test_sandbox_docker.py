"""The docker sandbox for real: a daemon on its own socket and an image built offline.

`.ci/run` starts dockerd and builds the image with sandboxes/python/build_local_image.sh,
then exports DOCKER_HOST. Without a daemon these tests fail in CI (CI=true) and skip
elsewhere, saying why.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import trio
from _sandbox_helpers import (ALLOCATE, CONNECT, COUNT_FORKS, ESCAPE, FLOOD, READ_OUTSIDE, SLEEP, SPIN,
                              changed_settings, require)

from agentrl.tools.sandbox import SandboxSettings, make_pool
from agentrl.tools.sandbox.docker import DockerSandbox, docker_client, docker_unavailable

pytestmark = pytest.mark.docker

SETTINGS = SandboxSettings(backend="docker", image=os.environ.get("AGENTRL_SANDBOX_IMAGE", "agentrl-python:latest"),
                           cpu_time_s=1, wall_time_s=3, memory_mb=128, max_processes=16, max_output_chars=500,
                           lifetime_s=600)


@pytest.fixture(scope="module")
def sandbox():
    require(docker_unavailable(SETTINGS))
    sb = trio.run(DockerSandbox.create, SETTINGS)
    yield sb
    trio.run(sb.close)


def run(sb, code, **kw):
    return trio.run(lambda: sb.run(code, **kw))


def user_processes(sb) -> list[list[str]]:
    """Processes in the container other than its root-owned keep-alive."""
    sb.container.reload()
    return [p for p in sb.container.top()["Processes"] if p[0] != "root"]


def test_container_is_locked_down(sandbox):
    attrs = sandbox.client.api.inspect_container(sandbox.container.id)["HostConfig"]
    assert attrs["NetworkMode"] == "none"
    assert attrs["Memory"] == (128 + 64) << 20 and attrs["PidsLimit"] == 16 + 2
    assert attrs["CapDrop"] == ["ALL"] and "no-new-privileges" in attrs["SecurityOpt"]
    result = run(sandbox, "import os\nprint(os.getuid(), os.getcwd())")
    assert result.ok and result.stdout == "65534 /work\n"


def test_cannot_read_outside_or_use_the_network(sandbox):
    out = run(sandbox, READ_OUTSIDE.format(paths=["/etc/shadow", "/root", "/proc/1/environ", "/.agentrl/runner.py"])).stdout
    assert "DENIED /etc/shadow" in out and "DENIED /proc/1/environ" in out and "DENIED /usr" in out
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        net = run(sandbox, CONNECT.format(port=listener.getsockname()[1])).stdout
    finally:
        listener.close()
    assert "CONNECTED" not in net and net.count("BLOCKED") == 2 and "NO DNS" in net
    tamper = run(sandbox, "open('/.agentrl/runner.py', 'a').write('#')")
    assert "PermissionError" in tamper.stderr  # the runner cannot be altered by the code


def test_limits(sandbox):
    forks = run(sandbox, COUNT_FORKS)
    assert 0 < int(forks.stdout.split()[1]) < SETTINGS.max_processes  # the pids cgroup stops it
    memory = run(sandbox, ALLOCATE)
    assert memory.limit == "memory" and "MemoryError" in memory.stderr
    with changed_settings(sandbox, wall_time_s=20):
        spin = run(sandbox, SPIN)
    assert spin.limit == "cpu_time"
    start = time.monotonic()
    sleep = run(sandbox, SLEEP)
    assert sleep.limit == "wall_time" and time.monotonic() - start < SETTINGS.wall_time_s + 5
    flood = run(sandbox, FLOOD)
    assert flood.limit == "file_size" and flood.truncated
    assert user_processes(sandbox) == []
    assert run(sandbox, "print('alive')").stdout == "alive\n"


def test_reset_ends_leftovers_and_empties_work(sandbox):
    result = run(sandbox, ESCAPE.format(python="python3") + "open('notes.txt', 'w').write('x')")
    assert result.ok and "left a sleeper behind" in result.stdout
    assert len(user_processes(sandbox)) == 1  # the escaped sleeper survives the run...
    trio.run(sandbox.reset)
    assert user_processes(sandbox) == []  # ...but not the reset
    assert run(sandbox, "import os\nprint(os.listdir('.'))").stdout == "['main.py']\n"


def test_pool_closes_containers():
    require(docker_unavailable(SETTINGS))
    client = docker_client(SETTINGS)

    async def main():
        pool = make_pool({**SETTINGS.__dict__, "pool_size": 1})
        async with pool.session() as sb:
            cid = sb.container.id
            assert (await sb.run("print(1)")).stdout == "1\n"
        async with pool.session() as again:
            assert again is sb
        await pool.aclose()
        return cid

    cid = trio.run(main)
    assert cid not in [c.id for c in client.containers.list(all=True)]
    client.close()
