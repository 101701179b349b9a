"""One model turn (agentrl/episode/turn.py) against a scripted in-process engine, on both event loops
that run it: trio (the actors' loop, with the actors' options) and asyncio (the agent endpoint, with
the endpoint's). Aborted parts are continued, "default" versions waited for, request ids kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from agentrl.episode.chat import TokenChat, codec_for
from agentrl.episode.turn import EpisodeFailed, TurnOptions, generate_turn
from tests._actors_helpers import load_tokenizer, tiny_tokenizer_dir

START = [{"role": "user", "content": "What is 2 + 3?"}]
URL = "http://engine:1"
ACTOR = TurnOptions(max_empty_aborts=2, max_version_wait_s=30.0)  # as rollout._Episode builds them
ENDPOINT = TurnOptions(versioned=False, max_empty_aborts=2, wrap_engine_errors=False)  # as ChatService does


@dataclass
class Reply:
    output_ids: list[int]
    finish_reason: dict
    weight_version: str = "1"
    output_logprobs: list[float] = field(default_factory=list)
    meta_info: dict = field(default_factory=dict)
    url: str = URL

    def __post_init__(self) -> None:
        self.output_logprobs = self.output_logprobs or [-0.5] * len(self.output_ids)


class ScriptedClient:
    """Answers each /generate with the next scripted reply (an exception is raised instead)."""

    def __init__(self, replies: list[Reply | Exception]):
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    async def generate(self, input_ids, sampling_params, *, affinity_key=None, rid=None, return_logprob=True):
        self.requests.append({"n": len(input_ids), "params": dict(sampling_params), "rid": rid, "key": affinity_key})
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class EngineDown(Exception):
    pass


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    codec = codec_for(load_tokenizer(tiny_tokenizer_dir(tmp_path_factory)))
    assert codec.end_of_turn_id is not None
    return codec


def play(backend: str, client: ScriptedClient, chat: TokenChat, budget: int | None, options: TurnOptions):
    async def main():
        with anyio.fail_after(30):
            return await generate_turn(
                client, chat, {"temperature": 1.0}, budget, affinity_key="ep", rid_prefix="ep-0", options=options
            )

    return anyio.run(main, backend=backend)


ABORT = {"type": "abort", "message": "weights updated"}
STOP = {"type": "stop", "matched": 7}


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_aborted_parts_are_continued_into_one_turn(codec, backend):
    chat = TokenChat.start(codec, START, None)
    prompt = len(chat)
    client = ScriptedClient(
        [Reply([5, 6, 7], ABORT, "1"), Reply([], ABORT, "1"), Reply([8, 9], STOP, "2", meta_info={"x": 1})]
    )
    turn = play(backend, client, chat, 10, ACTOR)
    assert (turn.kind, turn.finish, turn.weight_version) == ("stop", STOP, "2")
    assert (turn.num_generate_calls, turn.num_aborts, turn.abort_message) == (3, 2, "weights updated")
    assert chat.tokens[prompt:] == [5, 6, 7, 8, 9] and list(chat.versions[prompt:]) == [1, 1, 1, 2, 2]
    assert [r["rid"] for r in client.requests] == ["ep-0-0", "ep-0-1", "ep-0-2"]
    assert [r["params"]["max_new_tokens"] for r in client.requests] == [10, 7, 7]  # what is still allowed
    assert [r["n"] for r in client.requests] == [prompt, prompt + 3, prompt + 3]  # the prompt extended by them
    assert {r["key"] for r in client.requests} == {"ep"}


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_abort_that_ends_the_turn_or_the_budget_finishes_it(codec, backend):
    eot = codec.end_of_turn_id
    chat = TokenChat.start(codec, START, None)
    turn = play(backend, ScriptedClient([Reply([5, eot], ABORT)]), chat, None, ENDPOINT)
    assert (turn.kind, turn.finish, turn.num_aborts) == ("stop", {"type": "stop", "matched": eot}, 1)
    chat = TokenChat.start(codec, START, None)
    turn = play(backend, ScriptedClient([Reply([5, 6], ABORT), Reply([7], ABORT)]), chat, 3, ACTOR)
    assert (turn.kind, turn.finish, turn.num_aborts) == ("length", {"type": "length", "length": 3}, 2)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_empty_aborts_in_a_row_end_with_the_engines_abort(codec, backend):
    chat = TokenChat.start(codec, START, None)
    client = ScriptedClient([Reply([5], ABORT)] + [Reply([], ABORT) for _ in range(3)])
    turn = play(backend, client, chat, 10, ACTOR)
    assert (turn.kind, turn.finish, turn.num_aborts, turn.num_generate_calls) == ("abort", ABORT, 4, 4)
    chat = TokenChat.start(codec, START, None)  # the engine host: an abort is answered at once, as SGLang does
    turn = play(backend, ScriptedClient([Reply([5], ABORT)]), chat, 10, TurnOptions(continue_aborts=False))
    assert (turn.kind, turn.finish, turn.num_aborts) == ("abort", ABORT, 0)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_default_version_is_waited_for_and_its_reply_dropped(codec, backend):
    chat = TokenChat.start(codec, START, None)
    prompt = len(chat)
    waits: list[str] = []
    options = TurnOptions(max_version_wait_s=30.0, on_version_wait=waits.append)
    client = ScriptedClient([Reply([1, 2], STOP, "default"), Reply([5, 6], STOP, "3")])
    turn = play(backend, client, chat, 10, options)
    assert waits == [URL] and chat.tokens[prompt:] == [5, 6] and list(chat.versions[prompt:]) == [3, 3]
    assert turn.num_generate_calls == 2 and [r["rid"] for r in client.requests] == ["ep-0-0", "ep-0-1"]
    with pytest.raises(EpisodeFailed, match=r"still reports weight_version 'default'.*--weight-version 0"):
        play(backend, ScriptedClient([Reply([1], STOP, "default")]), chat, 10, TurnOptions(max_version_wait_s=0.0))
    turn = play(backend, ScriptedClient([Reply([1], STOP, "default")]), chat, 10, ENDPOINT)  # unversioned: taken
    assert turn.kind == "stop" and chat.versions[-1] == -1


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_engine_errors_fail_the_episode_or_propagate(codec, backend):
    chat = TokenChat.start(codec, START, None)
    with pytest.raises(EpisodeFailed, match="generate failed: EngineDown: gone"):
        play(backend, ScriptedClient([EngineDown("gone")]), chat, 10, ACTOR)
    with pytest.raises(EngineDown):  # the endpoint answers it itself (a refusal is the client's 400)
        play(backend, ScriptedClient([EngineDown("gone")]), chat, 10, ENDPOINT)
    with pytest.raises(EpisodeFailed, match="engine returned 3 tokens, 2 were asked for"):
        play(backend, ScriptedClient([Reply([1, 2, 3], STOP)]), chat, 2, ENDPOINT)
    with pytest.raises(EpisodeFailed, match="unknown finish_reason"):
        play(backend, ScriptedClient([Reply([1], {"type": "eos"})]), chat, 2, ENDPOINT)
