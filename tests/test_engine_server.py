"""The embedded engine as a real server process on loopback, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.conftest_engine import max_abs_diff


@pytest.fixture(scope="module")
def url(engine_urls) -> str:
    return engine_urls[0]  # started through `agentrl serve-engine`


@pytest.fixture(scope="module")
def teacher(engine_teacher):
    return engine_teacher


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=60, **kw)


def load(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def test_64_concurrent_ragged_requests(url, teacher):
    rng = random.Random(0)
    reqs = [([rng.randrange(3, 518) for _ in range(rng.randint(1, 64))], rng.randint(1, 32)) for _ in range(64)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *[
                    http.post(
                        url + "/generate",
                        json={
                            "input_ids": p,
                            "return_logprob": True,
                            "rid": f"c{i}",
                            "sampling_params": {"max_new_tokens": n, "temperature": 0.9, "ignore_eos": True},
                        },
                    )
                    for i, (p, n) in enumerate(reqs)
                ]
            )

    answers = asyncio.run(run())
    assert all(a.status_code == 200 for a in answers)
    worst = 0.0
    for i, ((p, n), a) in enumerate(zip(reqs, answers)):
        body = a.json()
        meta = body["meta_info"]
        assert meta["id"] == f"c{i}" and meta["prompt_tokens"] == len(p)
        assert meta["finish_reason"] == {"type": "length", "length": n} and meta["completion_tokens"] == n
        assert [t for _, t, _ in meta["output_token_logprobs"]] == body["output_ids"]
        assert meta["weight_version"] == "0" and meta["e2e_latency"] > 0
        if i % 8 == 0:  # spot-check against one teacher-forced forward
            lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
            worst = max(worst, max_abs_diff(lps, teacher.logprobs(p, body["output_ids"], 0.9)))
    assert worst <= 1e-4
    assert load(url)["num_running"] == 0


def test_stop_token_ids_and_stop_strings_over_http(url, engine_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_model)
    prompt = [40, 41, 42, 43]
    seeded = {"max_new_tokens": 30, "sampling_seed": 7}  # the same tokens on every call
    ref = post(url, "/generate", {"input_ids": prompt, "sampling_params": {**seeded, "ignore_eos": True}}).json()[
        "output_ids"
    ]
    k = next(i for i in range(2, 29) if ref[i] not in ref[:i])
    body = post(
        url,
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {**seeded, "stop_token_ids": [ref[k]], "skip_special_tokens": False},
        },
    ).json()
    assert body["output_ids"] == ref[: k + 1]  # the stop token is in output_ids ...
    assert len(body["meta_info"]["output_token_logprobs"]) == k + 1  # ... with its logprob
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[k]}
    assert body["text"] == tok.decode(ref[:k])  # ... and trimmed from the text
    kept = post(
        url,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {
                **seeded,
                "stop_token_ids": [ref[k]],
                "no_stop_trim": True,
                "skip_special_tokens": False,
            },
        },
    ).json()
    assert kept["text"] == tok.decode(ref[: k + 1])

    text = tok.decode(ref)
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].isalnum())
    body = post(url, "/generate", {"input_ids": prompt, "sampling_params": {**seeded, "stop": stop}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in body["text"] and tok.decode(body["output_ids"]).startswith(body["text"])
    assert stop in tok.decode(body["output_ids"])


def test_batch_input_and_streaming(url):
    body = post(
        url,
        "/generate",
        {"input_ids": [[5, 6], [7, 8, 9]], "rid": "b", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
    ).json()
    assert isinstance(body, list) and [b["meta_info"]["id"] for b in body] == ["b_0", "b_1"]
    assert all(b["meta_info"]["completion_tokens"] == 4 for b in body)
    texts = post(
        url,
        "/generate",
        {
            "input_ids": [5, 6],
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        },
    ).json()
    assert all(isinstance(t, str) for _, _, t in texts["meta_info"]["output_token_logprobs"])

    with httpx.stream(
        "POST",
        url + "/generate",
        json={
            "input_ids": [5, 6, 7],
            "stream": True,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        },
        timeout=60,
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5]  # cumulative, like SGLang
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["output_ids"][:4] == events[-2]["output_ids"]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}}, "temprature"),
        ({"input_ids": [], "sampling_params": {}}, "input_ids is empty"),
        ({"input_ids": [1] * 1024, "sampling_params": {"max_new_tokens": 1}}, "longer than the model's context length"),
        (
            {"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}},
            "exceeds the model's maximum context length",
        ),
        ({"input_ids": [1, 99999]}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"text": "hi", "input_ids": [1]}, "exactly one"),
    ],
)
def test_bad_requests_are_400_with_a_message_and_the_server_stays_up(url, body, needle):
    r = post(url, "/generate", body)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_invalid_json_and_recovery(url):
    r = httpx.post(url + "/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    ok = post(url, "/generate", {"text": "The answer is", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/pause_generation", {"mode": "bogus"}, "mode = 'bogus' is not supported"),
        ("/update_weight_version", {"new_version": 5}, "new_version must be a string, got 5"),
        (
            "/init_weights_update_group",
            {"master_port": 1, "rank_offset": 1, "world_size": 2},
            "'master_address' is required",
        ),
        ("/abort_request", b"{not json", "not valid JSON"),
    ],
)
def test_refused_control_bodies_are_sglangs_400(url, path, body, needle):
    """A control body the route's struct refuses is SGLang's ErrorResponse (HTTP 400); nothing is done."""
    r = httpx.post(url + path, content=body, timeout=10) if isinstance(body, bytes) else post(url, path, body)
    assert r.status_code == 400, r.text
    answer = r.json()
    assert (answer["object"], answer["type"], answer["code"]) == ("error", "Bad Request", 400)
    assert needle in answer["message"], answer
    assert post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def _start_long(http: httpx.AsyncClient, url: str, rid: str, n: int = 1000):
    return asyncio.ensure_future(
        http.post(
            url + "/generate",
            json={
                "input_ids": [3, 4, 5],
                "rid": rid,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
            },
        )
    )


async def _until_running(url: str, n: int = 1, timeout_s: float = 30.0) -> None:
    """Until ``n`` requests run and the engine has generated tokens since this was called (the engine is
    shared by the module: its counter already holds the earlier tests' tokens)."""
    async with httpx.AsyncClient(timeout=10) as http:
        before = (await http.get(url + "/server_info")).json()["num_generated_tokens"]
        async with asyncio.timeout(timeout_s):
            while True:
                info = (await http.get(url + "/server_info")).json()
                if info["num_running"] >= n and info["num_generated_tokens"] > before:
                    return
                await asyncio.sleep(0.02)


async def _scheduler_turns(http: httpx.AsyncClient, url: str, n: int = 3) -> None:
    """Return once the engine's scheduler thread has gone around its loop (and past its "step or wait"
    decision) about ``n`` times: each /abort_request runs in that thread between steps, and the next is only
    sent once it has answered. The rid is no request's, so nothing is aborted."""
    for _ in range(n):
        r = await http.post(url + "/abort_request", json={"rid": "no-such-request-barrier"})
        assert r.status_code == 200


def test_abort_request_returns_partial_output(url):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            task = _start_long(http, url, "to-abort")
            await _until_running(url)
            assert (await http.post(url + "/abort_request", json={"rid": "to-abort"})).status_code == 200
            return (await task).json()

    body = asyncio.run(run())
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 1000
    assert len(meta["output_token_logprobs"]) == len(body["output_ids"]) == meta["completion_tokens"]


def test_pause_abort_mid_generation_then_new_requests_wait_for_continue(url):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            task = _start_long(http, url, "paused")
            await _until_running(url)
            r = await http.post(url + "/pause_generation", json={"mode": "abort"})
            assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
            partial = (await task).json()
            waiting = asyncio.ensure_future(
                http.post(
                    url + "/generate",
                    json={"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
                )
            )
            async with asyncio.timeout(30):  # it reached the engine's queue ...
                while (await http.get(url + "/server_info")).json()["num_waiting"] < 1:
                    await asyncio.sleep(0.02)
            await _scheduler_turns(http, url)  # ... where the scheduler saw it and left it
            assert not waiting.done(), "a request ran while the engine was paused"
            assert (await http.get(url + "/server_info")).json()["num_running"] == 0
            assert (await http.post(url + "/continue_generation")).json()["status"] == "ok"
            return partial, (await waiting).json()

    partial, later = asyncio.run(run())
    assert partial["meta_info"]["finish_reason"]["type"] == "abort" and partial["output_ids"]
    assert later["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_or_in_place_then_continue_completes(url, mode):
    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            task = _start_long(http, url, f"p-{mode}", n=300)
            await _until_running(url)
            await http.post(url + "/pause_generation", json={"mode": mode})
            n0 = (await http.get(url + "/server_info")).json()["num_generated_tokens"]
            await _scheduler_turns(http, url)  # turns in which a step would have generated tokens
            assert (await http.get(url + "/server_info")).json()["num_generated_tokens"] == n0
            assert not task.done()
            await http.post(url + "/continue_generation")
            return (await task).json()

    body = asyncio.run(run())
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


def test_bad_pause_mode_is_400(url):
    r = post(url, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and "sideways" in r.json()["message"] and r.json()["object"] == "error"


def test_client_disconnect_aborts_its_request(url):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}},
            timeout=httpx.Timeout(10, read=0.5),
        )
    deadline = time.time() + 10
    while load(url)["num_running"] and time.time() < deadline:
        time.sleep(0.05)
    assert load(url)["num_running"] == 0


def test_control_endpoints(url):
    info = httpx.get(url + "/model_info", timeout=10).json()
    assert info["weight_version"] == "0" and info["is_generation"] and info["model_path"]
    assert httpx.get(url + "/get_model_info", timeout=10).json() == info
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    assert post(url, "/flush_cache").status_code == 200
    r = post(url, "/update_weight_version", {"new_version": "5"})
    assert r.json() == {"success": True, "message": "Weight version updated to 5", "new_version": "5"}
    assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "5"
    post(url, "/update_weight_version", {"new_version": "0"})
    r = post(url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert r.status_code == 400 and r.json()["success"] is False  # outside /begin_weight_update .. /end
    assert "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    r = post(url, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert r.status_code == 400 and "safetensors" in r.json()["message"]


# ------------------------------------------------------------------ probes as SGLang has them

PROBE_KEY = "sk-probes-0123456789"


@pytest.fixture(scope="module")
def probed(engine_model, tmp_path_factory):
    """An engine started through `agentrl serve-engine` without --weight-version, with an api key and
    SGLang's health-check time limit at 1 s (``SGLANG_HEALTH_CHECK_TIMEOUT``)."""
    import os

    from tests.conftest_engine import ENGINE_FLAGS, start_engines

    at = ENGINE_FLAGS.index("--weight-version")
    flags = ENGINE_FLAGS[:at] + ENGINE_FLAGS[at + 2 :]
    env = {**os.environ, "AGENTRL_ENGINE_API_KEY": PROBE_KEY, "SGLANG_HEALTH_CHECK_TIMEOUT": "1"}
    (proc,) = start_engines(engine_model, 1, tmp_path_factory.mktemp("probed"), via_cli=True, flags=flags, env=env)
    yield proc.url
    proc.stop()


def test_serve_engine_reports_default_without_a_weight_version(probed):
    key = {"Authorization": f"Bearer {PROBE_KEY}"}
    assert httpx.get(probed + "/model_info", headers=key, timeout=10).json()["weight_version"] == "default"
    r = httpx.post(
        probed + "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
        headers=key,
        timeout=60,
    )
    assert r.json()["meta_info"]["weight_version"] == "default"


def test_ping_is_a_flag_and_health_generates_as_in_sglang(probed):
    key = {"Authorization": f"Bearer {PROBE_KEY}"}

    def status(path: str, **kw) -> int:
        return httpx.get(probed + path, timeout=30, **kw).status_code

    ping = httpx.get(probed + "/ping", headers=key, timeout=10)
    assert (ping.status_code, ping.content) == (200, b"")
    assert status("/ping") == 401 and status("/health") == 200 and status("/ready") == 200  # /ping wants the key
    assert post(probed, "/pause_generation", {"mode": "in_place"}, headers=key).status_code == 200
    try:
        assert status("/ping", headers=key) == 200 and status("/ready") == 503  # paused: alive, not ready
        start = time.monotonic()
        assert status("/health") == 503  # its one token waited at the pause for the 1 s limit
        assert time.monotonic() - start >= 1.0
        assert load_keyed(probed)["num_waiting"] == 0  # and was taken back
        assert status("/ping", headers=key) == 503  # SGLang marks itself unhealthy until a check passes
    finally:
        post(probed, "/continue_generation", headers=key)
    assert status("/ping", headers=key) == 503
    assert status("/health_generate") == 200 and status("/ping", headers=key) == 200 and status("/ready") == 200


def load_keyed(url: str) -> dict:
    return httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {PROBE_KEY}"}, timeout=10).json()
