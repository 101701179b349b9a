"""In-sandbox runner: runs one piece of Python code under limits and prints a JSON report.

This file is copied into every sandbox (bubblewrap, docker, e2b) and run there as
``python3 -I runner.py PAYLOAD.json``. It uses only the standard library and no agentrl code,
so any Python 3.8+ inside the sandbox can run it.

Payload keys: ``action`` ("run" or "reset"), ``code``, ``files`` ({relative path: text}),
``stdin``, ``workdir``, ``cpu_time_s``, ``wall_time_s``, ``memory_mb``, ``max_processes``
(0: not set here), ``max_output_bytes``, ``max_file_bytes``, ``sweep_uid``.

"run": write ``files`` and the code (as ``main.py``) into ``workdir``, start
``python3 -E -s main.py`` (so modules in the work directory are importable) in a new
session with CPU-time, address-space, file-size, process and core-dump limits,
stdout/stderr redirected to files (so the file-size limit also caps output), wait at most
``wall_time_s``, kill the whole session, and report exit code, signal, what limit was hit,
and the first ``max_output_bytes`` of each stream.

"reset": kill leftover processes of this uid (only when ``sweep_uid`` is set and the uid
is not root, i.e. inside a container or VM where this uid belongs to the sandbox) and empty
``workdir``.

The report is the last stdout line, prefixed with ``__AGENTRL_RESULT__``.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MARKER = "__AGENTRL_RESULT__"


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


def _session_members(sid):
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _kill_session(sid):
    """SIGKILL every process of the session ``sid`` (the code and whatever it started)."""
    for _ in range(20):
        members = _session_members(sid)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _read_head(path, limit):
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _safe_path(workdir, rel):
    full = os.path.realpath(os.path.join(workdir, rel))
    if not (full + os.sep).startswith(os.path.realpath(workdir) + os.sep) or os.path.isabs(rel):
        raise ValueError("file path %r leaves the work directory" % rel)
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
    outdir = tempfile.mkdtemp(prefix="agentrl-out-")
    out_path, err_path = os.path.join(outdir, "stdout"), os.path.join(outdir, "stderr")
    start = time.monotonic()
    timed_out = False
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-E", "-s", "main.py"],
            stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir,
            preexec_fn=_limits(payload), start_new_session=True, close_fds=True,
        )
        try:
            proc.communicate(input=(payload.get("stdin") or "").encode(), timeout=wall)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_session(proc.pid)
        proc.wait()
    duration = time.monotonic() - start
    stdout, out_trunc = _read_head(out_path, max_out)
    stderr, err_trunc = _read_head(err_path, max_out)
    shutil.rmtree(outdir, ignore_errors=True)
    code = proc.returncode
    limit = ""
    if timed_out:
        limit = "wall_time"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and _cpu_spent(proc) >= payload.get("cpu_time_s", 5)):
        limit = "cpu_time"
    elif code == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        limit = "file_size"
    elif "MemoryError" in stderr[-2000:]:
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


def _cpu_spent(proc):
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reset(payload):
    killed = 0
    if payload.get("sweep_uid") and os.getuid() != 0:
        me, ancestors = os.getpid(), set()
        pid = os.getppid()
        while pid > 1:  # never kill the runner's own ancestors (the exec agent, the shell)
            ancestors.add(pid)
            try:
                with open("/proc/%d/stat" % pid) as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in ancestors or int(name) == me:
                continue
            try:
                if os.stat("/proc/" + name).st_uid == os.getuid():
                    os.kill(int(name), signal.SIGKILL)
                    killed += 1
            except OSError:
                pass
    workdir = payload.get("workdir")
    if workdir and os.path.isdir(workdir):
        for name in os.listdir(workdir):
            path = os.path.join(workdir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return {"exit_code": 0, "stdout": "", "stderr": "", "truncated": False, "limit": "",
            "duration_s": 0.0, "killed": killed}


def main():
    with open(sys.argv[1]) as f:
        payload = json.load(f)
    try:
        report = reset(payload) if payload.get("action") == "reset" else run(payload)
    except Exception as e:  # report runner failures instead of a bare traceback
        report = {"exit_code": None, "stdout": "", "stderr": "", "truncated": False,
                  "limit": "", "duration_s": 0.0, "error": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write("\n" + MARKER + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
