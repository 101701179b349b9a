"""Per-run cgroups for the local sandbox: one memory and process cap on everything a run starts.

Rlimits bound each process, not their sum; a cgroup bounds the sum of everything the run starts
(tmpfs pages included), and an OOM kill stays inside it. :func:`find_cgroups` finds where groups
can go, once per process: cgroup v2 with ``memory`` and ``pids`` under
``<v2 mount>/agentrl-sandbox``; else v1 under this process's own group (so an operator's limit on
agentrl holds for its sandboxes); else ``None`` with the reason, and the local backend uses
rlimits alone.

A run's group ``<base>/run-<pid>-<n>`` is made before the run; its first process is moved in
before it can fork (it waits at a gate); afterwards every process left in it is killed and the
group removed. Groups left by a dead process are removed the next time the layout is looked up.
See docs/tools.md.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

BASE_NAME = "agentrl-sandbox"
_counter = itertools.count(1)


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    memory_base: Path  # where run groups are made in the memory hierarchy
    pids_base: Path  # the same folder on v2


def _mounts() -> list[tuple[Path, str, set[str]]]:
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                found.append((Path(parts[1]), parts[2], set(parts[3].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """This process's group per v1 controller, and under "" its v2 group."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path.lstrip("/")
    return paths


def _probe(bases: list[Path], version: int) -> None:
    """Create a group under each base with the limits set, then remove it; raises OSError."""
    probe = [base / f"probe-{os.getpid()}" for base in dict.fromkeys(bases)]
    try:
        for path in probe:
            path.mkdir(exist_ok=True)
        _write_limits(probe, version, 64 << 20, 8)
    finally:
        for path in probe:
            try:
                path.rmdir()
            except OSError:
                pass


def _enable_v2(mount: Path) -> Path:
    base = mount / BASE_NAME
    base.mkdir(exist_ok=True)
    for parent in (mount, base):
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        missing = {"memory", "pids"} - enabled
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in sorted(missing)))
    return base


@functools.lru_cache(maxsize=1)
def find_cgroups() -> CgroupLayout | str:
    """Where this process can make run groups with memory and pids limits, or why it cannot."""
    reasons = []
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        return f"cannot read /proc/self/mounts or /proc/self/cgroup: {e}"
    for mount, kind, _options in mounts:
        if kind != "cgroup2":
            continue
        try:
            controllers = set((mount / "cgroup.controllers").read_text().split())
        except OSError as e:
            reasons.append(f"{mount}: {e}")
            continue
        if not {"memory", "pids"} <= controllers:
            reasons.append(
                f"cgroup v2 at {mount} has no memory/pids controllers ({' '.join(sorted(controllers)) or 'none'})"
            )
            continue
        try:
            base = _enable_v2(mount)
            _probe([base], 2)
            _remove_stale([base])
            return CgroupLayout(2, base, base)
        except OSError as e:
            reasons.append(f"cgroup v2 at {mount}: {e}")
    v1 = {c: mount for mount, kind, options in mounts if kind == "cgroup" for c in ("memory", "pids") if c in options}
    if {"memory", "pids"} <= set(v1):
        for candidates in (
            [v1[c] / own.get(c, "") / BASE_NAME for c in ("memory", "pids")],
            [v1[c] / BASE_NAME for c in ("memory", "pids")],
        ):
            try:
                for base in candidates:
                    base.mkdir(exist_ok=True)
                _probe(candidates, 1)
                _remove_stale(candidates)
                return CgroupLayout(1, candidates[0], candidates[1])
            except OSError as e:
                reasons.append(f"cgroup v1 under {candidates[0].parent}: {e}")
    elif not reasons:
        reasons.append("no cgroup v2 or v1 memory and pids hierarchies are mounted")
    return "; ".join(reasons)


def _remove_stale(bases: list[Path]) -> None:
    """Remove the (empty) run groups that processes which died mid-run left behind."""
    for base in dict.fromkeys(bases):
        for group in base.glob("run-*-*"):
            try:
                os.kill(int(group.name.split("-")[1]), 0)
            except ProcessLookupError:
                try:
                    group.rmdir()
                except OSError:
                    pass
            except (OSError, ValueError):
                pass


def _write_limits(dirs: list[Path], version: int, memory_bytes: int, max_pids: int) -> None:
    memory_dir, pids_dir = dirs[0], dirs[-1]
    if version == 2:
        (memory_dir / "memory.max").write_text(str(memory_bytes))
        if (memory_dir / "memory.swap.max").exists():
            (memory_dir / "memory.swap.max").write_text("0")
    else:
        (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (memory_dir / "memory.memsw.limit_in_bytes").exists():
            (memory_dir / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    (pids_dir / "pids.max").write_text(str(max_pids))


class RunCgroup:
    """The group of one run: memory and process limits on the total of its processes."""

    def __init__(self, layout: CgroupLayout, memory_bytes: int, max_pids: int):
        name = f"run-{os.getpid()}-{next(_counter)}"
        self.layout = layout
        self.dirs = list(dict.fromkeys([layout.memory_base / name, layout.pids_base / name]))
        for path in self.dirs:
            path.mkdir()
        try:
            _write_limits(self.dirs, layout.version, memory_bytes, max_pids)
        except OSError:
            self.destroy()
            raise

    def add(self, pid: int) -> None:
        """Move ``pid`` into the group (it must not have forked yet)."""
        for path in self.dirs:
            (path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.dirs:
            try:
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel killed because the group's memory was full."""
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            for line in (self.dirs[0] / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def destroy(self) -> None:
        """SIGKILL whatever is still in the group, then remove it (blocking; bounded)."""
        for _ in range(100):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)
        for path in self.dirs:
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)  # the last killed processes are still leaving
