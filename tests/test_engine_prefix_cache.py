"""The prefix cache of a real engine process (context 512): batching a continuation with fresh
prompts, ``cached_tokens``, and what a weight update does to cached K/V (``flush_cache``)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from tests.conftest_engine import ENGINE_FLAGS, Teacher, max_abs_diff, start_engines

FLAGS = [*ENGINE_FLAGS, "--max-context-tokens", "512"]  # the later flag wins
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(engine_model, tmp_path_factory):
    (proc,) = start_engines(engine_model, 1, tmp_path_factory.mktemp("prefix_logs"), flags=FLAGS)
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def new_weights(engine_model, tmp_path_factory):
    """A perturbed copy of the model, saved as a checkpoint folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    path = tmp_path_factory.mktemp("new_weights")
    model.save_pretrained(path)
    return path, model.eval()


def generate(url: str, body: dict) -> dict | list:
    r = httpx.post(url + "/generate", json={"return_logprob": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(answer: dict) -> list[float]:
    return [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def update_from_disk(url: str, path, version: str, **fields) -> httpx.Response:
    return httpx.post(
        url + "/update_weights_from_disk",
        timeout=120,
        json={"model_path": str(path), "weight_version": version, **fields},
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


async def _generate_as_one_prefill(url: str, body: dict) -> list[dict]:
    """Hold the engine so that every prompt of ``body`` waits, then release them together:
    they are admitted into one prefill batch."""
    async with httpx.AsyncClient(timeout=120) as http:
        await http.post(url + "/pause_generation", json={"mode": "abort"})
        call = asyncio.ensure_future(http.post(url + "/generate", json=body))
        for _ in range(500):
            if (await http.get(url + "/server_info")).json()["num_waiting"] == len(body["input_ids"]):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the prompts never reached the waiting queue")
        await http.post(url + "/continue_generation", json={})
        answer = await call
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_continuation_batched_with_fresh_prompts_fits_the_context(url, engine_teacher):
    """Issue 12.1: a ~405-token continuation whose first ~400 tokens are cached, admitted together
    with 200-token fresh prompts, used to size the batch's K/V as (longest cached part + longest
    new part) = 602 > 512 and abort every request with an internal engine error."""
    first = tokens(1, 395)
    a = generate(url, {"input_ids": first, "sampling_params": GREEDY})
    follow = first + a["output_ids"] + tokens(2, 4)  # 405 tokens; the first 400 fed ones are cached
    fresh = [tokens(10 + i, 200) for i in range(3)]
    answers = asyncio.run(
        _generate_as_one_prefill(
            url, {"input_ids": [follow, *fresh], "return_logprob": True, "sampling_params": GREEDY}
        )
    )
    for prompt, ans in zip([follow, *fresh], answers):
        assert ans["meta_info"]["finish_reason"] == {"type": "length", "length": 6}, ans["meta_info"]["finish_reason"]
        assert max_abs_diff(logprobs(ans), engine_teacher.logprobs(prompt, ans["output_ids"])) <= 1e-4
    assert answers[0]["meta_info"]["cached_tokens"] == len(first) + len(a["output_ids"]) - 1
    assert [ans["meta_info"]["cached_tokens"] for ans in answers[1:]] == [0, 0, 0]


def _stale_teacher(old_model, new_model, prefix: list[int], rest: list[int], output: list[int]) -> list[float]:
    """Logprobs of ``output`` when the K/V of ``prefix`` come from the old weights and everything
    after it is computed with the new ones: what an engine that kept its cache computes."""
    with torch.no_grad():
        cache = old_model(torch.tensor([prefix]), use_cache=True).cache
        logits = new_model(torch.tensor([rest + output]), cache=cache, use_cache=True).logits[0].float()
    lp = torch.log_softmax(logits[len(rest) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("flush", [False, True])
def test_cached_kv_survives_a_weight_update_only_without_flush(url, engine_model, engine_teacher, new_weights, flush):
    new_path, new_model = new_weights
    prompt = tokens(20 + flush, 60)
    first = generate(url, {"input_ids": prompt, "sampling_params": GREEDY})
    cached = prompt + first["output_ids"][:-1]  # what the finished request left in the cache
    fields = {} if flush else {"flush_cache": False}  # SGLang's default is to flush
    r = update_from_disk(url, new_path, "1", **fields)
    try:
        assert r.status_code == 200 and r.json()["success"], r.text
        follow = prompt + first["output_ids"] + tokens(30, 5)
        nxt = generate(url, {"input_ids": follow, "sampling_params": GREEDY})
        fresh = Teacher(new_model).logprobs(follow, nxt["output_ids"])
        if flush:
            assert nxt["meta_info"]["cached_tokens"] == 0
            assert max_abs_diff(logprobs(nxt), fresh) <= 1e-4
        else:  # the old weights' K/V of the cached prefix were used: not what the new weights compute
            assert nxt["meta_info"]["cached_tokens"] == len(cached)
            assert max_abs_diff(logprobs(nxt), fresh) > 1e-3
            stale = _stale_teacher(engine_teacher.model, new_model, cached, follow[len(cached) :], nxt["output_ids"])
            assert max_abs_diff(logprobs(nxt), stale) <= 1e-4
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200  # and /flush_cache drops them
            again = generate(url, {"input_ids": follow, "sampling_params": GREEDY})
            assert again["meta_info"]["cached_tokens"] == 0
            assert max_abs_diff(logprobs(again), Teacher(new_model).logprobs(follow, again["output_ids"])) <= 1e-4
    finally:
        restored = update_from_disk(url, engine_model, "0")  # flushes: the next test starts clean
        assert restored.status_code == 200, restored.text
