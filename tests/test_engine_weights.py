"""WeightUpdater (trainer side) against two real embedded engine processes: gloo group on loopback.

It changes the shared engines' weights and restores the original ones (version "0") at the end.
"""

from __future__ import annotations

import httpx
import pytest
import torch
import trio

from agentrl.engine.client import EngineClient, GenerateResult
from agentrl.learner.weight_push import WeightUpdateError, WeightUpdater
from tests.conftest_engine import Teacher, max_abs_diff

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def urls(engine_urls) -> list[str]:
    return engine_urls


def _perturbed(model_path, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


async def _generating(urls: list[str], timeout_s: float = 60.0) -> None:
    """Until an engine runs requests and has generated tokens since this was called (the engines are shared:
    their counters hold earlier tests' tokens)."""
    async with httpx.AsyncClient(timeout=10) as http:
        before = [(await http.get(u + "/server_info")).json()["num_generated_tokens"] for u in urls]
        with trio.fail_after(timeout_s):
            while True:
                infos = [(await http.get(u + "/server_info")).json() for u in urls]
                if any(i["num_running"] > 0 and i["num_generated_tokens"] > b for i, b in zip(infos, before)):
                    return
                await trio.sleep(0.02)


def _greedy(url: str, prompt: list[int]) -> dict:
    return httpx.post(
        url + "/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": GREEDY}, timeout=60
    ).json()


@pytest.fixture(scope="module")
def updater(urls, engine_model):
    u = WeightUpdater(urls, backend="gloo", bucket_bytes=1 << 20)  # small buckets: several HTTP + broadcast rounds
    u.connect()
    yield u
    u.push_from_disk(str(engine_model), 0)  # leave the shared engines as the other tests expect them
    u.close()


def test_weight_push_reaches_both_engines_with_no_request_lost(urls, updater, engine_model):
    new = _perturbed(engine_model, seed=1)
    teacher_new, teacher_old = Teacher(new), Teacher(engine_model)
    results: list[GenerateResult] = []
    errors: list[BaseException] = []

    async def main():
        async with EngineClient(urls, health_check_interval_s=0.5) as client:

            async def call(i):
                try:
                    results.append(await client.generate([10, i % 50], {"max_new_tokens": 40 + i, "ignore_eos": True}))
                except BaseException as e:  # collected: the assertion below names them
                    errors.append(e)
                    raise

            async with trio.open_nursery() as n:
                for i in range(24):
                    n.start_soon(call, i)
                await _generating(urls)  # the push comes mid-generation
                timings = await trio.to_thread.run_sync(updater.push, list(new.named_parameters()), 1)
                for i in range(24, 32):  # calls after the update
                    n.start_soon(call, i)
            return timings

    timings = trio.run(main)
    assert not errors and len(results) == 32
    assert {r.finish_reason["type"] for r in results} <= {"length", "abort"}
    assert timings["num_buckets"] > 1 and timings["bytes"] > 0
    for r in results:
        if r.finish_reason.get("type") == "abort":
            assert r.weight_version == "0" and len(r.output_logprobs) == len(r.output_ids)
    assert sum(r.weight_version == "1" for r in results) >= 8
    prompt = [11, 12, 13]
    for url in urls:
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "1"
        body = _greedy(url, prompt)
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        assert body["output_ids"] == teacher_new.greedy(prompt, 8)
        assert max_abs_diff(lps, teacher_new.logprobs(prompt, body["output_ids"])) <= 1e-4
        assert max_abs_diff(lps, teacher_old.logprobs(prompt, body["output_ids"])) > 1e-2


def test_push_from_disk(urls, updater, engine_model, tmp_path):
    new = _perturbed(engine_model, seed=2)
    new.save_pretrained(tmp_path / "ckpt")
    updater.push_from_disk(str(tmp_path / "ckpt"), 2)
    teacher = Teacher(new)
    for url in urls:
        body = _greedy(url, [20, 21])
        assert body["meta_info"]["weight_version"] == "2"
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        assert max_abs_diff(lps, teacher.logprobs([20, 21], body["output_ids"])) <= 1e-4


def test_a_bad_tensor_name_is_reported_and_nothing_hangs(urls, updater):
    with pytest.raises(WeightUpdateError, match="unknown parameter 'model.no_such_weight'"):
        updater.push([("model.no_such_weight", torch.zeros(3, 4))], version=9)
    for url in urls:
        info = httpx.get(url + "/server_info", timeout=10).json()
        # a refused update leaves no policy's number (its weights may hold part of it): the learner pushes again
        assert info["weight_version"] == "default" and not info["paused"] and not info["updating_weights"]
        assert _greedy(url, [1, 2])["meta_info"]["finish_reason"]["type"] == "length"


def test_flattened_bucket_format_updates_the_engines(urls, updater, engine_model):
    new = _perturbed(engine_model, seed=3)
    norm = "model.layers.0.input_layernorm.weight"
    with torch.no_grad():  # make it exactly representable in bf16, then send it as bf16: a dtype change
        new.get_parameter(norm).copy_(new.get_parameter(norm).to(torch.bfloat16))
    named = [(n, p.to(torch.bfloat16) if n == norm else p) for n, p in new.named_parameters()]
    with WeightUpdater(urls, group_name="flat", load_format="flattened_bucket", bucket_bytes=1 << 20) as flat:
        timings = flat.push(named, version=3)
    assert timings["num_buckets"] >= 3
    teacher = Teacher(new)
    for url in urls:
        body = _greedy(url, [30, 31])
        assert body["meta_info"]["weight_version"] == "3"
        lps = [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
        assert max_abs_diff(lps, teacher.logprobs([30, 31], body["output_ids"])) <= 1e-4
