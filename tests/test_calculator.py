"""The calculator tool (a safe parser, never eval) and the calculator env (the quickstart)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.calculator import CalculatorEnv
from agentrl.tools.base import ToolBox, ToolCall
from agentrl.tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number


@pytest.mark.parametrize(
    "expr, value",
    [
        ("37 + 48 * 2", "133"),
        ("(37 + 48) * 2", "170"),
        ("10 - 4 - 3", "3"),
        ("2 ** 3 ** 2", "512"),
        ("-2 ** 2", "-4"),
        ("2 ^ 10", "1024"),
        ("2 ** -1", "0.5"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.3333333333"),
        ("--5", "5"),
        (" 12 ", "12"),
        (".5 * 4", "2"),
    ],
)
def test_evaluate(expr, value):
    assert format_number(evaluate(expr)) == value


@pytest.mark.parametrize(
    "expr, message",
    [
        ("", "empty"),
        ("1 +", "ends too early"),
        ("(1 + 2", "missing ')'"),
        ("1 + 2)", "unexpected ')'"),
        ("2 3", "unexpected '3'"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 0.5", "whole-number exponents"),
        ("2 ** 100", "exponent 100 is too large"),
        ("__import__('os')", "unexpected character '_'"),
        ("abs(1)", "unexpected character 'a'"),
        ("9" * 300, "longer than 256"),
        ("(" * 40 + "1" + ")" * 40, "nested too deeply"),
        ("99999999 ** 64 ** 1", "too large"),
    ],
)
def test_evaluate_refuses_with_a_reason(expr, message):
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expr)


_int = st.integers(min_value=0, max_value=999).map(str)
_expr = st.recursive(
    _int,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(" ".join), inner.map(lambda e: f"({e})")
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(_expr)
def test_evaluate_agrees_with_python_on_integer_arithmetic(expr):
    # Python's own evaluation is the oracle here, on expressions the strategy builds itself.
    assert evaluate(expr) == Fraction(eval(expr))


def test_tool_through_toolbox():
    box = ToolBox([CalculatorTool()])
    ok = trio.run(box.execute, ToolCall("calculator", {"expression": "37 + 48 * 2"}))
    assert (ok.content, ok.is_error) == ("133", False)
    bad = trio.run(box.execute, ToolCall("calculator", {"expression": "import os"}))
    assert bad.is_error and "CalculatorError: unexpected character 'i'" in bad.content
    wrong = trio.run(box.execute, ToolCall("calculator", {"expr": "1"}))
    assert wrong.is_error and "missing required argument(s): expression" in wrong.content


# ------------------------------------------------------------------------------- env


def test_env_splits_are_disjoint_deterministic_and_sized():
    env = CalculatorEnv()
    test = list(env.tasks("test"))
    assert len(test) == 200 and len({t.id for t in test}) == 200
    assert [t.id for t in env.tasks("test", seed=5)] == [t.id for t in test]
    train = list(itertools.islice(env.tasks("train", seed=0), 3000))
    assert not {t.id for t in train} & {t.id for t in test}
    assert [t.id for t in itertools.islice(env.tasks("train", seed=0), 50)] == [t.id for t in train[:50]]
    assert [t.id for t in itertools.islice(env.tasks("train", seed=1), 50)] != [t.id for t in train[:50]]
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        next(env.tasks("dev"))


def test_env_tasks_follow_the_knobs():
    env = CalculatorEnv(min_ops=2, max_ops=4, max_operand=9)
    for task in itertools.islice(env.tasks("train"), 300):
        assert 2 <= task.data["num_ops"] <= 4
        numbers = [int(x) for x in task.data["expression"].split() if x.isdigit()]
        assert all(0 <= n <= 9 for n in numbers)
        assert task.data["question"] == f"What is {task.data['expression']}?"
        assert format_number(evaluate(task.data["expression"])) == task.data["answer"]
    counts = {n: 0 for n in range(2, 5)}
    for task in itertools.islice(env.tasks("train"), 600):
        counts[task.data["num_ops"]] += 1
    assert min(counts.values()) > 100  # every difficulty level appears


def test_division_questions_have_whole_answers():
    env = CalculatorEnv(ops="/+", max_operand=20)
    tasks = list(itertools.islice(env.tasks("train"), 200))
    assert any("/" in t.data["expression"] for t in tasks)
    assert all("." not in t.data["answer"] for t in tasks)


def test_word_problems():
    env = CalculatorEnv(word_problem_rate=1.0)
    for task in itertools.islice(env.tasks("train"), 50):
        assert task.data["num_ops"] == 1 and not task.data["question"].startswith("What is")
        assert int(task.data["answer"]) >= 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_ops": 3, "max_ops": 2}, "min_ops <= max_ops"),
        ({"ops": "+x"}, "ops must be"),
        ({"max_operand": 0}, "max_operand"),
        ({"test_fraction": 1.5}, "test_fraction"),
    ],
)
def test_env_rejects_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalculatorEnv(**kwargs)


def _episode(env, task, answer):
    return env.initial_messages(task) + [{"role": "assistant", "content": answer}]


def test_reward_is_exact_answer():
    env = CalculatorEnv(format_weight=0.1)
    task = next(t for t in env.tasks("train") if t.data["answer"] != "0")
    answer = task.data["answer"]
    score = lambda text: trio.run(env.reward, task, {}, _episode(env, task, text))  # noqa: E731
    assert score(f"The answer is {answer}.") == {"correct": 1.0, "format": 0.1}
    assert score(answer) == {"correct": 1.0, "format": 0.0}
    assert score(f"The answer is {int(answer) + 1}.")["correct"] == 0.0
    assert score(f"{answer} or maybe 7")["correct"] == 0.0  # the last number counts
    assert score("I do not know")["correct"] == 0.0
    call = {"role": "assistant", "content": f'<tool_call>{{"name": "calculator"}}</tool_call> {answer}'}
    assert trio.run(env.reward, task, {}, env.initial_messages(task) + [call])["correct"] == 0.0
    tool_last = env.demonstration(task) or []
    assert trio.run(env.reward, task, {}, tool_last[:-1])["correct"] == 0.0  # ended on a tool result


def test_demonstrations_are_correct_and_only_cover_easy_questions():
    env = CalculatorEnv(min_ops=1, max_ops=4, demo_max_ops=2)
    box = ToolBox(env.tools())
    seen = 0
    for task in itertools.islice(env.tasks("train"), 200):
        demo = env.demonstration(task)
        if task.data["num_ops"] > 2:
            assert demo is None
            continue
        seen += 1
        system, user, call, result, final = demo
        assert (system["role"], user["role"], call["role"], result["role"], final["role"]) == (
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
        )
        fn = call["tool_calls"][0]["function"]
        assert call["content"] == "" and fn["name"] == "calculator"
        # the tool result in the demonstration is what the real tool answers
        real = trio.run(box.execute, ToolCall(fn["name"], fn["arguments"]))
        assert real.content == result["content"] == task.data["answer"]
        assert trio.run(env.reward, task, {}, demo) == {"correct": 1.0}
    assert seen > 50


def test_sloppy_demonstrator_sends_only_the_first_operation():
    env = CalculatorEnv(min_ops=1, max_ops=3, demo_max_ops=3, demo_shortcut_rate=0.7)
    box = ToolBox(env.tools())
    sloppy = multi = 0
    for task in itertools.islice(env.tasks("train"), 400):
        demo = env.demonstration(task)
        sent = demo[2]["tool_calls"][0]["function"]["arguments"]["expression"]
        real = trio.run(box.execute, ToolCall("calculator", {"expression": sent}))
        assert demo[3]["content"] == real.content and demo[4]["content"] == f"The answer is {real.content}."
        assert env.demonstration(task) == demo  # the same question always gets the same demonstration
        if task.data["num_ops"] == 1:
            assert sent == task.data["expression"]
            continue
        multi += 1
        if sent != task.data["expression"]:
            sloppy += 1
            assert sent.split() == task.data["expression"].split()[:3]  # only the first operation
    assert 0.6 < sloppy / multi < 0.8
    assert env.eval_group(task) == f"{task.data['num_ops']} ops"
    with pytest.raises(ValueError, match="demo_shortcut_rate"):
        CalculatorEnv(demo_shortcut_rate=1.5)


def test_episode_fits_a_tiny_context():
    """The whole correct episode, rendered with the tiny model's tokenizer, stays short."""
    from agentrl.models.builder import SIZES, build_tokenizer

    tokenizer = build_tokenizer(int(SIZES["tiny"]["vocab_target"]))
    env = CalculatorEnv(max_ops=2)
    task = next(t for t in env.tasks("train") if env.demonstration(t))
    schemas = [t.schema() for t in env.tools()]
    ids = tokenizer.apply_chat_template(env.demonstration(task), tools=schemas, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(ids) < 160  # compact tool signatures and one token per digit
