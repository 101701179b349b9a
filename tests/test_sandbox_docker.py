"""The docker sandbox for real: a daemon on its own socket and an image built offline.

`.ci/run` starts dockerd and builds the image with sandboxes/python/build_local_image.sh,
then exports DOCKER_HOST. Without a daemon these tests fail in CI (CI=true) and skip
elsewhere, saying why. Containment cases shared with the local backend are in
``test_sandbox_escape.py`` (and the grader's in ``test_code_grading.py``); here is what is the
docker backend's own: the container's configuration, reset and the pool.
"""

from __future__ import annotations

import os

import pytest
import trio
from _sandbox_helpers import ESCAPE, processes_of, require

from agentrl.tools.sandbox import SandboxSettings, make_pool
from agentrl.tools.sandbox.docker import DockerSandbox, docker_client, docker_unavailable

pytestmark = pytest.mark.docker

SETTINGS = SandboxSettings(
    backend="docker",
    image=os.environ.get("AGENTRL_SANDBOX_IMAGE", "agentrl-python:latest"),
    cpu_time_s=1,
    wall_time_s=3,
    memory_mb=128,
    max_processes=16,
    max_output_chars=500,
    work_mb=32,
    tmpfs_mb=16,
    max_open_files=128,
    lifetime_s=600,
)


@pytest.fixture(scope="module")
def sandbox():
    require(docker_unavailable(SETTINGS))
    sb = trio.run(DockerSandbox.create, SETTINGS)
    yield sb
    trio.run(sb.close)


def run(sb, code, **kw):
    return trio.run(lambda: sb.run(code, **kw))


def test_container_is_locked_down(sandbox):
    host = sandbox.client.api.inspect_container(sandbox.container.id)["HostConfig"]
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
    assert host["Memory"] == host["MemorySwap"] == SETTINGS.total_memory_mb << 20 and host["PidsLimit"] == 16 + 2
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert host["Tmpfs"]["/work"].startswith("size=32m,nr_inodes=16384,mode=0700")
    assert {u["Name"]: (u["Soft"], u["Hard"]) for u in host["Ulimits"]} == {"nofile": (128, 128), "nproc": (18, 18)}
    result = run(
        sandbox,
        "import os, resource\nprint(os.getuid(), os.getcwd(), resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "open('/etc/x', 'w')",
    )
    assert result.stdout == f"{sandbox.uid} /work (128, 128)\n" and "Read-only file system" in result.stderr
    assert sandbox.uid == SETTINGS.sandbox_uid(0) != 65534  # a uid of its own: RLIMIT_NPROC is per uid, host-wide


def test_reset_ends_leftovers_and_empties_work_and_tmp(sandbox):
    code = ESCAPE.format(python="python3") + "open('notes.txt', 'w').write('x')\nopen('/tmp/t', 'w').write('x')"
    result = run(sandbox, code)
    assert result.ok and "left a sleeper behind" in result.stdout
    assert len(processes_of(sandbox.uid)) == 1  # the escaped sleeper survives the run...
    trio.run(sandbox.reset)
    assert processes_of(sandbox.uid) == []  # ...but not the reset
    assert run(sandbox, "import os\nprint(os.listdir('.'), os.listdir('/tmp'))").stdout == "['main.py'] []\n"


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
