"""The agent endpoint with real clients: the official ``openai`` SDK, the OpenAI Agents SDK and LangChain's
``ChatOpenAI`` drive AgentEnv episodes through :class:`agentrl.agents.agent_runner.AgentRunner`.

* Against a real embedded engine process (the tiny random model): the recorded sequences are, token for
  token, what the engine generated (a direct ``/generate`` with the same prompt and seed gives the same ids
  and logprobs; a teacher-forced forward gives the same logprobs) and what the chat template renders for
  the messages; ``n`` > 1; streaming; ``stop`` strings; the engine's own ``/v1`` routes with the same SDK.
* Against the scripted SGLang-style engine (tests/_actors_helpers.py, real HTTP): tool-call round trips
  (a random model rarely calls tools), weight-update aborts continued, keys (the border), 400s, agents
  that raise, cancellation. The stitching tests run with the tiny tokenizer and with Qwen3's own
  (tests/_real_tokenizer.py: its vocabulary, merges and template, whose turns a Qwen3 model starts by thinking).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import numpy as np
import pytest
import trio

from agentrl.agents.agent_runner import AgentRunner, play_agent_episode
from agentrl.agents.openai_api import split_tool_calls
from agentrl.engine.client import EngineClient
from agentrl.envs.agent import AgentEnv
from agentrl.envs.base import Task
from agentrl.episode.chat import ChatCodec
from agentrl.episode.turn import EpisodeFailed, GroupLost
from agentrl.tools.parsing import HermesToolCallParser
from tests._actors_helpers import ScriptedEngine, TurnScript, fake_logprob, load_tokenizer
from tests._chat_templates import family_tokenizer
from tests.conftest_engine import max_abs_diff, start_engines

USER = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
TASK = Task("t1", {"a": 2, "b": 3})


@pytest.fixture(scope="module")
def tokenizer(engine_model):
    return load_tokenizer(engine_model)


@pytest.fixture(scope="module", params=["tiny", "qwen3_real"])
def any_tokenizer(request, tokenizer):
    """The tiny model's tokenizer, then Qwen3's real one, for the scripted engine (which needs no model)."""
    return tokenizer if request.param == "tiny" else family_tokenizer("qwen3_real")


@pytest.fixture(scope="module")
def codec(tokenizer) -> ChatCodec:
    return ChatCodec(tokenizer)


@pytest.fixture(scope="module")
def engine_url(engine_model, tmp_path_factory):
    [proc] = start_engines(engine_model, 1, tmp_path_factory.mktemp("agents_engine"))
    yield proc.url
    proc.stop()


class Agent(AgentEnv):
    """An AgentEnv whose run() is a function given per test."""

    def __init__(self, play, reward=None):
        self.play, self._reward = play, reward

    async def run(self, task, client):
        return await self.play(task, client)

    async def reward(self, task, state, messages):
        return self._reward(messages)


def play(tokenizer, url: str, env: AgentEnv, task: Task = TASK, *, n_episodes: int = 1, limits=None, **runner_kwargs):
    """Run ``n_episodes`` episodes of ``env`` as one group (concurrently); their trajectory lists."""
    runner_kwargs.setdefault("default_max_tokens", 48)

    async def main():
        with trio.fail_after(180):
            async with AgentRunner(
                tokenizer, lambda: EngineClient([url], health_check_interval_s=0.5), **runner_kwargs
            ) as runner:
                group = await runner.play_group(env, task, n_episodes, group_id="ep", actor_id="a0", limits=limits)
        assert (group.group_id, group.task_id, group.env, group.actor_id) == ("ep", task.id, env.name, "a0")
        return [[t for t in group.trajectories if t.metadata["episode_id"] == f"ep-{i}"] for i in range(n_episodes)]

    return trio.run(main)


def template_ids(tokenizer, messages, tools=None) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def model_spans(traj) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens."""
    spans, start = [], None
    for i, m in enumerate(list(traj.loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def assert_template(traj, tokenizer, tools=None) -> None:
    """The tokens decode to the chat template's rendering of the sequence's messages (model text as generated)."""
    assert tokenizer.decode(list(traj.tokens), skip_special_tokens=False) == tokenizer.apply_chat_template(
        traj.metadata["messages"], tools=tools, tokenize=False
    )


# ----------------------------------------------------------------------------- the real engine


def test_sdk_calls_are_recorded_token_for_token_as_the_engine_generated_them(
    tokenizer, codec, engine_url, engine_teacher
):
    seen: dict = {}

    async def agent(task, client):
        first = await client.chat.completions.create(
            model="any-name", messages=USER, tools=[ADD], seed=11, max_tokens=12, logprobs=True
        )
        seen["first"] = first
        history = USER + [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        stream = await client.chat.completions.create(
            model="any-name",
            messages=history,
            tools=[ADD],
            seed=12,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        seen["chunks"] = [c async for c in stream]
        return 1.0

    [[traj]] = play(tokenizer, engine_url, Agent(agent))
    md = traj.metadata
    assert (md["num_calls"], md["num_sequences"], md["new_sequence_reason"], md["num_stitched_calls"]) == (
        2,
        1,
        "first_call",
        1,
    )
    assert traj.reward == 1.0 and md["env"] == "agent" and md["task_id"] == "t1" and md["episode_id"] == "ep-0"
    assert_template(traj, tokenizer, tools=[ADD])
    prompt = template_ids(tokenizer, USER, [ADD])
    assert list(traj.tokens[: len(prompt)]) == prompt  # the first prompt is the template's, tokenized as a whole
    spans = model_spans(traj)
    assert len(spans) == 2 and spans[0][0] == len(prompt)
    tokens = [int(t) for t in traj.tokens]

    assert_engine_generated(traj, spans, [(11, 12), (12, 10)], engine_url, codec, engine_teacher)

    first = seen["first"]  # what the client saw is what was recorded
    assert first.metadata == {"weight_version": "0"}
    s0, e0 = spans[0]
    assert [lp.logprob for lp in first.choices[0].logprobs.content] == pytest.approx(
        traj.behavior_logprobs[s0:e0].tolist(), abs=1e-6
    )
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(prompt), e0 - s0)
    text = codec.decode(tokens[s0 : e0 - 1] if tokens[e0 - 1] == codec.end_of_turn_id else tokens[s0:e0])
    assert first.choices[0].message.content == split_tool_calls(text, HermesToolCallParser(), {"add"})[0]
    chunks = seen["chunks"]
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and chunks[-1].usage.completion_tokens == spans[1][1] - spans[1][0]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    s1, e1 = spans[1]
    text = codec.decode(tokens[s1 : e1 - 1] if tokens[e1 - 1] == codec.end_of_turn_id else tokens[s1:e1])
    assert streamed == split_tool_calls(text, HermesToolCallParser(), {"add"})[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == md["finish_reason"]


def test_n_choices_are_branches_and_the_one_the_agent_continues_grows(tokenizer, codec, engine_url):
    async def agent(task, client):
        first = await client.chat.completions.create(model="m", messages=USER, n=3, seed=7, max_tokens=6)
        assert [c.index for c in first.choices] == [0, 1, 2]
        history = USER + [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on"}]
        await client.chat.completions.create(model="m", messages=history, seed=8, max_tokens=6)
        return 0.25

    [trajs] = play(tokenizer, engine_url, Agent(agent))
    assert [(t.metadata["new_sequence_reason"], t.metadata["num_calls"]) for t in trajs] == [
        ("first_call", 1),
        ("branch", 2),
        ("branch", 1),
    ]
    prompt = template_ids(tokenizer, USER)
    completions = []
    for t in trajs:
        assert t.reward == 0.25 and list(t.tokens[: len(prompt)]) == prompt and not t.loss_mask[: len(prompt)].any()
        assert_template(t, tokenizer)
        start, end = model_spans(t)[0]
        completions.append([int(x) for x in t.tokens[start:end]])

    async def replay():  # choice i sampled with seed + i
        async with EngineClient([engine_url]) as client:
            return [
                await client.generate(
                    prompt, {"sampling_seed": 7 + i, "max_new_tokens": 6, "stop_token_ids": [codec.end_of_turn_id]}
                )
                for i in range(3)
            ]

    assert [r.output_ids for r in trio.run(replay)] == completions
    assert len({tuple(c) for c in completions}) == 3


def test_a_stop_string_cuts_the_content_and_finishes_with_stop_on_the_real_engine(tokenizer, codec, engine_url):
    """``stop`` goes to the engine: the same seed without and with a stop string taken from the first completion;
    the second ends at the string's first occurrence (finish_reason "stop", SGLang's matched_stop), the client
    sees the text before it, and the recorded tokens keep what the model generated through the string."""
    seen: dict = {}

    async def agent(task, client):
        for seed in range(1, 9):  # a random model: find a completion with a plain word-ish piece inside
            free = await client.chat.completions.create(model="m", messages=USER, seed=seed, max_tokens=24)
            text = free.choices[0].message.content
            pieces = [text[k : k + 3] for k in range(1, len(text) - 3)]
            stops = [p for p in pieces if p.isascii() and p.isalpha() and text.find(p) > 0]
            if stops:
                break
        assert stops, "no completion with a stop string to take"
        stop = stops[len(stops) // 2]
        cut = await client.chat.completions.create(model="m", messages=USER, seed=seed, max_tokens=24, stop=[stop])
        seen.update(text=text, stop=stop, free=free.choices[0], cut=cut.choices[0])
        return 1.0

    [trajs] = play(tokenizer, engine_url, Agent(agent))
    text, stop, free, cut = seen["text"], seen["stop"], seen["free"], seen["cut"]
    assert cut.message.content == text[: text.find(stop)] and stop not in cut.message.content
    assert stop in free.message.content  # the same seed without the stop string went past it
    assert cut.finish_reason == "stop" and cut.model_extra.get("matched_stop") == stop
    recorded = trajs[-1]  # the cut call: the model's tokens through the stop string, no end-of-turn token
    model = [int(t) for t in recorded.tokens[recorded.loss_mask == 1]]
    assert model[-1] != codec.end_of_turn_id and stop in codec.decode(model)
    assert text.startswith(codec.decode(model)) and codec.decode(model[:-1]).find(stop) == -1  # stopped at once
    assert recorded.metadata["call_finish_reasons"] == ["stop"]


def test_the_engine_serves_the_same_v1_routes_without_recording(tokenizer, codec, engine_url, engine_model):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [str(engine_model)]
        assert (await client.models.retrieve(str(engine_model))).id == str(engine_model)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other")
        reply = await client.chat.completions.create(
            model=str(engine_model), messages=USER, seed=3, max_tokens=8, logprobs=True
        )
        streamed = await client.chat.completions.create(
            model=str(engine_model), messages=USER, seed=3, max_tokens=8, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=USER, logit_bias={"5": 3})
        await client.close()
        async with httpx.AsyncClient() as http:
            direct = (
                await http.post(
                    engine_url + "/generate",
                    json={
                        "input_ids": template_ids(tokenizer, USER),
                        "return_logprob": True,
                        "sampling_params": {
                            "sampling_seed": 3,
                            "max_new_tokens": 8,
                            "stop_token_ids": [codec.end_of_turn_id],
                        },
                    },
                )
            ).json()
        return reply, text, info.value, direct

    reply, text, refused, direct = asyncio.run(main())
    assert [lp.logprob for lp in reply.choices[0].logprobs.content] == pytest.approx(
        [x[0] for x in direct["meta_info"]["output_token_logprobs"]], abs=1e-5
    )
    assert (
        reply.choices[0].message.content
        == text
        == codec.decode([t for t in direct["output_ids"] if t != codec.end_of_turn_id])
    )
    assert (refused.status_code, refused.param, refused.code) == (400, "logit_bias", "unsupported_parameter")


def test_a_real_weight_update_abort_is_continued_into_one_completion(tokenizer, engine_url, engine_teacher):
    """pause_generation(abort) + a new version + continue, on the real engine, while an agent's call runs."""
    seen: dict = {}

    async def agent(task, client):
        seen["reply"] = await client.chat.completions.create(model="m", messages=USER, seed=5, max_tokens=400)
        return 1.0

    async def main():
        async with httpx.AsyncClient(base_url=engine_url, timeout=30) as http:

            async def interrupt() -> None:
                with trio.fail_after(60):
                    while (await http.get("/server_info")).json()["num_running"] == 0:
                        await trio.sleep(0.05)  # polling the external process, bounded
                for path, body in (
                    ("/pause_generation", {"mode": "abort"}),
                    ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
                    ("/continue_generation", {}),
                ):
                    assert (await http.post(path, json=body)).status_code == 200

            try:
                async with AgentRunner(tokenizer, lambda: EngineClient([engine_url])) as runner:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(interrupt)
                        trajectories = await runner.play(Agent(agent), TASK)
            finally:  # leave the shared engine as found
                await http.post("/update_weight_version", json={"new_version": "0", "abort_all_requests": False})
        return trajectories

    [traj] = trio.run(main)
    md = traj.metadata
    assert md["num_aborts"] >= 1 and md["num_generate_calls"] == md["num_aborts"] + 1 and md["num_sequences"] == 1
    [(start, end)] = model_spans(traj)  # one completion, as the agent saw it
    versions = traj.weight_versions[start:end].tolist()
    cut = versions.index(1)
    assert 0 < cut and versions == [0] * cut + [1] * (end - start - cut)
    reply = seen["reply"].choices[0]
    assert reply.finish_reason in ("stop", "length") and seen["reply"].usage.completion_tokens == end - start
    tokens = [int(t) for t in traj.tokens]
    teacher = engine_teacher.logprobs(tokens[:start], tokens[start:end])  # the weights did not change
    assert max_abs_diff(teacher, traj.behavior_logprobs[start:end].tolist()) < 1e-4
    assert_template(traj, tokenizer)


def test_an_openai_agents_sdk_agent_is_recorded_token_for_token_as_the_engine_generated_it(
    tokenizer, codec, engine_url, engine_teacher
):
    """An Agents SDK ``Agent`` with a ``function_tool`` run by ``Runner.run`` on the real engine: every request
    the SDK sends is accepted, the first prompt is the template's rendering of the messages and tools it sent,
    and each completion is what the engine generates for that prompt and seed (the same ids and logprobs on a
    replay; the teacher-forced logprobs). A random model rarely calls tools: the round trip is covered with
    the scripted engine (test_the_openai_agents_sdk_runs_unchanged)."""
    from agents import Agent as SdkAgent
    from agents import (
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
    )

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    sent: list[dict] = []

    async def agent(task, client):
        create = client.chat.completions.create

        async def recording_create(**kwargs):  # what the SDK sends, as it sends it
            sent.append(
                json.loads(
                    json.dumps({k: kwargs.get(k) for k in ("messages", "tools", "seed", "max_tokens")}, default=str)
                )
            )
            return await create(**kwargs)

        client.chat.completions.create = recording_create
        calculator = SdkAgent(
            name="calc",
            instructions="Use the tools.",
            tools=[add],
            model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
            model_settings=ModelSettings(max_tokens=12, extra_args={"seed": 11}),
        )
        try:
            await Runner.run(calculator, "What is 2 + 3?", max_turns=3, run_config=RunConfig(tracing_disabled=True))
        except (MaxTurnsExceeded, ModelBehaviorError):  # a random model's reply: an episode to score
            pass
        return 1.0

    [[traj]] = play(tokenizer, engine_url, Agent(agent))
    md = traj.metadata
    assert sent and md["num_calls"] == len(sent) and md["num_sequences"] == 1 and traj.reward == 1.0
    assert [(s["seed"], s["max_tokens"]) for s in sent] == [(11, 12)] * len(sent)
    tools = sent[0]["tools"]
    assert [t["function"]["name"] for t in tools] == ["add"]
    assert sent[0]["messages"] == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert md["messages"][:2] == sent[0]["messages"]  # as recorded
    assert_template(traj, tokenizer, tools=tools)
    prompt = template_ids(tokenizer, sent[0]["messages"], tools)
    tokens = [int(t) for t in traj.tokens]
    assert tokens[: len(prompt)] == prompt  # the first prompt is the template's, tokenized as a whole
    spans = model_spans(traj)
    assert [tuple(s) for s in md["call_spans"]] == spans and spans[0][0] == len(prompt)
    for i, (start, _) in enumerate(spans[1:], 1):  # a later call's prompt renders as the SDK's messages
        assert tokenizer.decode(tokens[:start], skip_special_tokens=False) == tokenizer.apply_chat_template(
            sent[i]["messages"], tools=tools, add_generation_prompt=True, tokenize=False
        )

    assert_engine_generated(traj, spans, [(11, 12)] * len(spans), engine_url, codec, engine_teacher)


def assert_engine_generated(traj, spans, seeds_and_limits, engine_url, codec, engine_teacher) -> None:
    """Each recorded completion is what the engine generates for its prompt, seed and length limit
    (a replay gives the same ids and logprobs) and its logprobs are the teacher-forced ones, all
    under policy version 0."""
    tokens = [int(t) for t in traj.tokens]

    async def replay():
        async with EngineClient([engine_url]) as client:
            out = []
            for (start, _), (seed, limit) in zip(spans, seeds_and_limits):
                params = {"sampling_seed": seed, "max_new_tokens": limit, "stop_token_ids": [codec.end_of_turn_id]}
                out.append(await client.generate(tokens[:start], params))
            return out

    replies = trio.run(replay)
    assert len(replies) == len(spans)
    for (start, end), direct in zip(spans, replies):
        assert direct.output_ids == tokens[start:end]  # what the engine generates for this prompt and seed
        assert max_abs_diff(direct.output_logprobs, traj.behavior_logprobs[start:end].tolist()) < 1e-5
        teacher = engine_teacher.logprobs(tokens[:start], tokens[start:end])
        assert max_abs_diff(teacher, traj.behavior_logprobs[start:end].tolist()) < 1e-4
    assert set(traj.weight_versions[traj.loss_mask == 1].tolist()) == {0}


# ----------------------------------------------------------------------------- scripted engine


def thinks(tokenizer) -> bool:
    """Qwen3's template: a full rendering gives the last turn an empty ``<think>`` block when it has none."""
    return "<think>" in tokenizer.chat_template


def thought(tokenizer, *turns: str) -> tuple[str, ...]:
    """The turns as the tokenizer's model writes them: a Qwen3 model (thinking) starts each with a thought."""
    if not thinks(tokenizer):
        return turns
    return tuple(t if t.startswith("<think>") else f"<think>\nTurn {i}.\n</think>\n\n{t}" for i, t in enumerate(turns))


def scripted(tokenizer, turns=(CALL, ANSWER)):
    return ScriptedEngine(TurnScript(tokenizer, lambda turn, prompt: turns[min(turn, len(turns) - 1)]))


def assert_scripted(traj, tokenizer, tools, turns=(CALL, ANSWER)) -> None:
    """One sequence holding the scripted turns as its model tokens, with the engine's logprobs."""
    assert traj.metadata["num_sequences"] == 1 and traj.metadata["num_calls"] == len(turns)
    assert_template(traj, tokenizer, tools=tools)
    model = [int(t) for t in traj.tokens[traj.loss_mask == 1]]
    assert tokenizer.decode(model, skip_special_tokens=False) == "".join(t + "<|im_end|>" for t in turns)
    expected = [fake_logprob(int(t), i) for i, t in enumerate(traj.tokens) if traj.loss_mask[i]]
    assert traj.behavior_logprobs[traj.loss_mask == 1].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip_through_the_openai_sdk(any_tokenizer, stream):
    tokenizer, turns = any_tokenizer, thought(any_tokenizer, CALL, ANSWER)

    async def agent(task, client):
        first = await client.chat.completions.create(model="m", messages=USER, tools=[ADD], stream=stream)
        if stream:  # accumulate the deltas as SDK users do
            content, calls, finish = "", {}, None
            async for chunk in first:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for c in delta.tool_calls or []:
                    calls[c.index] = {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                finish = chunk.choices[0].finish_reason or finish
            message = {"role": "assistant", "content": content or None, "tool_calls": list(calls.values())}
        else:
            finish, message = first.choices[0].finish_reason, first.choices[0].message.model_dump(exclude_none=True)
        assert finish == "tool_calls" and message["content"] in ("", None)
        [call] = message["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert (call["function"]["name"], args) == ("add", {"a": 2, "b": 3})
        history = USER + [message, {"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])}]
        final = await client.chat.completions.create(model="m", messages=history, tools=[ADD])
        assert (final.choices[0].message.content, final.choices[0].finish_reason) == (ANSWER, "stop")
        return 1.0

    env = Agent(agent)
    env.reasoning = thinks(tokenizer)
    with scripted(tokenizer, turns) as engine:
        [[traj]] = play(tokenizer, engine.url, env, default_max_tokens=64)
    assert_scripted(traj, tokenizer, [ADD], turns)


def test_reasoning_comes_back_apart_and_an_agent_that_drops_it_still_stitches(any_tokenizer):
    tokenizer = any_tokenizer
    think = "<think>\nI should add 2 and 3.\n</think>\n\n"
    turns = thought(tokenizer, think + CALL, ANSWER)

    async def agent(task, client):
        first = await client.chat.completions.create(model="m", messages=USER, tools=[ADD], stream=task.data["stream"])
        if task.data["stream"]:
            chunks = [c async for c in first]
            reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
            [call] = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            call = {"id": call.id, "type": "function", "function": call.function.model_dump()}
        else:
            message = first.choices[0].message
            reasoning, call = message.reasoning_content, message.tool_calls[0].model_dump()
        assert reasoning == "I should add 2 and 3."
        echo = {"role": "assistant", "content": None, "tool_calls": [call]}  # the reasoning is not sent back
        final = await client.chat.completions.create(
            model="m", messages=USER + [echo, {"role": "tool", "tool_call_id": call["id"], "content": "5"}], tools=[ADD]
        )
        return 1.0 if final.choices[0].message.content == ANSWER else 0.0

    env = Agent(agent)
    env.reasoning = True  # a reasoning model's env (AgentEnv.reasoning)
    for stream in (False, True):
        with scripted(tokenizer, turns) as engine:
            [[traj]] = play(tokenizer, engine.url, env, Task("t", {"stream": stream}), default_max_tokens=128)
        assert traj.reward == 1.0
        assert_scripted(traj, tokenizer, [ADD], turns)


def test_the_openai_agents_sdk_runs_unchanged(any_tokenizer):
    tokenizer, turns = any_tokenizer, thought(any_tokenizer, CALL, ANSWER)
    from agents import Agent as SdkAgent
    from agents import OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    async def agent(task, client):
        calculator = SdkAgent(
            name="calc",
            instructions="Use the tools.",
            tools=[add],
            model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
        )
        config = RunConfig(tracing_disabled=True)
        if task.data.get("streamed"):
            result = Runner.run_streamed(calculator, "What is 2 + 3?", run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(calculator, "What is 2 + 3?", run_config=config)
        return 1.0 if result.final_output == ANSWER else 0.0

    env = Agent(agent)
    env.reasoning = thinks(tokenizer)
    with scripted(tokenizer, turns) as engine:
        runs = play(tokenizer, engine.url, env, n_episodes=2, default_max_tokens=64)  # two episodes at once
        streamed = play(tokenizer, engine.url, env, Task("t2", {"streamed": True}), default_max_tokens=64)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers.",
                "parameters": add.params_json_schema,
                "strict": True,
            },
        }
    ]
    for [traj] in runs + streamed:
        assert traj.reward == 1.0
        assert traj.metadata["messages"][0] == {"role": "system", "content": "Use the tools."}
        assert_scripted(traj, tokenizer, tools, turns)
    assert [runs[0][0].metadata["episode_id"], runs[1][0].metadata["episode_id"]] == ["ep-0", "ep-1"]


def test_langchain_chat_openai_runs_unchanged(tokenizer):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    async def agent(task, client):
        llm = ChatOpenAI(model="tiny", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        llm = llm.bind_tools([add])
        messages = [HumanMessage("What is 2 + 3?")]
        ai = await llm.ainvoke(messages)
        [call] = ai.tool_calls
        messages += [ai, ToolMessage(content=str(add.invoke(call["args"])), tool_call_id=call["id"])]
        return 1.0 if (await llm.ainvoke(messages)).content == ANSWER else 0.0

    with scripted(tokenizer) as engine:
        [traj] = trio.run(
            lambda: play_agent_episode(
                Agent(agent), TASK, tokenizer, lambda: EngineClient([engine.url]), default_max_tokens=48
            )
        )
    assert traj.reward == 1.0
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers.",
                "parameters": {
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "type": "object",
                },
            },
        }
    ]
    assert_scripted(traj, tokenizer, tools)


def test_a_turn_aborted_by_a_weight_update_is_continued_into_one_completion(any_tokenizer):
    tokenizer, turns = any_tokenizer, thought(any_tokenizer, ANSWER)

    async def agent(task, client):
        reply = await client.chat.completions.create(model="m", messages=USER)
        return 1.0 if reply.choices[0].message.content == ANSWER else 0.0

    env = Agent(agent)
    env.reasoning = thinks(tokenizer)
    with scripted(tokenizer, turns) as engine:
        engine.abort_plan = [3]  # the first request stops after 3 tokens, then the version goes 0 -> 1
        [[traj]] = play(tokenizer, engine.url, env)
        requests = list(engine.requests)
    assert traj.reward == 1.0
    assert (traj.metadata["num_aborts"], traj.metadata["num_generate_calls"]) == (1, 2)
    assert len(requests[1]["input_ids"]) == len(requests[0]["input_ids"]) + 3  # asked again with the partial output
    assert traj.weight_versions[traj.loss_mask == 1].tolist() == [0] * 3 + [1] * (int(traj.loss_mask.sum()) - 3)
    assert_scripted(traj, tokenizer, None, turns)


def test_only_calls_with_an_open_episodes_key_are_served(tokenizer):
    """The border: no key, a wrong key, another scheme, a finished episode's key: 401, nothing recorded."""
    seen: dict = {}

    async def agent(task, client):
        base = str(client.base_url).rstrip("/")  # .../episodes/<key>/v1
        root, key = base.split("/episodes/")[0], client.api_key
        seen.update(root=root, key=key)
        body = {"model": "m", "messages": USER}
        async with httpx.AsyncClient() as http:
            statuses = {
                "no key": await http.post(f"{root}/v1/chat/completions", json=body),
                "wrong key": await http.post(
                    f"{root}/v1/chat/completions", json=body, headers={"Authorization": "Bearer agentrl-ep-guess"}
                ),
                "basic": await http.post(
                    f"{root}/v1/chat/completions", json=body, headers={"Authorization": f"Basic {key}"}
                ),
                "wrong path key": await http.post(
                    f"{root}/episodes/agentrl-ep-guess/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ),
                "models without key": await http.get(f"{root}/v1/models"),
                "header key": await http.post(
                    f"{root}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                ),
                "path key, other api key": await http.post(
                    f"{base}/chat/completions", json=body, headers={"Authorization": "Bearer sk-from-env"}
                ),
                "models": await http.get(f"{base}/models"),
                "health": await http.get(f"{root}/health"),
            }
        seen["statuses"] = {k: r.status_code for k, r in statuses.items()}
        seen["refusal"] = statuses["no key"].json()
        return 1.0

    async def after():
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{seen['root']}/v1/chat/completions",
                json={"model": "m", "messages": USER},
                headers={"Authorization": f"Bearer {seen['key']}"},
            )
            return r.status_code

    with scripted(tokenizer, (ANSWER,)) as engine:

        async def main():
            async with AgentRunner(tokenizer, lambda: EngineClient([engine.url]), default_max_tokens=16) as runner:
                trajs = await runner.play(Agent(agent), TASK)
                return trajs, await after()

        trajs, status_after = trio.run(main)
    assert seen["statuses"] == {
        "no key": 401,
        "wrong key": 401,
        "basic": 401,
        "wrong path key": 401,
        "models without key": 401,
        "header key": 200,
        "path key, other api key": 200,
        "models": 200,
        "health": 200,
    }
    assert seen["refusal"]["error"]["code"] == "invalid_api_key" and seen["key"] not in json.dumps(seen["refusal"])
    assert status_after == 401  # the episode is over: its key no longer writes
    assert sum(t.metadata["num_calls"] for t in trajs) == 2 and trajs[0].metadata["episode_num_calls"] == 2


def test_unsupported_fields_are_400s_that_record_nothing(tokenizer):
    import openai

    async def agent(task, client):
        for kwargs, param in (
            ({"presence_penalty": 1.0}, "presence_penalty"),
            ({"tool_choice": "required", "tools": [ADD]}, "tool_choice"),
            ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=USER, **kwargs)
            assert info.value.param == param and param in info.value.message
        await client.chat.completions.create(model="m", messages=USER)
        return 1.0

    with scripted(tokenizer, (ANSWER,)) as engine:
        [[traj]] = play(tokenizer, engine.url, Agent(agent))
        assert len(engine.requests) == 1
    assert traj.metadata["episode_num_calls"] == 1


def test_agents_that_fail_fail_their_episode_not_the_process(tokenizer):
    async def raises(task, client):
        await client.chat.completions.create(model="m", messages=USER)
        raise ValueError("the agent's own bug")

    async def exits(task, client):
        raise SystemExit(3)

    async def silent(task, client):
        return 1.0

    async def fine(task, client):
        await client.chat.completions.create(model="m", messages=USER)
        return None  # scored by env.reward on the conversation

    def judge(messages):
        return 1.0 if messages[-1] == {"role": "assistant", "content": ANSWER} else 0.0

    with scripted(tokenizer, (ANSWER,)) as engine:

        async def main():
            async with AgentRunner(tokenizer, lambda: EngineClient([engine.url]), default_max_tokens=16) as runner:
                errors = []
                for run in (raises, exits, silent):
                    with pytest.raises(EpisodeFailed) as info:
                        await runner.play(Agent(run), TASK)
                    errors.append(str(info.value))
                ok = await runner.play(Agent(fine, judge), TASK)
                broken = await runner.play(Agent(fine, lambda m: 1 / 0), TASK)
                return errors, ok, broken

        errors, ok, broken = trio.run(main)
    assert "raised ValueError: the agent's own bug" in errors[0]
    assert "raised SystemExit: 3" in errors[1]
    assert "returned without a completed call" in errors[2]
    assert ok[0].reward == 1.0 and "reward_error" not in ok[0].metadata
    assert broken[0].reward == 0.0 and "ZeroDivisionError" in broken[0].metadata["reward_error"]


def test_cancelling_an_episode_cancels_the_agent_and_the_engine_request(tokenizer):
    class HangingEngine(ScriptedEngine):
        """/generate never answers; it records the arrival and the client's disconnect."""

        def __init__(self):
            super().__init__(lambda ids, params: None)
            self.arrived, self.disconnected = threading.Event(), threading.Event()

        async def _app(self, scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/generate":
                return await super()._app(scope, receive, send)
            self.arrived.set()
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

    state = {"cancelled": False, "cleaned": False}

    class Hangs(AgentEnv):
        async def run(self, task, client):
            try:
                await client.chat.completions.create(model="m", messages=USER)
            except asyncio.CancelledError:
                state["cancelled"] = True
                raise

        async def cleanup(self, task, s):
            state["cleaned"] = True

    with HangingEngine() as engine:

        async def main():
            async with AgentRunner(tokenizer, lambda: EngineClient([engine.url]), default_max_tokens=16) as runner:
                with trio.move_on_after(60) as scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(runner.play, Hangs(), TASK)
                        await trio.to_thread.run_sync(engine.arrived.wait, 30)
                        nursery.cancel_scope.cancel()
                assert not scope.cancelled_caught
                return await trio.to_thread.run_sync(engine.disconnected.wait, 30), len(runner.endpoint._episodes)

        disconnected, still_open = trio.run(main)
    assert state == {"cancelled": True, "cleaned": True}
    assert disconnected and still_open == 0


def test_forced_sampling_replaces_the_agents_temperature(tokenizer):
    async def agent(task, client):
        await client.chat.completions.create(model="m", messages=USER, temperature=0.2, top_p=0.5, seed=4)
        return 1.0

    with scripted(tokenizer, (ANSWER,)) as engine:
        play(tokenizer, engine.url, Agent(agent), forced_sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
        [request] = engine.requests
    params = request["sampling_params"]
    assert (params["temperature"], params["top_p"], params["top_k"], params["sampling_seed"]) == (1.0, 1.0, -1, 4)
    assert np.isclose(params["max_new_tokens"], 48)


def test_a_completion_ends_at_the_context_and_a_full_context_is_refused(tokenizer, codec):
    import openai

    prompt = len(template_ids(tokenizer, USER))
    context = prompt + 1 + codec.reserve_tokens + 5  # room for 5 tokens

    async def agent(task, client):
        reply = await client.chat.completions.create(model="m", messages=USER, max_tokens=40)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
        long = [{"role": "user", "content": "What is 2 + 3? " * 20}]
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=long)
        assert info.value.code == "context_length_exceeded"
        return 1.0

    with scripted(tokenizer, ("1 2 3 4 5 6 7 8 9" + TurnScript.NO_STOP,)) as engine:
        [[traj]] = play(tokenizer, engine.url, Agent(agent), max_model_len=context)
        assert engine.requests[0]["sampling_params"]["max_new_tokens"] == 5
    assert int(traj.loss_mask.sum()) == 5 and len(traj.tokens) <= context  # closed within the context
    assert_template(traj, tokenizer)


def test_a_failed_episode_loses_its_group_and_cancels_the_others(tokenizer):
    started, cancelled = [], []

    async def agent(task, client):
        started.append(1)
        if len(started) == 3:
            raise RuntimeError("episode 3 breaks")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(1)
            raise

    with scripted(tokenizer, (ANSWER,)) as engine:
        with pytest.raises(GroupLost, match="episode 3 breaks"):
            play(tokenizer, engine.url, Agent(agent), n_episodes=3)
    assert len(cancelled) == 2


def test_an_episode_ends_at_the_envs_limits_and_is_scored_as_played(tokenizer, codec):
    """max_turns bounds the calls of an episode, max_total_tokens each sequence: the call past a limit is a
    400, and an agent that raises on it has not failed -- its episode is scored by env.reward."""
    from agentrl.episode.turn import EpisodeLimits

    async def loop_forever(task, client):  # an agent that never stops calling the tool
        messages = list(USER)
        while True:
            reply = await client.chat.completions.create(model="m", messages=messages, tools=[ADD])
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages += [message] + [
                {"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in message.get("tool_calls", [])
            ]

    with scripted(tokenizer, (CALL,)) as engine:
        [[traj]] = play(
            tokenizer,
            engine.url,
            Agent(loop_forever, reward=lambda messages: 0.25),
            limits=EpisodeLimits(max_turns=3, max_total_tokens=1024),
        )
        assert len(engine.requests) == 3
    assert traj.metadata["num_calls"] == 3 and traj.metadata["episode_limit"] == "max_turns"
    assert traj.reward == 0.25 and "reward_error" not in traj.metadata

    class NoReward(AgentEnv):  # its reward comes from run(); at a limit it scores 0, without a reward error
        async def run(self, task, client):
            return await loop_forever(task, client)

    prompt = len(codec.prompt(USER, [ADD])[0])
    with scripted(tokenizer, (CALL,)) as engine:
        [[traj]] = play(
            tokenizer, engine.url, NoReward(), limits=EpisodeLimits(max_turns=10, max_total_tokens=prompt + 30)
        )
        asked = [r["sampling_params"]["max_new_tokens"] for r in engine.requests]
    assert traj.metadata["episode_limit"] == "context_full" and traj.reward == 0.0
    assert "reward_error" not in traj.metadata and len(traj.tokens) <= prompt + 30
    assert asked[0] <= 30 - 1 - codec.reserve_tokens  # a completion never runs past the episode's limit

    async def raises(task, client):  # a failure that is not a limit still fails the episode
        await client.chat.completions.create(model="m", messages=USER)
        raise RuntimeError("the agent's own bug")

    with scripted(tokenizer, (ANSWER,)) as engine:
        with pytest.raises(GroupLost, match="the agent's own bug"):
            play(tokenizer, engine.url, Agent(raises), limits=EpisodeLimits(max_turns=3))


def test_a_reward_beyond_max_abs_reward_scores_zero_with_the_error(tokenizer):
    from agentrl.episode.turn import EpisodeLimits

    async def agent(task, client):
        await client.chat.completions.create(model="m", messages=USER)
        return {"correct": 1.0, "bonus": 1e9}

    with scripted(tokenizer, (ANSWER,)) as engine:
        [[traj]] = play(tokenizer, engine.url, Agent(agent), limits=EpisodeLimits(max_abs_reward=100.0))
    assert traj.reward == 0.0 and "max_abs_reward=100" in traj.metadata["reward_error"]
