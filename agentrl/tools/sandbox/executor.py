"""In-sandbox runner: runs Python code under limits and prints a JSON report.

Copied into every sandbox and run there as ``python3 -I runner.py PAYLOAD.json`` (or with the
payload on stdin). Standard library only, no agentrl code, so any Python 3.8+ can run it. It first
makes itself non-dumpable, so the code it starts cannot read its memory or ptrace it.

Actions: ``run`` writes ``files`` and ``main.py`` into ``workdir`` and runs it in a new session
under CPU, address-space, file-size and process limits, output captured in memfds, killed after
``wall_time_s``; ``calls`` runs ``function`` on each argument list in a fresh forked child that
writes ``json.dumps`` of its value to its own pipe, killing every other process of the uid between
calls (``sweep_uid``); ``reset`` kills leftover processes and empties the work and scratch folders.

Invariant: the runner judges nothing; the caller compares values outside the sandbox. The report
is the last stdout line, prefixed with ``__AGENTRL_RESULT__``. See docs/tools.md.
"""

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback

MARKER = "__AGENTRL_RESULT__"
# Where a container sees its own memory cgroup (v2, v1): its OOM kills read as the memory limit.
OOM_FILES = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")


def _make_undumpable():
    """PR_SET_DUMPABLE 0: processes of the same uid can no longer ptrace this one or open its
    /proc/<pid>/fd, mem or environ (the code runs as the runner's uid)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except (ImportError, OSError, AttributeError):
        pass  # a Python without ctypes: the calls stay separate, the report is only less private


def _limits(payload):
    cpu = max(1, int(payload.get("cpu_time_s", 5) + 0.999))
    memory = int(payload.get("memory_mb", 256)) << 20
    fsize = int(payload.get("max_file_bytes", 16 << 20))
    nproc = int(payload.get("max_processes", 0))

    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


def _oom_kills():
    """How many processes the kernel has OOM-killed in this container's cgroup (0 if unknown)."""
    for path in OOM_FILES:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
    return 0


def _stat(pid):
    """(state, parent pid) of ``pid`` from /proc; raises OSError when it is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _pids():
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _session_members(sid):
    """The live (not zombie) processes of session ``sid``."""
    pids = []
    for pid in _pids():
        try:
            if os.getsid(pid) == sid and _stat(pid)[0] != "Z":
                pids.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    return pids


def _reap_orphans(keep=None):
    """As pid 1 of its pid namespace (bwrap --as-pid-1), the runner inherits every orphan:
    reap the dead ones, except ``keep`` (a child that Popen waits for itself)."""
    if os.getpid() != 1:
        return
    for pid in _pids():
        try:
            if pid != keep and _stat(pid) == ("Z", 1):
                os.waitpid(pid, os.WNOHANG)
        except (OSError, ValueError, IndexError):
            pass


def _kill_session(sid):
    """SIGKILL every process of the session ``sid`` (the code and whatever it started)."""
    for _ in range(20):
        members = _session_members(sid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    _reap_orphans(keep=sid)


def _memfile(name, content=b""):
    """An anonymous in-memory file (memfd): the code's output and input live in no filesystem
    it could fill or reach (RLIMIT_FSIZE still caps what is written to it)."""
    fd = os.memfd_create(name)
    os.write(fd, content)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_head(fd, limit):
    data = os.pread(fd, limit + 1, 0)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _safe_path(workdir, rel):
    full = os.path.realpath(os.path.join(workdir, rel))
    if not (full + os.sep).startswith(os.path.realpath(workdir) + os.sep) or os.path.isabs(rel):
        raise ValueError(f"file path {rel!r} leaves the work directory")
    return full


def run(payload):
    workdir = payload.get("workdir") or os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    for rel, text in (payload.get("files") or {}).items():
        full = _safe_path(workdir, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    with open("main.py", "w") as f:
        f.write(payload.get("code", ""))
    max_out = int(payload.get("max_output_bytes", 16000))
    wall = float(payload.get("wall_time_s", 10))
    out, err = _memfile("stdout"), _memfile("stderr")
    oom_kills = _oom_kills()
    start = time.monotonic()
    timed_out = False
    try:
        proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "main.py"],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=workdir,
            preexec_fn=_limits(payload),
            start_new_session=True,
            close_fds=True,
        )
        try:
            proc.communicate(input=(payload.get("stdin") or "").encode(), timeout=wall)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_session(proc.pid)
        proc.wait()
        duration = time.monotonic() - start
        stdout, out_trunc = _read_head(out, max_out)
        stderr, err_trunc = _read_head(err, max_out)
    finally:
        os.close(out)
        os.close(err)
    code = proc.returncode
    limit = ""
    if timed_out:
        limit = "wall_time"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and _cpu_spent(proc) >= payload.get("cpu_time_s", 5)):
        limit = "cpu_time"
    elif code == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        limit = "file_size"
    elif "MemoryError" in stderr[-2000:] or _oom_kills() > oom_kills:
        limit = "memory"
    elif "BlockingIOError: [Errno 11]" in stderr or "Resource temporarily unavailable" in stderr:
        limit = "processes"
    return {
        "exit_code": None if timed_out else code,
        "stdout": stdout,
        "stderr": stderr,
        "truncated": out_trunc or err_trunc,
        "limit": limit,
        "duration_s": round(duration, 4),
    }


def _call_error(proc, err, timed_out):
    if timed_out:
        return "time limit exceeded"
    if proc.returncode is not None and proc.returncode < 0:
        return f"killed by signal {-proc.returncode}"
    text, _ = _read_head(err, 64 << 10)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {proc.returncode} without a result")[:300]


def _call_child(payload, args, result_fd, err_fd, _exit=os._exit):
    """In the forked child: call the function once, write its JSON to ``result_fd``; never returns.

    A fork of the runner, not a new interpreter: the same isolation (its own process, session
    and limits, stdin and stdout on /dev/null, stderr to ``err_fd``, no other descriptor than
    ``result_fd``) at a fraction of the start-up cost. What it can see of the runner's memory
    is the payload: the code and the arguments, nothing to judge them by.
    """
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        _limits(payload)()
        namespace: dict = {"__name__": "solution"}
        exec(compile(payload.get("code", ""), "solution.py", "exec"), namespace)
        data = json.dumps(namespace[payload.get("function", "")](*args), allow_nan=False).encode()
        while data:
            data = data[os.write(result_fd, data) :]
        code = 0
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        _exit(code)


class _Child:
    """The little of Popen's interface that a forked child needs."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return self.returncode

    def wait(self, timeout=None):
        start = time.monotonic()
        while self.poll() is None:
            if timeout is not None and time.monotonic() - start >= timeout:
                raise subprocess.TimeoutExpired("call", timeout)
            time.sleep(0.001)
        return self.returncode


def _call_once(payload, args, deadline):
    """One call in a fresh child; returns {"value": JSON text} or {"error": why}."""
    max_bytes = int(payload.get("max_output_bytes", 16000))
    err = _memfile("stderr")
    read_fd, write_fd = os.pipe()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _call_child(payload, args, write_fd, err)
        proc = _Child(pid)
        os.close(write_fd)
        write_fd = -1
        data, timed_out, too_long = b"", False, False
        while True:  # read until EOF, the child's exit, the deadline or too much
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.1))
            if ready:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                data += chunk
                if len(data) > max_bytes:
                    too_long = True
                    break
            elif proc.poll() is not None:
                break  # exited; whatever still holds the pipe open (a grandchild) is ignored
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        _kill_session(proc.pid)
        proc.wait()
        if too_long:
            return {"error": f"the result is longer than {max_bytes} bytes"}
        if timed_out or proc.returncode != 0 or not data:
            return {"error": _call_error(proc, err, timed_out)}
        return {"value": data.decode("utf-8", errors="replace")}
    finally:
        for fd in (read_fd, write_fd, err):
            if fd >= 0:
                os.close(fd)


def calls(payload):
    workdir = payload.get("workdir") or os.getcwd()
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    start = time.monotonic()
    deadline = start + float(payload.get("wall_time_s", 10))
    results = []
    for args in payload.get("calls") or []:
        if payload.get("sweep_uid"):
            _sweep_uid()
        if time.monotonic() >= deadline:
            results.append({"error": "time limit exceeded"})
            continue
        results.append(_call_once(payload, args, deadline))
    if payload.get("sweep_uid"):
        _sweep_uid()
    return {
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "truncated": False,
        "limit": "",
        "duration_s": round(time.monotonic() - start, 4),
        "calls": results,
    }


def _cpu_spent(proc):
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _sweep_uid():
    """SIGKILL every process of this uid except the runner and its ancestors; returns how many."""
    if os.getuid() == 0:
        return 0  # root's processes are not the sandbox's own
    killed = 0
    me, ancestors = os.getpid(), set()
    pid = os.getppid()
    while pid > 1:  # never kill the runner's own ancestors (the exec agent, the shell)
        ancestors.add(pid)
        try:
            pid = _stat(pid)[1]
        except (OSError, ValueError, IndexError):
            break
    for pid in _pids():
        if pid in ancestors or pid in (me, 1):
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == os.getuid():
                os.kill(pid, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
    _reap_orphans()
    return killed


def reset(payload):
    killed = _sweep_uid() if payload.get("sweep_uid") else 0
    for folder in [payload.get("workdir")] + list(payload.get("scratch_dirs") or []):
        if not folder or not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return {
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "truncated": False,
        "limit": "",
        "duration_s": 0.0,
        "killed": killed,
    }


ACTIONS = {"run": run, "calls": calls, "reset": reset}


def main():
    _make_undumpable()
    if sys.argv[1] == "-":
        payload = json.load(sys.stdin)
    else:
        with open(sys.argv[1]) as f:
            payload = json.load(f)
    try:
        report = ACTIONS[payload.get("action", "run")](payload)
    except Exception as e:  # report runner failures instead of a bare traceback
        report = {
            "exit_code": None,
            "stdout": "",
            "stderr": "",
            "truncated": False,
            "limit": "",
            "duration_s": 0.0,
            "error": f"{type(e).__name__}: {e}",
        }
    sys.stdout.write("\n" + MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
