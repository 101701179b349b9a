"""The agent loop over real HTTP against a scripted SGLang-style engine (and the tiny random model)."""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest
import trio

import agentrl.envs
from agentrl.envs.base import Env, Task, load_env
from agentrl.episode.chat import codec_for
from agentrl.episode.evaluation import evaluate
from agentrl.episode.rollout import run_episode, run_group, toolbox_for
from agentrl.episode.turn import EpisodeLimits, GroupLost
from agentrl.protocol import decode, encode
from agentrl.tools.base import ToolBox
from tests._actors_helpers import (
    HttpEngineClient,
    ModelPolicy,
    ScriptedEngine,
    TurnScript,
    fake_logprob,
    load_tokenizer,
    tiny_model_dir,
    tiny_tokenizer_dir,
)
from tests._actors_user_env import AddEnv, call, solver

TASK = Task(id="t1", data={"a": 12, "b": 30})
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=1024, max_new_tokens_per_turn=96)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))


def play(
    engine: ScriptedEngine,
    tokenizer,
    env: Env,
    task: Task = TASK,
    limits: EpisodeLimits = LIMITS,
    toolbox: ToolBox | None = None,
):
    async def main():
        async with HttpEngineClient([engine.url]) as client:
            return await run_episode(
                client, tokenizer, env, toolbox or toolbox_for(env), task, {"temperature": 1.0}, limits
            )

    return trio.run(main)


def assert_invariant(traj, tokenizer, env: Env, generation_prompt: bool = False) -> None:
    """decode(tokens) is the chat template's rendering of the messages; masked-in tokens are the
    assistant's, with the engine's logprobs."""
    codec = codec_for(tokenizer)
    messages = traj.metadata["messages"]
    tools = toolbox_for(env).schemas() or None
    assert codec.decode(traj.tokens.tolist()) == tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    model = traj.tokens[traj.loss_mask.astype(bool)].tolist()
    assistant = "".join(m["content"] for m in messages if m["role"] == "assistant")
    eot = codec.decode([codec.end_of_turn_id])
    assert codec.decode(model).replace(eot, "") == assistant.replace(eot, "")
    assert (traj.weight_versions[traj.loss_mask == 0] == -1).all()
    assert (traj.behavior_logprobs[traj.loss_mask == 0] == 0).all()
    assert (traj.weight_versions[traj.loss_mask == 1] >= 0).all()
    decode(encode_group(traj))  # goes on the wire


def encode_group(traj):
    from agentrl.protocol import TrajectoryGroup

    return encode(
        TrajectoryGroup(group_id="g", task_id="t", env="e", trajectories=[traj], actor_id="a", session="s", seq=0)
    )


def test_tool_call_episode(tokenizer):
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver), version=7) as engine:
        traj = play(engine, tokenizer, env)
    md = traj.metadata
    assert traj.reward == 1.0
    assert md["finish_reason"] == "answer"
    assert (md["num_turns"], md["num_tool_calls"], md["num_tool_errors"], md["num_aborts"]) == (2, 1, 0, 0)
    assert [m["role"] for m in md["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert md["messages"][2]["content"] == call("add", a=12, b=30)
    assert md["messages"][3]["content"] == "42"
    assert md["messages"][4]["content"] == "The answer is 42."
    assert md["generation_latency_s"] > 0 and md["tool_latency_s"] >= 0
    assert env.cleaned_up == 1
    assert_invariant(traj, tokenizer, env)
    # logprobs are the engine's, token for token; versions too
    positions = np.flatnonzero(traj.loss_mask)
    assert np.allclose(
        traj.behavior_logprobs[positions], [fake_logprob(int(traj.tokens[p]), int(p)) for p in positions], atol=1e-6
    )
    assert set(traj.weight_versions[positions].tolist()) == {7}
    # the engine was asked with exactly the episode's tokens, and never for more than the room left
    req = engine.requests[-1]
    assert req["input_ids"] == traj.tokens[: len(req["input_ids"])].tolist()
    assert req["sampling_params"]["stop_token_ids"] == [codec_for(tokenizer).end_of_turn_id]


def test_weight_updates_interrupt_and_the_turn_continues(tokenizer):
    """Each abort keeps the partial tokens with their old version; the turn goes on under the new one."""
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as reference:
        expected = play(reference, tokenizer, env)
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as engine:
        engine.abort_plan = [3, 0, 5, 2]  # four updates, one of them before any token
        traj = play(engine, tokenizer, env)
    assert traj.tokens.tolist() == expected.tokens.tolist()
    assert traj.loss_mask.tolist() == expected.loss_mask.tolist()
    assert np.allclose(traj.behavior_logprobs, expected.behavior_logprobs)
    assert traj.metadata["num_aborts"] == 4
    assert traj.reward == 1.0
    # 3 tokens at v0, abort; none at v1, abort; 5 at v2, abort; 2 at v3, abort; the rest at v4
    versions = traj.weight_versions[traj.loss_mask == 1].tolist()
    assert versions[:10] == [0] * 3 + [2] * 5 + [3] * 2 and set(versions[10:]) == {4}
    assert_invariant(traj, tokenizer, env)


def test_malformed_tool_calls_become_observations(tokenizer):
    def script(turn, prompt):
        return [
            "<tool_call>\n{not json}\n</tool_call>",
            call("nope", x=1) + call("add", a=1),  # unknown tool, then missing argument
            call("add", a="one", b=2),  # wrong type
            "I give up: 3",
        ][turn]

    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, script)) as engine:
        traj = play(engine, tokenizer, env)
    md = traj.metadata
    assert md["finish_reason"] == "answer" and md["num_turns"] == 4
    assert md["num_tool_calls"] == 3 and md["num_tool_errors"] == 4
    tool_msgs = [m["content"] for m in md["messages"] if m["role"] == "tool"]
    assert "not valid JSON" in tool_msgs[0]
    assert "unknown tool 'nope'" in tool_msgs[1] and "missing required argument(s): b" in tool_msgs[2]
    assert "must be of type integer" in tool_msgs[3]
    assert_invariant(traj, tokenizer, env)


def test_hanging_tool_times_out_and_the_episode_goes_on(tokenizer):
    env = AddEnv()
    toolbox = ToolBox(env.tools(), timeout_s=0.3)

    def script(turn, prompt):
        return [call("wait", seconds=60), call("add", a=12, b=30), "42"][turn]

    with ScriptedEngine(TurnScript(tokenizer, script)) as engine:
        traj = play(engine, tokenizer, env, toolbox=toolbox)
    md = traj.metadata
    assert md["messages"][3]["content"] == "Error: wait timed out after 0.3 s"
    assert md["num_tool_errors"] == 1 and md["finish_reason"] == "answer" and traj.reward == 1.0
    assert md["tool_wall_s"] < 5


def test_reward_that_raises_scores_zero(tokenizer):
    env = AddEnv(reward_raises=True)
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await run_group(client, tokenizer, env, toolbox_for(env), TASK, {}, LIMITS, 3)

        group = trio.run(main)
    assert len(group.trajectories) == 3
    for traj in group.trajectories:
        assert traj.reward == 0.0
        assert traj.metadata["reward_error"].endswith("RuntimeError: the scorer crashed")
    assert env.cleaned_up == 3


@pytest.mark.parametrize("case", ["max_turns", "context_full", "truncated_tool_call", "length_then_answer"])
def test_finish_reasons(tokenizer, case):
    env = AddEnv()
    scripts = {
        "max_turns": lambda turn, prompt: call("add", a=turn, b=1),
        "context_full": lambda turn, prompt: call("add", a=turn, b=1) + " padding" * 5,
        "truncated_tool_call": lambda turn, prompt: '<tool_call>\n{"name": "add", "arguments": {"a": 1' + "1" * 80,
        "length_then_answer": lambda turn, prompt: "forty-two " * 30 + TurnScript.NO_STOP,
    }
    limits = {
        "max_turns": EpisodeLimits(max_turns=3, max_total_tokens=1024, max_new_tokens_per_turn=64),
        "context_full": EpisodeLimits(max_turns=50, max_total_tokens=700, max_new_tokens_per_turn=64),
        "truncated_tool_call": EpisodeLimits(max_turns=5, max_total_tokens=1024, max_new_tokens_per_turn=20),
        "length_then_answer": EpisodeLimits(max_turns=5, max_total_tokens=1024, max_new_tokens_per_turn=10),
    }[case]
    with ScriptedEngine(TurnScript(tokenizer, scripts[case])) as engine:
        traj = play(engine, tokenizer, env, limits=limits)
        max_asked = max(r["sampling_params"]["max_new_tokens"] for r in engine.requests)
    md = traj.metadata
    expected = {"length_then_answer": "answer"}.get(case, case)
    assert md["finish_reason"] == expected
    assert traj.num_tokens <= limits.max_total_tokens
    assert max_asked <= limits.max_new_tokens_per_turn
    if case == "max_turns":
        assert md["num_turns"] == 3 and md["num_tool_calls"] == 2
    if case == "context_full":
        assert traj.num_tokens > 600 and md["num_turns"] > 2
    if case in ("truncated_tool_call", "length_then_answer"):
        assert md["num_turns"] == 1
        assert codec_for(tokenizer).end_of_turn_id not in traj.tokens[traj.loss_mask == 1].tolist()
    assert_invariant(traj, tokenizer, env)


def test_prompt_longer_than_the_context_fails_clearly(tokenizer):
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await run_group(
                    client, tokenizer, env, toolbox_for(env), TASK, {}, EpisodeLimits(max_total_tokens=60), 2
                )

        with pytest.raises(GroupLost, match=r"the prompt has \d+ tokens and leaves no room"):
            trio.run(main)
        assert engine.requests == []


def test_unreachable_engine_loses_the_group(tokenizer):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there
    env = AddEnv()

    async def main():
        async with HttpEngineClient([url]) as client:
            return await run_group(client, tokenizer, env, toolbox_for(env), TASK, {}, LIMITS, 4)

    with pytest.raises(GroupLost, match="generate failed: ConnectError"):
        trio.run(main)
    assert env.cleaned_up == 4


def test_user_env_loaded_by_import_path_and_evaluate(tokenizer):
    env = load_env("tests._actors_user_env:AddEnv", {"num_tasks": 6})
    tasks = list(env.tasks("test"))

    def half_right(turn, prompt):  # solves tasks whose a is even
        a = int(prompt.rsplit("What is ", 1)[1].split(" ")[0])
        return solver(turn, prompt) if a % 2 == 0 else "I do not know."

    with ScriptedEngine(TurnScript(tokenizer, half_right)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await evaluate(client, tokenizer, env, tasks, greedy=True, concurrency=3, limits=LIMITS)

        result = trio.run(main)
        assert {r["sampling_params"]["temperature"] for r in engine.requests} == {0.0}
    even = sum(t.data["a"] % 2 == 0 for t in tasks)
    assert result["n"] == 6 and result["n_failed"] == 0
    assert result["success_rate"] == pytest.approx(even / 6)
    assert result["reward_mean"] == pytest.approx(even / 6)
    assert result["success_by_group"] == {"even": 1.0, "odd": 0.0}  # Env.eval_group labels


def builtin_envs() -> list[str]:
    """Every concrete Env shipped in agentrl.envs (the envs branch builds them)."""
    found = []
    for mod in pkgutil.iter_modules(agentrl.envs.__path__):
        module = importlib.import_module(f"agentrl.envs.{mod.name}")
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, Env)
                and obj.__module__ == module.__name__
                and all(getattr(obj, m) is not getattr(Env, m) for m in ("tasks", "initial_messages", "reward"))
            ):
                found.append(f"{module.__name__}:{name}")
    return found


REQUIRED_KWARGS = {  # the built-in envs that need something to play: a dataset, an environment to adapt
    "agentrl.envs.reasoning_gym:ReasoningGymEnv": {"dataset": "basic_arithmetic"},
    "agentrl.envs.verifiers_env:VerifiersEnv": {"environment": "tests._verifiers_envs:tool_env"},
}


# envs whose prompts hold images: a text model refuses them (tests/test_episode_chat.py); their invariant is
# checked against the tiny vision-language model on the embedded engine in tests/test_visual_env.py
VISION_ENVS = {"agentrl.envs.visual:VisualEnv"}


@pytest.mark.parametrize("env_path", ["tests._actors_user_env:AddEnv", *sorted(set(builtin_envs()) - VISION_ENVS)])
def test_random_model_keeps_the_invariant(tmp_path_factory, tokenizer, env_path):
    """The tiny model with random weights writes garbage (stray special tokens, broken UTF-8, cut
    tool calls): every episode still decodes to its chat, masked-in tokens are the model's."""
    env = load_env(env_path, REQUIRED_KWARGS.get(env_path))
    model_dir = tiny_model_dir(tmp_path_factory)
    assert load_tokenizer(model_dir).get_vocab() == tokenizer.get_vocab()  # the same tokenizer
    policy = ModelPolicy(model_dir, seed=1)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=700, max_new_tokens_per_turn=24)
    tasks = [t for _, t in zip(range(3), env.tasks("train", seed=0))]
    with ScriptedEngine(policy) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                out = []
                try:
                    for task in tasks:
                        out.append(await run_episode(client, tokenizer, env, toolbox_for(env), task, {}, limits))
                finally:
                    if getattr(env, "aclose", None) is not None:
                        await env.aclose()
                return out

        trajs = trio.run(main)
    for traj in trajs:
        assert traj.metadata["finish_reason"] in ("answer", "max_turns", "context_full", "truncated_tool_call")
        assert_invariant(traj, tokenizer, env)
        assert np.all(traj.behavior_logprobs[traj.loss_mask == 1] <= 0)


def test_a_tool_call_written_inside_reasoning_is_not_executed(tokenizer):
    """Qwen3-style reasoning may mention a call; only calls outside <think> run (SGLang separates
    reasoning before parsing tool calls)."""
    env = AddEnv()

    def script(turn: int, prompt: str) -> str:
        if turn == 0:
            return "<think>I could " + call("add", a=1, b=2) + " but I know it.</think>The answer is 42."
        return "unreachable"

    with ScriptedEngine(TurnScript(tokenizer, script)) as engine:
        traj = play(engine, tokenizer, env)
    assert traj.metadata["finish_reason"] == "answer" and traj.metadata["num_tool_calls"] == 0
    assert traj.metadata["num_turns"] == 1
