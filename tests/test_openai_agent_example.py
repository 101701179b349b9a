"""examples/openai_agent: the OpenAI Agents SDK agent sends what the quickstart's env sends.

The same scripted policy plays a task once through agentrl's own loop with the calculator env and once
through the example's agent (Agents SDK ``Runner.run`` against the recording endpoint): the recorded
tokens, loss masks and rewards are identical, tool errors included. So the warm start, trained on the
calculator env's demonstrations, sees in the agent's episodes exactly the prompts it was trained on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio

from agentrl.agents.agent_runner import AgentRunner
from agentrl.envs.base import load_env
from agentrl.envs.calculator import CalculatorEnv
from agentrl.episode.rollout import run_episode, toolbox_for
from agentrl.episode.turn import EpisodeLimits
from tests._actors_helpers import HttpEngineClient, ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]
LIMITS = EpisodeLimits(max_turns=3, max_total_tokens=256, max_new_tokens_per_turn=40)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))


def agent_env():
    return load_env(f"{ROOT}/examples/openai_agent/calculator_agent.py:CalculatorAgentEnv", {"max_ops": 3})


def demonstrator(expression_of):
    """A policy that sends ``expression_of(question)`` to the calculator, then answers with the result."""

    def script(turn: int, prompt: str) -> str:
        if turn == 0:
            question = re.findall(r"What is (.*)\?", prompt)[-1]
            call = {"name": "calculator", "arguments": {"expression": expression_of(question)}}
            return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
        result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, flags=re.S)[-1]
        return f"The answer is {result}."

    return script


def play_both(tokenizer, script, task):
    with ScriptedEngine(TurnScript(tokenizer, script), version=0) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                env = CalculatorEnv(max_ops=3)
                own = await run_episode(client, tokenizer, env, toolbox_for(env), task, {"max_new_tokens": 40}, LIMITS)
            async with AgentRunner(
                tokenizer, lambda: HttpEngineClient([engine.url]), default_max_tokens=40, max_tokens_cap=40
            ) as runner:
                [agent] = await runner.play(agent_env(), task, limits=LIMITS)
            return own, agent

        return trio.run(main)


def truncated(turn: int, prompt: str) -> str:
    """A tool call the per-turn token limit cuts open (the Agents SDK raises ModelBehaviorError)."""
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + "1 + " * 30 + TurnScript.NO_STOP


@pytest.mark.parametrize("case", ["right", "sloppy", "tool_error", "truncated"])
def test_the_agent_records_the_quickstarts_tokens(tokenizer, case):
    env = CalculatorEnv(max_ops=3)
    task = next(t for t in env.tasks("test") if t.data["num_ops"] == 2)
    expression_of = {
        "right": lambda q: q,
        "sloppy": lambda q: " ".join(q.split()[:3]),
        "tool_error": lambda q: q + " / 0",
        "truncated": None,
    }[case]
    own, agent = play_both(tokenizer, truncated if case == "truncated" else demonstrator(expression_of), task)
    assert agent.tokens.tolist() == own.tokens.tolist()
    assert agent.loss_mask.tolist() == own.loss_mask.tolist()
    assert agent.behavior_logprobs.tolist() == pytest.approx(own.behavior_logprobs.tolist())
    assert agent.reward == own.reward == (1.0 if case == "right" else 0.0)
    assert agent.metadata["num_sequences"] == 1
    assert agent.metadata["num_calls"] == (1 if case == "truncated" else 2)
    if case == "truncated":
        assert own.metadata["finish_reason"] == "truncated_tool_call" and agent.metadata["finish_reason"] == "length"
    if case == "tool_error":
        assert "Error: calculator failed: CalculatorError" in tokenizer.decode(own.tokens.tolist())


def test_the_agents_first_prompt_is_the_warm_starts(tokenizer):
    """The warm start's demonstrations come from the agent env and start with what the agent sends."""
    from agentrl.envs import demonstrations
    from agentrl.episode.chat import codec_for

    env, calc = agent_env(), CalculatorEnv(max_ops=3)
    [record] = demonstrations(env, 1)
    task = next(t for t in calc.tasks("train") if t.id == record["task_id"])
    prompt, _ = codec_for(tokenizer).prompt(record["messages"][:2], record["tools"])
    own, agent = play_both(tokenizer, demonstrator(lambda q: q), task)
    assert agent.tokens.tolist()[: len(prompt)] == list(prompt)
