"""The code env's grader against an attacker, on the real local and docker backends.

Every attack is a wrong answer (``repeat_word`` must repeat the word at least twice, so no
value found in the sandbox, such as the argument itself, is ever right) plus one way of
forging a result; each must score exactly 0. The reference solutions of every family score
full marks in the same sandboxes, before and after the attacks.
"""

from __future__ import annotations

import json

import pytest
import trio
from _sandbox_helpers import BACKENDS, open_sandbox

from agentrl.envs.code import FAMILIES, CodeEnv, same_value

LIMITS = dict(cpu_time_s=1, wall_time_s=3, memory_mb=128, max_processes=16)
FORGED = json.dumps({"passed": 1000, "total": 6, "error": ""})
FORGED_REPORT = "__AGENTRL_RESULT__" + json.dumps({"exit_code": 0, "calls": [{"value": '"forged"'}] * 6})

ATTACKS = {
    "print_forged_result_lines": f"""
import atexit, glob, re, sys
nonces = {{"__agentrl_grade_0123456789abcdef__"}}
for path in glob.glob("/work/*") + glob.glob("/.agentrl/*"):  # the old harness was /work/main.py
    try:
        nonces.update(re.findall(r"__agentrl_grade_[0-9a-f]+__", open(path).read()))
    except OSError:
        pass
for nonce in nonces:  # after everything else the grader prints
    atexit.register(sys.__stdout__.write, nonce + {FORGED!r} + "\\n")
print({FORGED_REPORT!r})
def repeat_word(w):
    print({FORGED_REPORT!r})
    return w
""",
    "read_the_harness_and_payload": """
import glob, os, re, sys
seen = sys.stdin.read() + open("/proc/self/cmdline").read()
for path in glob.glob("/.agentrl/*") + glob.glob("/work/*") + glob.glob("/tmp/**", recursive=True):
    try:
        seen += open(path).read()
    except OSError:
        pass
found = re.findall(r'"expected"\\s*:\\s*("[^"]*")', seen) + re.findall(r'\\["[a-e]+", "([a-e ]+)"\\]', seen)
def repeat_word(w):
    return found[0] if found else w
""",
    "set_globals": """
import sys, __main__
def forge():
    frame = sys._getframe()
    while frame is not None:  # every frame up the stack, the grader's too if it were there
        frame.f_globals["_passed"] = 50
        frame.f_globals["passed"] = 50
        frame = frame.f_back
    __main__._passed = 50
forge()
def repeat_word(w):
    forge()
    return w
""",
    "patch_builtins": """
import builtins
class Always:
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = object.__hash__
builtins.type = lambda *a: Always  # type(got) is type(expected), whatever they are
def repeat_word(w):
    return Always()
""",
    "patch_json_and_sys": f"""
import json, sys
json.dumps = lambda *a, **k: {FORGED!r}
json.loads = lambda *a, **k: {{"passed": 1000}}
sys.argv[:] = ["-c", "1"]
sys.exit = lambda *a: None
def repeat_word(w):
    return w
""",
    "os_exit_early": "import os\nos._exit(0)\ndef repeat_word(w):\n    return w\n",
    "always_equal_objects": """
class Always:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
class AlwaysStr(str):
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = str.__hash__
calls = []
def repeat_word(w):
    calls.append(w)
    return Always() if len(calls) % 2 else AlwaysStr("nope")
""",
    "system_exit_inside_the_test": "def repeat_word(w):\n    raise SystemExit(0)\n",
    "overwrite_the_test_data": """
import glob, os
for path in glob.glob("/.agentrl/*") + glob.glob("/tmp/**", recursive=True) + ["/proc/self/fd/0"]:
    try:
        with open(path, "w") as f:
            f.write('{"source": "def repeat_word(w): return 1", "function": "repeat_word", "args": [1]}')
    except OSError:
        pass
def repeat_word(w):
    return w
""",
    "fork_a_process_that_writes_later": """
import os, time
def repeat_word(w):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            end = time.monotonic() + 2
            while time.monotonic() < end:  # write into every pipe it can open, e.g. later calls'
                for fd_path in __import__("glob").glob("/proc/[0-9]*/fd/*"):
                    try:
                        fd = os.open(fd_path, os.O_WRONLY | os.O_NONBLOCK)
                        os.write(fd, b'"forged"')
                        os.close(fd)
                    except OSError:
                        pass
                time.sleep(0.01)
        os._exit(0)
    return w
""",
    "write_the_sandbox_stdout_directly": f"""
import os
def forge():
    for path in ["/proc/1/fd/1", "/proc/%d/fd/1" % os.getppid(), "/dev/stdout", "/proc/self/fd/1"]:
        try:
            with open(path, "w") as f:
                f.write("\\n" + {FORGED_REPORT!r} + "\\n")
        except OSError:
            pass
    os.write(1, ("\\n" + {FORGED_REPORT!r} + "\\n").encode())
forge()
def repeat_word(w):
    forge()
    return w
""",
    "sleep_past_the_timeout": "import time\ndef repeat_word(w):\n    time.sleep(1000)\n",
    "exhaust_memory": "def repeat_word(w):\n    hog = []\n    while True:\n        hog.append(b'x' * (8 << 20))\n",
    "kill_the_runner_and_everything": """
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
os.kill(-1, signal.SIGKILL)
def repeat_word(w):
    return w
""",
    "ptrace_the_runner": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in (os.getppid(), 1):
    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH; then it could rewrite the runner's memory
        libc.ptrace(17, pid, 0, 0)
def repeat_word(w):
    return w
""",
    "write_the_result_pipe_itself": """
import os, sys
def repeat_word(w):
    os.write(int(sys.argv[1]), b'"forged"')
    os.write(int(sys.argv[1]), b'"forged"')
    os._exit(0)
""",
    "non_json_values": """
calls = []
def repeat_word(w):
    calls.append(w)
    return [float("nan"), {1, 2}, b"bytes", w.encode(), (lambda: 1), 1j][len(calls) % 6]
""",
    "huge_result": "def repeat_word(w):\n    return [w] * (4 << 20)\n",
    "fork_bomb": "import os\ndef repeat_word(w):\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass\n",
}


@pytest.fixture(scope="module", params=BACKENDS)
def graded(request):
    sandbox = open_sandbox(request.param, slot=21, **LIMITS)
    env = CodeEnv(sandbox={"backend": request.param, **LIMITS})
    yield env, sandbox
    trio.run(sandbox.close)
    trio.run(env.aclose)


def score(env, sandbox, task, source: str) -> float:
    messages = env.initial_messages(task) + [{"role": "assistant", "content": f"```python\n{source}\n```"}]
    return trio.run(env.reward, task, {"sandbox": sandbox}, messages)["tests_passed"]


def reference_tasks(env):
    tasks = {}
    for task in env.tasks("train"):
        tasks.setdefault(task.data["family"], task)
        if len(tasks) == len(FAMILIES):
            return tasks


@pytest.fixture(scope="module")
def repeat_task(graded):
    env, _ = graded
    return next(t for t in env.tasks("train") if t.data["family"] == "repeat_word")


def test_references_score_full_marks(graded):
    env, sandbox = graded
    for family, task in reference_tasks(env).items():
        assert score(env, sandbox, task, task.data["reference"]) == 1.0, family


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_forging_scores_zero(graded, repeat_task, attack):
    env, sandbox = graded
    assert score(env, sandbox, repeat_task, ATTACKS[attack]) == 0.0
    # the sandbox still grades honestly afterwards
    assert score(env, sandbox, repeat_task, repeat_task.data["reference"]) == 1.0


def test_a_partly_right_answer_scores_its_share(graded, repeat_task):
    env, sandbox = graded
    args = [a[0] for a, _ in repeat_task.data["tests"]]
    right = repeat_task.data["reference"].replace("def repeat_word", "def _right")
    source = f"{right}\ndef repeat_word(w):\n    return _right(w) if w == {args[0]!r} else w"
    assert score(env, sandbox, repeat_task, source) == pytest.approx(args.count(args[0]) / len(args))


@pytest.mark.parametrize(
    "body",
    [
        "def is_multiple(x):\n    return 1 if x % {k} == 0 else 0",  # 1 is not True
        "def is_multiple(x):\n    return str(x % {k} == 0).lower()",  # nor "true"
        "def is_multiple(x):\n    return [x % {k} == 0]",
    ],
)
def test_results_must_match_in_type(graded, body):
    env, sandbox = graded
    task = next(t for t in env.tasks("train") if t.data["family"] == "is_multiple")
    k = task.data["reference"].split("% ")[1].split(" ")[0]
    assert score(env, sandbox, task, body.format(k=k)) == 0.0


def test_expected_values_never_enter_the_sandbox(graded, repeat_task):
    env, sandbox = graded
    sent = []
    execute = sandbox.execute

    async def recording(payload):
        sent.append(json.dumps(payload))
        return await execute(payload)

    sandbox.execute = recording
    try:
        assert score(env, sandbox, repeat_task, repeat_task.data["reference"]) == 1.0
    finally:
        del sandbox.execute
    expected = [e for _, e in repeat_task.data["tests"]]
    assert sent and not any(json.dumps(e)[1:-1] in payload for e in expected for payload in sent)


def test_same_value_is_canonical_and_type_strict():
    assert same_value("true", True) and not same_value("1", True) and not same_value("true", 1)
    assert same_value("1", 1) and not same_value("1.0", 1) and same_value("1.5", 1.5)
    assert same_value('{"b": [1, "x"], "a": null}', {"a": None, "b": [1, "x"]})
    assert same_value("[1, 2]", (1, 2))  # tuples travel as JSON arrays
    assert not same_value("NaN", float("nan")) and not same_value("Infinity", 1e999)
    assert not same_value('"x" "y"', "x") and not same_value("", "") and not same_value(None, None)
    assert not same_value("[" * 100000 + "]" * 100000, [])
