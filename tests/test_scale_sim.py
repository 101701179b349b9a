"""bench/_sim_engine.py, the simulated engines of bench/scale.py: the latency model, the replies, and that what
it answers over HTTP is what agentrl's engine client and turn accept (the real ``GenerateResult`` and
``unpack_result``), including an abort on a pause."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from agentrl.engine.client import GenerateResult
from agentrl.episode.turn import unpack_result
from bench._sim_engine import LatencyModel, SimEngine, SimFleet, Vocabulary, cache_keys, plan_reply

pytestmark = pytest.mark.timeout(60)

VOCAB = Vocabulary(filler=[10, 11, 12], tool_call=[20, 21, 22], end_of_turn=2)


def test_request_time_counts_uncached_prompt_and_a_step_per_token_that_grows_with_the_batch():
    model = LatencyModel(prefill_s_per_token=0.001, decode_s_per_step=0.01, decode_s_per_seq=0.002)
    assert model.request_s(100, 10, 0) == pytest.approx(0.1 + 10 * 0.01)
    assert model.request_s(0, 10, 5) == pytest.approx(10 * (0.01 + 5 * 0.002))


def test_replies_end_a_turn_with_a_tool_call_or_the_end_of_turn_id_and_respect_max_new_tokens():
    rng = random.Random(0)
    tools = LatencyModel(out_tokens=8, tool_rate=1.0)
    ids, finish = plan_reply(rng, VOCAB, tools, max_new=64)
    assert ids[-4:] == [20, 21, 22, 2] and finish == {"type": "stop", "matched": 2}
    assert set(ids[:-4]) <= set(VOCAB.filler)
    text = LatencyModel(out_tokens=8, tool_rate=0.0)
    ids, finish = plan_reply(rng, VOCAB, text, max_new=64)
    assert ids[-1] == 2 and 20 not in ids and finish["type"] == "stop"
    ids, finish = plan_reply(rng, VOCAB, LatencyModel(out_tokens=100), max_new=5)
    assert len(ids) == 5 and finish == {"type": "length", "length": 5}


def test_cache_keys_read_agentrls_request_ids():
    assert cache_keys("ab12cd-3-1-0#0123456789abcdef") == ("ab12cd-3", "ab12cd")
    assert cache_keys("no-dashes") == ("", "")


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await client.post(url, json=body)
    assert r.status_code == 200
    return r.json()


def test_sim_engine_answers_what_the_client_and_the_turn_accept_and_aborts_on_a_pause():
    async def main() -> tuple:
        model = LatencyModel(decode_s_per_step=0.0, out_tokens=6, tool_rate=0.0)
        engine = SimEngine(0, model, VOCAB)
        slow = SimEngine(1, LatencyModel(decode_s_per_step=30.0, out_tokens=6, tool_rate=0.0), VOCAB)
        fleet = SimFleet([engine, slow])
        servers = [
            await asyncio.start_server(lambda r, w, e=e: fleet.serve_connection(e, r, w), "127.0.0.1", 0)
            for e in (engine, slow)
        ]
        fast_url, slow_url = (f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
        async with httpx.AsyncClient() as client:
            done = await _post(client, fast_url + "/generate", {**body, "rid": "g-0-0-0#00"})
            info = await _post(client, fast_url + "/model_info", {})
            waiting = asyncio.create_task(_post(client, slow_url + "/generate", body))
            while not slow.running:  # admitted: it would take 30 s per token
                await asyncio.sleep(0)
            await _post(client, slow_url + "/pause_generation", {"mode": "abort"})
            aborted = await waiting
            await _post(client, slow_url + "/update_weight_version", {"new_version": "3"})
            await _post(client, slow_url + "/continue_generation", {})
            after = await _post(client, slow_url + "/model_info", {})
        for server in servers:
            server.close()
        return done, info, aborted, after, fleet.stats()

    done, info, aborted, after, stats = asyncio.run(main())
    ids, logprobs, versions, kind = unpack_result(GenerateResult.from_response(done, "sim"))
    assert kind == "stop" and ids[-1] == 2 and len(logprobs) == len(ids) and versions == [0] * len(ids)
    assert info["weight_version"] == "0"
    result = GenerateResult.from_response(aborted, "sim")
    assert result.finish_reason["type"] == "abort" and len(result.output_ids) < 6
    assert after["weight_version"] == "3"
    assert [e["requests"] for e in stats["engines"]] == [1, 1] and stats["engines"][1]["aborted"] == 1
