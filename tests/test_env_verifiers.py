"""verifiers environments (built with verifiers' own classes in tests/_verifiers_envs.py) played unchanged by
agentrl's episode loop through ``agentrl.envs.verifiers_env:VerifiersEnv``.

Each episode is played twice with the same scripted model turns: by agentrl (``run_episode`` over HTTP
against a scripted engine, token-exact) and by verifiers' own rollout loop (``Environment.run_rollout`` with
a scripted verifiers client). The conversations, rewards and reward components must agree. Then what the
adapter refuses, a reward function that raises, and one short ``agentrl run`` that mixes a verifiers env
with the calculator.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from agentrl.envs.base import Task
from agentrl.envs.verifiers_env import VerifiersEnv, load_verifiers_env
from agentrl.episode.rollout import run_episode, run_group, toolbox_for
from agentrl.episode.turn import EpisodeFailed, EpisodeLimits
from tests._actors_helpers import HttpEngineClient, ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir
from tests._verifiers_envs import MATH_SYSTEM, ScriptedClient, call
from tests.test_episode_rollout import assert_invariant

ROOT = Path(__file__).resolve().parent.parent
HELPERS = "tests._verifiers_envs"
LIMITS = EpisodeLimits(max_turns=8, max_total_tokens=2048, max_new_tokens_per_turn=128)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def math() -> VerifiersEnv:
    return VerifiersEnv(f"{HELPERS}:math_env")


@pytest.fixture(scope="module")
def guess() -> VerifiersEnv:
    return VerifiersEnv(f"{HELPERS}:guess_env")


@pytest.fixture(scope="module")
def tools() -> VerifiersEnv:
    return VerifiersEnv(f"{HELPERS}:tool_env")


def play(env: VerifiersEnv, tokenizer, task: Task, turns: list[str]):
    """agentrl's episode: the engine answers turn i with ``turns[i]``."""

    async def main():
        with ScriptedEngine(TurnScript(tokenizer, lambda i, prompt: turns[i])) as engine:
            async with HttpEngineClient([engine.url]) as client:
                return await run_episode(client, tokenizer, env, toolbox_for(env), task, {"temperature": 1.0}, LIMITS)

    return trio.run(main)


def verifiers_rollout(factory: str, task: Task, turns: list[str], **env_args: Any) -> dict[str, Any]:
    """verifiers' own rollout and scoring of the same row with the same model turns (a fresh env object)."""
    env = load_verifiers_env(f"{HELPERS}:{factory}", env_args)
    client = ScriptedClient(turns)
    output = asyncio.run(env.run_rollout(task.data, client, "scripted", {}))
    assert client.turns == [], "verifiers asked for fewer turns than scripted"
    return output


def plain(messages: list[Any]) -> list[tuple]:
    """Messages without tool-call ids, as (role, content, [(tool, arguments)]); verifiers' output stores an
    assistant message with tool calls as a dict whose calls are JSON texts."""
    out = []
    for m in messages:
        m = m if isinstance(m, dict) else m.model_dump()
        calls = [json.loads(c) if isinstance(c, str) else c for c in m.get("tool_calls") or []]
        out.append((m["role"], m["content"], [(c["name"], json.loads(c["arguments"])) for c in calls]))
    return out


def weighted(env: VerifiersEnv, metrics: dict[str, float]) -> dict[str, float]:
    """What the components must be: weight * value of each weighted reward function of the rubric."""
    from agentrl.envs.verifiers_env import _leaf_rubrics

    pairs = [(f.__name__, w) for r in _leaf_rubrics(env.vf_env.rubric) for f, w in zip(r.funcs, r.weights) if w]
    return {name: w * metrics[name] for name, w in pairs}


def agentrl_completion(env: VerifiersEnv, task: Task, traj) -> list[Any]:
    """The episode's messages after the prompt, as verifiers messages (the adapter's mapping)."""
    return env.vf_messages(traj.metadata["messages"][len(env.initial_messages(task)) :])


# tasks, prompts and tools


def test_tasks_are_the_datasets_rows_in_a_seeded_order(math, guess):
    vf_env = math.vf_env
    train = [next(it) for it in [math.tasks("train", seed=0)] for _ in range(80)]
    assert {t.id for t in train[:40]} == {f"train-{i}" for i in range(40)}  # one pass over the 40 rows, then again
    assert [t.id for t in train[:40]] != [t.id for t in train[40:]]  # reshuffled per pass
    again = math.tasks("train", seed=0)
    assert [next(again).id for _ in range(80)] == [t.id for t in train]
    other = math.tasks("train", seed=1)
    assert [next(other).id for _ in range(40)] != [t.id for t in train[:40]]
    test = list(math.tasks("test"))
    assert [t.data["question"] for t in test] == vf_env.eval_dataset["question"]
    assert test[0].data["prompt"] == vf_env.eval_dataset[0]["prompt"]
    assert math.initial_messages(test[0]) == [
        {"role": "system", "content": MATH_SYSTEM},
        {"role": "user", "content": test[0].data["question"]},
    ]
    assert math.max_turns == 1 and math.tools() == [] and math.name == "math_env"
    # one dataset only: the adapter holds out a test split by a hash of the prompt
    train_ids = {r["example_id"] for r in guess.rows("train")}
    test_ids = {r["example_id"] for r in guess.rows("test")}
    assert test_ids and not train_ids & test_ids and train_ids | test_ids == set(range(30))
    assert guess.max_turns == 5


def test_a_tool_envs_functions_are_agentrl_tools_with_verifiers_schemas(tools):
    schemas = [t.schema()["function"] for t in tools.tools()]
    assert schemas == [
        {"name": d.name, "description": d.description, "parameters": d.parameters} for d in tools.vf_env.tool_defs
    ]
    assert [s["name"] for s in schemas] == ["add", "constant"]
    assert schemas[0]["parameters"]["properties"]["a"]["description"] == "The first integer."


def test_an_environment_package_loads_by_id_and_its_signal_handlers_are_undone():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    env = VerifiersEnv(HELPERS, env_args={"num_train": 4, "num_eval": 2})  # verifiers.load_environment(id)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert env.name == HELPERS and len(env.rows("train")) == 4 and len(env.rows("test")) == 2


@pytest.mark.parametrize(
    "factory, reason",
    [
        ("stateful_tool_env", "StatefulToolEnv"),
        ("group_reward_env", "'best_of_group' scores a whole group"),
        ("env_group", "EnvGroup is not a MultiTurnEnv"),
    ],
)
def test_what_the_adapter_cannot_play_is_refused_with_the_reason(factory, reason):
    with pytest.raises(ValueError, match=reason):
        VerifiersEnv(f"{HELPERS}:{factory}")


# episodes: agentrl's against verifiers' own


@pytest.mark.parametrize("answer", ["right", "wrong", "unformatted"])
def test_single_turn_math_episode_scores_as_verifiers_does(math, tokenizer, answer):
    task = next(math.tasks("test"))
    right = task.data["answer"]
    text = {"right": f"<answer>{right}</answer>", "wrong": "<answer>1000</answer>", "unformatted": right}[answer]
    traj = play(math, tokenizer, task, [text])
    ours = verifiers_rollout("math_env", task, [text])
    assert traj.metadata["finish_reason"] == "answer" and traj.metadata["num_turns"] == 1
    assert traj.metadata["messages"][-1] == {"role": "assistant", "content": text}
    assert plain(agentrl_completion(math, task, traj)) == plain(ours["completion"])
    assert traj.reward == pytest.approx(ours["reward"])
    assert traj.reward_components == pytest.approx(weighted(math, ours["metrics"]))
    assert set(traj.reward_components) == {"correct", "format_reward_func"}
    assert traj.reward_components["correct"] == (1.0 if answer == "right" else 0.0)
    assert_invariant(traj, tokenizer, math)


def _guesses(task: Task, n_wrong: int, then_right: bool) -> list[str]:
    target = int(task.data["answer"])
    turns = [f"My guess: {g}" for g in range(1, 10) if g != target][:n_wrong]
    return turns + [f"It is {target}."] if then_right else turns


def test_multi_turn_env_response_and_stop_conditions_drive_the_episode(guess, tokenizer):
    task = next(guess.tasks("train"))
    turns = _guesses(task, 1, then_right=True)
    cleaned = len(guess.vf_env.cleaned)
    traj = play(guess, tokenizer, task, turns)
    assert len(guess.vf_env.cleaned) == cleaned + 1  # the env's @vf.cleanup handlers ran, once
    ours = verifiers_rollout("guess_env", task, turns)
    messages = traj.metadata["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[3]["content"] in ("Higher.", "Lower.")  # env_response, as the simulated user's reply
    assert traj.metadata["finish_reason"] == "answer" and ours["stop_condition"] == "guessed"
    assert plain(agentrl_completion(guess, task, traj)) == plain(ours["completion"])
    assert traj.reward == pytest.approx(ours["reward"]) == pytest.approx(1.0 + 0.5 / 2)
    assert traj.reward_components == pytest.approx(weighted(guess, ours["metrics"]))
    assert "turns" not in traj.reward_components and ours["metrics"]["turns"] == 2.0  # a metric: weight 0
    assert_invariant(traj, tokenizer, guess)


def test_a_final_env_response_ends_the_episode_and_is_scored_but_never_shown(guess, tokenizer):
    task = next(guess.tasks("train"))
    turns = _guesses(task, 3, then_right=False)
    traj = play(guess, tokenizer, task, turns)
    ours = verifiers_rollout("guess_env", task, turns)
    messages = traj.metadata["messages"]
    assert [m["role"] for m in messages[2:]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert ours["stop_condition"] == "has_final_env_response"
    final = ours["completion"][-1]
    assert final.role == "user" and final.content == f"Out of guesses: it was {task.data['answer']}."
    assert plain(agentrl_completion(guess, task, traj)) == plain(ours["completion"][:-1])  # the model never saw it
    assert traj.reward == pytest.approx(ours["reward"]) == pytest.approx(0.5 / 3)


def test_an_env_response_agentrl_cannot_append_fails_the_episode_and_cleans_up(tokenizer):
    env = VerifiersEnv(f"{HELPERS}:guess_env", env_args={"chatty": True})
    task = next(env.tasks("train"))
    with pytest.raises(EpisodeFailed, match=r"returned \['user', 'user'\]; agentrl takes exactly one user message"):
        play(env, tokenizer, task, _guesses(task, 2, then_right=False))
    assert len(env.vf_env.cleaned) == 1


def test_aclose_runs_the_envs_teardown_and_stops_its_asyncio_thread(tokenizer):
    env = VerifiersEnv(f"{HELPERS}:guess_env")
    task = next(env.tasks("train"))
    play(env, tokenizer, task, _guesses(task, 1, then_right=True))
    thread = env._loop._thread
    assert thread is not None and thread.is_alive()
    trio.run(env.aclose)
    assert env.vf_env.torn_down and not thread.is_alive()


def test_tool_env_episode_runs_verifiers_tools_and_scores_as_verifiers_does(tools, tokenizer):
    task = next(tools.tasks("test"))
    a, b = task.data["info"]["a"], task.data["info"]["b"]
    turns = [
        "Adding first." + call("add", a=a, b=b) + call("constant", name="dozen"),  # two calls in one turn
        call("constant", name="nope"),  # the function raises KeyError
        f"<answer>{a + b}</answer>",
    ]
    traj = play(tools, tokenizer, task, turns)
    ours = verifiers_rollout("tool_env", task, turns)
    md = traj.metadata
    assert (md["finish_reason"], md["num_turns"], md["num_tool_calls"], md["num_tool_errors"]) == ("answer", 3, 3, 1)
    tool_messages = [m for m in md["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [str(a + b), "12", "Error: tool failed: KeyError: 'nope'"]
    # the same conversation as verifiers', but for agentrl's "Error: " before an error observation
    mine, theirs = plain(agentrl_completion(tools, task, traj)), plain(ours["completion"])
    assert theirs[4] == ("tool", "tool failed: KeyError: 'nope'", [])
    assert mine[:4] + mine[5:] == theirs[:4] + theirs[5:] and mine[4] == ("tool", "Error: " + theirs[4][1], [])
    assert mine[0] == ("assistant", "Adding first.", [("add", {"a": a, "b": b}), ("constant", {"name": "dozen"})])
    ids = [c.id for c in agentrl_completion(tools, task, traj)[0].tool_calls]
    assert [m.tool_call_id for m in agentrl_completion(tools, task, traj)[1:3]] == ids  # each result answers its call
    assert traj.reward == ours["reward"] == 1.0 and traj.reward_components == {"correct": 1.0}
    assert ours["metrics"]["total_tool_calls"] == 3.0  # verifiers' tool metrics see the same calls
    assert_invariant(traj, tokenizer, tools)


def test_a_reward_function_that_raises_is_a_reward_error_not_a_crash(tokenizer):
    env = VerifiersEnv(f"{HELPERS}:math_env", env_args={"raising": True})
    odd = next(t for t in env.tasks("test") if int(t.data["answer"]) % 2)
    even = next(t for t in env.tasks("test") if not int(t.data["answer"]) % 2)

    async def main(task: Task):
        text = f"<answer>{task.data['answer']}</answer>"
        with ScriptedEngine(TurnScript(tokenizer, lambda i, prompt: text)) as engine:
            async with HttpEngineClient([engine.url]) as client:
                return await run_group(client, tokenizer, env, toolbox_for(env), task, {}, LIMITS, 2)

    for traj in trio.run(main, odd).trajectories:
        assert traj.reward == 0.0 and traj.reward_components == {}
        error = traj.metadata["reward_error"]
        assert "'even_only' raised ZeroDivisionError: odd sums are not scored" in error, error
    for traj in trio.run(main, even).trajectories:
        assert "reward_error" not in traj.metadata
        assert traj.reward_components == {"correct": 1.0, "format_reward_func": 0.25, "even_only": 0.0}


# one short real run


MIXED = """
[run]
name = "verifiers-mixed"
torch_num_threads = 1
[engine]
max_context_tokens = 256
max_running_requests = 64
[actors]
num_concurrent_episodes = 16
group_size = 4
max_new_tokens_per_turn = 24
max_staleness = 0
[[envs]]
cls = "agentrl.envs.calculator:CalculatorEnv"
name = "calc"
max_turns = 3
max_total_tokens = 256
kwargs = { max_ops = 2 }
[[envs]]
cls = "agentrl.envs.verifiers_env:VerifiersEnv"
name = "vf-math"
max_total_tokens = 256
kwargs = { environment = "tests/_verifiers_envs.py:math_env", env_args = { num_train = 16, num_eval = 4 } }
[learner]
max_steps = 2
groups_per_step = 4
max_staleness = 0
dynamic_sampling = false
checkpoint_every_steps = 0
[sft]
enabled = false
[eval]
num_tasks = 4
[tracking]
enabled = false
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agentrl_run_mixes_a_verifiers_env_with_the_calculator(tmp_path: Path) -> None:
    from agentrl.config import load_config
    from agentrl.models.builder import init_model
    from agentrl.run.stages import run

    model = init_model(tmp_path / "tiny", "tiny")
    config = tmp_path / "mixed.toml"
    config.write_text(MIXED)
    cfg = load_config(config, [f"model.path={model}"])
    cwd = os.getcwd()
    os.chdir(ROOT)  # the verifiers env's file path is relative to the repository root
    try:
        summary = run(cfg, tmp_path / "run", live_display=False)
    finally:
        os.chdir(cwd)
    assert summary["learner_steps"] == 2
    for when in ("eval_before", "eval_after"):
        by_env = summary[when]["by_env"]
        assert set(by_env) == {"calc", "vf-math"}
        assert by_env["vf-math"]["n"] == 4 and by_env["vf-math"]["n_failed"] == 0
    assert not summary.get("reward_errors"), summary.get("reward_errors")
    rows = [json.loads(line) for line in (tmp_path / "run" / "learner_metrics.jsonl").read_text().splitlines()]
    received = {env: rows[-1].get(f"env/{env}/received", 0) for env in ("calc", "vf-math")}
    assert all(n >= 1 for n in received.values()), received  # both envs' groups reached the learner
