"""The reasoning-gym env, against the real reasoning-gym: tasks, splits, scoring, mixes, demonstrations, errors."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import reasoning_gym
import trio
from _sandbox_helpers import require
from reasoning_gym.utils import extract_answer

from agentrl.config import load_config
from agentrl.envs import make_env
from agentrl.envs.base import run_cleanup, score_episode
from agentrl.envs.reasoning_gym import ReasoningGymEnv, task_key
from agentrl.tools.base import ToolBox, ToolCall
from agentrl.tools.sandbox.local import bwrap_available

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reasoning_gym" / "config.toml"
CHAIN = {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2}
# numbers, an equation, and words: reasoning-gym scores each its own way
SCORED = [
    ("chain_sum", CHAIN),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "max_digits": 2}),
    ("simple_equations", {}),
    ("spell_backward", {}),
    ("letter_counting", {}),
]


def ids(tasks) -> list[str]:
    return [t.id for t in tasks]


def reply(env: ReasoningGymEnv, task, text: str) -> list[dict]:
    return env.initial_messages(task) + [{"role": "assistant", "content": text}]


def reward(env: ReasoningGymEnv, task, messages) -> float:
    total, components, error = trio.run(score_episode, env, task, {}, messages)
    assert error is None and components == {"score": total}
    return total


@pytest.fixture(scope="module")
def chain() -> ReasoningGymEnv:
    return ReasoningGymEnv(dataset="chain_sum", config=CHAIN)


# ------------------------------------------------------------------------------ tasks


def test_tasks_are_deterministic_and_the_splits_disjoint(chain):
    test = chain.test_tasks()
    assert len(test) == 200 and len(set(ids(test))) == 200
    again = ReasoningGymEnv(dataset="chain_sum", config=CHAIN)
    assert ids(again.tasks("test")) == ids(test) == ids(chain.tasks("test", seed=7))  # evaluation's seed: same set
    train = list(itertools.islice(chain.tasks("train", seed=0), 3000))
    assert ids(itertools.islice(again.tasks("train", seed=0), 3000)) == ids(train)
    assert ids(itertools.islice(chain.tasks("train", seed=1), 50)) != ids(train[:50])
    # disjoint by question: no test question is ever a training question (several train seeds)
    more = itertools.chain.from_iterable(itertools.islice(chain.tasks("train", seed=s), 3000) for s in (1, 2))
    train_questions = {t.data["question"] for t in itertools.chain(train, more)}
    assert not train_questions & {t.data["question"] for t in test}
    assert all(chain.in_test_split(t) for t in test) and not any(chain.in_test_split(t) for t in train)
    # the task is reasoning-gym's item as it is
    entry = train[0].data["entry"]
    assert train[0].data["question"] == entry["question"] and train[0].data["answer"] == entry["answer"]
    assert chain.initial_messages(train[0])[1] == {"role": "user", "content": entry["question"]}
    other = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, dataset_seed=1)
    assert ids(other.tasks("test")) != ids(test)
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        chain.tasks("dev")


def test_tasks_are_the_same_in_another_process(chain):
    """Actors, the SFT learner and `agentrl run` each build the env: they must see the same tasks."""
    code = (
        "import itertools, json\n"
        "from agentrl.envs.reasoning_gym import ReasoningGymEnv\n"
        f"env = ReasoningGymEnv(dataset='chain_sum', config={CHAIN!r})\n"
        "print(json.dumps([[t.id for t in env.tasks('test')],"
        " [t.id for t in itertools.islice(env.tasks('train', seed=3), 500)]]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    test, train = json.loads(out.stdout)
    assert test == ids(chain.tasks("test"))
    assert train == ids(itertools.islice(chain.tasks("train", seed=3), 500))


def test_train_stream_reseeds_after_size_items():
    env = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, size=40, num_test_tasks=3)
    train = list(itertools.islice(env.tasks("train"), 200))  # about five datasets of 40 items, none repeated
    assert len(train) == 200
    first_chunk = [t.id for t in train[:30]]
    assert [t.id for t in train[30:60]] != first_chunk and len(set(ids(train))) > 150
    assert len(env.test_tasks()) == 3


def test_a_task_space_too_small_for_a_training_split_is_named():
    env = ReasoningGymEnv(
        dataset="chain_sum",
        config={"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1},  # ten questions
        test_fraction=0.99,
        size=20,
    )
    with pytest.raises(ValueError, match="fall in the test split"):
        list(itertools.islice(env.tasks("train"), 10))


# ---------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("name, config", SCORED)
def test_rewards_are_reasoning_gyms_own_scores(name, config):
    env = ReasoningGymEnv(dataset=name, config=config)
    own = reasoning_gym.create_dataset(name, **config)  # a dataset of our own, to score with its own method
    for task in itertools.islice(env.tasks("train"), 5):
        entry, answer = task.data["entry"], task.data["answer"]

        def check(text: str, expected: float | None = None, entry=entry, task=task) -> float:
            got = reward(env, task, reply(env, task, text))
            assert got == own.score_answer(extract_answer(text), entry)
            if expected is not None:
                assert got == expected
            return got

        check(f"<answer>{answer}</answer>", 1.0)
        check(f"<think>Let me see. <answer>0</answer></think> <answer> {answer} </answer>", 1.0)
        assert check(f"<answer>{answer}7x</answer>") < 1.0  # wrong: reasoning-gym's partial credit, if any
        check(answer, 0.0)  # malformed: no tags, reasoning-gym scores None
        check("<answer></answer>", 0.0)
        assert env.eval_group(task) == name
        assert env.is_success(task, 1.0) and not env.is_success(task, 0.99)


def test_an_episode_that_ends_on_a_tool_call_scores_none():
    env = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, tools=["calculator"])
    task = next(iter(env.tasks("train")))
    demo = env.demonstration(task)
    assert demo is not None
    own = reasoning_gym.create_dataset("chain_sum", **CHAIN)
    assert reward(env, task, demo[:-2]) == own.score_answer(None, task.data["entry"]) == 0.0
    raw_call = reply(
        env, task, f'<tool_call>{{"name": "calculator"}}</tool_call><answer>{task.data["answer"]}</answer>'
    )
    assert reward(env, task, raw_call) == 0.0


def test_group_by_adds_a_metadata_value_to_the_eval_group():
    env = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, group_by="num_terms")
    groups = Counter(env.eval_group(t) for t in env.tasks("test"))
    assert set(groups) == {"chain_sum num_terms=2", "chain_sum num_terms=3", "chain_sum num_terms=4"}
    assert ReasoningGymEnv(dataset="chain_sum", config=CHAIN, group_by="nope").eval_group(env.test_tasks()[0]) == (
        "chain_sum"
    )


# ------------------------------------------------------------------------------ mixes


def test_a_weighted_mix_draws_each_dataset_in_proportion_and_scores_each_its_way():
    env = ReasoningGymEnv(
        datasets=[
            {"name": "chain_sum", "weight": 3, "config": CHAIN},
            {"name": "spell_backward", "weight": 1},
        ],
        size=2000,
    )
    train = list(itertools.islice(env.tasks("train"), 2000))
    share = Counter(t.data["dataset"] for t in train)["chain_sum"] / len(train)
    assert 0.71 < share < 0.79  # 3 : 1
    for task in train[:40]:
        assert env.eval_group(task) == task.data["dataset"] == task.data["entry"]["metadata"]["source_dataset"]
        assert reward(env, task, reply(env, task, f"<answer>{task.data['answer']}</answer>")) == 1.0
    test_share = Counter(t.data["dataset"] for t in env.tasks("test"))
    assert set(test_share) == {"chain_sum", "spell_backward"} and test_share["chain_sum"] > test_share["spell_backward"]
    # the split key holds the dataset's name: the same question text in two datasets is two keys
    assert task_key("a", "q") != task_key("b", "q")


# ---------------------------------------------------------------------- demonstrations


@pytest.mark.parametrize("name, config", SCORED)
def test_demonstrations_score_one(name, config):
    env = ReasoningGymEnv(dataset=name, config=config)
    demos = 0
    for task in itertools.islice(env.tasks("train"), 30):
        demo = env.demonstration(task)
        if demo is None:
            assert env.score_answer(task.data["answer"], task) < 1.0
            continue
        demos += 1
        assert demo[:2] == env.initial_messages(task) and demo[-1] == {
            "role": "assistant",
            "content": f"<answer>{task.data['answer']}</answer>",
        }
        assert reward(env, task, demo) == 1.0
    assert demos == 30


def test_calculator_demonstrations_call_the_real_tool_and_score_one():
    env = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, tools=["calculator"])
    box = ToolBox(env.tools())
    assert [t.name for t in env.tools()] == ["calculator"] and "calculator" in env.system_prompt
    assert ReasoningGymEnv(dataset="chain_sum", tools="calculator").tool_names == ("calculator",)
    for task in itertools.islice(env.tasks("train"), 60):
        system, user, call, result, final = env.demonstration(task) or []
        fn = call["tool_calls"][0]["function"]
        assert fn["arguments"]["expression"] == task.data["entry"]["metadata"]["expression"]
        real = trio.run(box.execute, ToolCall(fn["name"], fn["arguments"]))
        assert real.content == result["content"] == task.data["answer"]
        assert reward(env, task, [system, user, call, result, final]) == 1.0


def test_the_sloppy_demonstrator_sends_only_the_first_operation():
    env = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, tools=["calculator"], demo_shortcut_rate=0.7)
    box = ToolBox(env.tools())
    sloppy = multi = 0
    for task in itertools.islice(env.tasks("train"), 400):
        demo = env.demonstration(task)
        assert demo is not None and env.demonstration(task) == demo  # one question, one demonstration
        expression = task.data["entry"]["metadata"]["expression"]
        sent = demo[2]["tool_calls"][0]["function"]["arguments"]["expression"]
        real = trio.run(box.execute, ToolCall("calculator", {"expression": sent}))
        assert demo[3]["content"] == real.content and demo[4]["content"] == f"<answer>{real.content}</answer>"
        if task.data["entry"]["metadata"]["num_terms"] == 2:
            assert sent == expression
            continue
        multi += 1
        if sent != expression:
            sloppy += 1
            assert sent.split() == expression.split()[:3]
    assert multi > 150 and 0.6 < sloppy / multi < 0.8


def test_a_calculator_that_disagrees_with_the_dataset_is_not_demonstrated():
    """basic_arithmetic without parentheses computes left to right ("3 + 4 * 5" is 35): the demonstrator
    does not call a calculator that would say 23, it answers the dataset's answer."""
    config = {"min_terms": 3, "max_terms": 3, "max_digits": 1, "operators": ["+", "*"], "allow_parentheses": False}
    env = ReasoningGymEnv(dataset="basic_arithmetic", config=config, tools=["calculator"])
    kinds = Counter()
    for task in itertools.islice(env.tasks("train"), 100):
        demo = env.demonstration(task)
        assert demo is not None and reward(env, task, demo) == 1.0
        kinds["calculator" if len(demo) == 5 else "plain"] += 1
    assert kinds["calculator"] > 10 and kinds["plain"] > 10


# ------------------------------------------------------------------------------- tools


def test_no_tools_no_sandbox_and_the_answer_format_in_the_prompt(chain):
    assert chain.tools() == [] and "<answer></answer>" in chain.system_prompt
    assert trio.run(chain.setup, chain.test_tasks()[0]) == {} and chain._pool is None
    named = ReasoningGymEnv(dataset="chain_sum", config=CHAIN, system_prompt="Just answer.")
    assert named.initial_messages(named.test_tasks()[0])[0] == {"role": "system", "content": "Just answer."}


def test_the_python_tool_runs_in_the_episodes_sandbox():
    require(bwrap_available())
    env = ReasoningGymEnv(
        dataset="chain_sum", config=CHAIN, tools=["python"], sandbox={"pool_size": 1, "wall_time_s": 4}
    )
    task = next(iter(env.tasks("train")))
    expression = task.data["entry"]["metadata"]["expression"]

    async def main():
        state = await env.setup(task)
        try:
            shown = await ToolBox(env.tools()).execute(ToolCall("python", {"code": f"print({expression})"}), state)
            messages = reply(env, task, f"<answer>{shown.content.strip()}</answer>")
            return await env.reward(task, state, messages), state
        finally:
            assert await run_cleanup(env, task, state) is None
            await env.aclose()

    score, state = trio.run(main)
    assert score == {"score": 1.0} and "sandbox" not in state
    assert [t.name for t in env.tools()] == ["python"] and "Python" in env.system_prompt


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset": "chain_sums"}, r"unknown reasoning-gym dataset 'chain_sums'; did you mean chain_sum"),
        ({"dataset": "composite"}, "unknown reasoning-gym dataset 'composite'"),
        (
            {"datasets": [{"name": "chain_sum", "weight": 0}]},
            "weight of dataset 'chain_sum' must be a finite number > 0",
        ),
        ({"datasets": [{"name": "chain_sum", "weight": -1}]}, "weight of dataset 'chain_sum'"),
        ({"datasets": [{"name": "chain_sum", "weight": "2"}]}, "weight of dataset 'chain_sum'"),
        ({"datasets": [{"name": "chain_sum", "weight": float("nan")}]}, "weight of dataset 'chain_sum'"),
        ({"datasets": [{"name": "chain_sum", "weight": True}]}, "weight of dataset 'chain_sum'"),
        ({"datasets": [{"name": "chain_sum", "wieght": 1}]}, r"datasets\[0\] has unknown key\(s\) wieght"),
        ({"datasets": [{"weight": 1}]}, r"datasets\[0\] needs a dataset `name`"),
        ({"datasets": [{"name": "chain_sum"}, {"name": "chain_sum"}]}, "chain_sum appear more than once"),
        ({"datasets": []}, "non-empty list"),
        ({}, "give either `dataset`"),
        ({"dataset": "chain_sum", "datasets": [{"name": "chain_sum"}]}, "give either `dataset`"),
        ({"datasets": [{"name": "chain_sum"}], "config": {}}, "`config` goes with `dataset`"),
        ({"dataset": "chain_sum", "config": {"max_term": 3}}, "'chain_sum' has no setting.s. max_term; its settings"),
        ({"dataset": "chain_sum", "config": {"seed": 3}}, "sets seed: use the env's dataset_seed and size"),
        ({"dataset": "chain_sum", "config": {"min_terms": 0}}, "rejects the config of dataset 'chain_sum'.*min_terms"),
        ({"dataset": "chain_sum", "tools": ["calc"]}, "unknown tool.s. 'calc'"),
        ({"dataset": "chain_sum", "size": 0}, "size must be"),
        ({"dataset": "chain_sum", "test_fraction": 1.0}, "test_fraction"),
        ({"dataset": "chain_sum", "demo_shortcut_rate": 2}, "demo_shortcut_rate"),
        ({"dataset": "chain_sum", "num_test_tasks": 0}, "num_test_tasks"),
    ],
)
def test_config_errors_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReasoningGymEnv(**kwargs)


def test_a_size_reasoning_gym_refuses_is_named():
    with pytest.raises(ValueError, match="reasoning-gym cannot build word_ladder with size=1000000"):
        ReasoningGymEnv(dataset="word_ladder", size=1_000_000)


# ----------------------------------------------------------------------------- example


def test_the_example_builds_and_its_episode_fits_the_tiny_context():
    from agentrl.models.builder import SIZES, build_tokenizer

    cfg = load_config(EXAMPLE)
    env = make_env(cfg)
    assert isinstance(env, ReasoningGymEnv) and [t.name for t in env.tools()] == ["calculator"]
    tokenizer = build_tokenizer(int(SIZES["tiny"]["vocab_target"]))
    schemas = [t.schema() for t in env.tools()]
    longest = 0
    for task in env.test_tasks():
        demo = env.demonstration(task)
        assert demo is not None
        encoded = tokenizer.apply_chat_template(demo, tools=schemas, tokenize=True)
        encoded = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        longest = max(longest, len(encoded))
    assert cfg.env is not None and longest < cfg.env.max_total_tokens - 40  # room for a longer reply
