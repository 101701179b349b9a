"""EngineClient against two real embedded engine processes on loopback (trio)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import trio

from agentrl.engine.client import EngineClient, EngineRequestError, GenerateResult
from agentrl.net import free_port

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(engine_fleet):
    return engine_fleet


@pytest.fixture(scope="module")
def urls(engine_urls) -> list[str]:
    return engine_urls


def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


async def scheduler_turns(url: str, n: int = 3) -> None:
    """Return once the engine's scheduler has gone around its loop about ``n`` times: each /abort_request runs
    in its thread between steps, and the next is sent once it has answered (no request has this rid)."""
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(n):
            assert (await http.post(url + "/abort_request", json={"rid": "no-such-request-barrier"})).status_code == 200


def test_least_outstanding_balancing_and_episode_affinity(urls):
    async def main():
        async with EngineClient(urls, health_check_interval_s=0.5) as client:
            spread: list[GenerateResult] = []
            episodes: dict[str, list[str]] = {f"ep{i}": [] for i in range(8)}

            async def free(i):
                spread.append(await client.generate([5, 6, i], {"max_new_tokens": 12, "ignore_eos": True}))

            async def episode(key):
                prompt = [7, 8]
                for _turn in range(3):
                    r = await client.generate(prompt, {"max_new_tokens": 4, "ignore_eos": True}, affinity_key=key)
                    episodes[key].append(r.url)
                    prompt = prompt + r.output_ids + [9]

            async with trio.open_nursery() as n:
                for i in range(24):
                    n.start_soon(free, i)
                for key in episodes:
                    n.start_soon(episode, key)
            return spread, episodes

    spread, episodes = trio.run(main)
    per_server = {u: sum(r.url == u for r in spread) for u in urls}
    assert all(count >= 6 for count in per_server.values()), per_server  # both engines carried load
    assert all(len(set(v)) == 1 for v in episodes.values()), episodes  # one server per episode
    assert len({v[0] for v in episodes.values()}) == 2  # and episodes were spread over both
    r = spread[0]
    assert len(r.output_ids) == len(r.output_logprobs) == 12 and r.finish_reason["type"] == "length"
    assert r.weight_version == "0" and r.prompt_tokens == 3


def test_many_calls_in_flight_are_spread_over_small_http_pools(urls):
    from agentrl.engine.client import SHARD_REQUESTS

    async def main():
        async with EngineClient(urls) as client:
            peak = [0]

            async def one(i):
                r = await client.generate([5, 6, i % 50], {"max_new_tokens": 6, "ignore_eos": True})
                peak[0] = max(peak[0], max(s.in_flight for s in client._shards))
                assert len(r.output_ids) == 6

            async with trio.open_nursery() as n:
                for i in range(3 * SHARD_REQUESTS + 5):
                    n.start_soon(one, i)
            return len(client._shards), peak[0], [s.in_flight for s in client._shards]

    shards, peak, left = trio.run(main)
    assert shards == 4  # 53 calls at once need four pools of at most 16
    assert peak <= SHARD_REQUESTS and left == [0, 0, 0, 0]


def test_a_dead_server_is_dropped_and_calls_go_elsewhere(urls):
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with EngineClient([dead, urls[0]], health_check_interval_s=0.3, backoff_s=0.01) as client:
            results = []
            async with trio.open_nursery() as n:
                for i in range(8):
                    n.start_soon(lambda i=i: _append(results, client.generate([1, i], GREEDY)))
            return results, _healthy(client)

    results, healthy = trio.run(main)
    assert len(results) == 8 and all(r.url == urls[0] for r in results)
    assert healthy == [urls[0]]


async def _append(out: list, coro) -> None:
    out.append(await coro)


def _healthy(client: EngineClient) -> list[str]:
    return [s.url for s in client.engines if s.healthy]


def test_a_hung_server_is_dropped_then_readmitted(fleet, urls):
    hung = fleet[1]

    async def main():
        async with EngineClient(urls, health_check_interval_s=0.2, health_timeout_s=0.5) as client:
            os.kill(hung.process.pid, signal.SIGSTOP)
            try:
                with trio.fail_after(10):
                    while urls[1] in _healthy(client):
                        await trio.sleep(0.05)
                during = [await client.generate([2, i], GREEDY) for i in range(4)]
            finally:
                os.kill(hung.process.pid, signal.SIGCONT)
            with trio.fail_after(20):
                while urls[1] not in _healthy(client):
                    await trio.sleep(0.05)
            return during

    during = trio.run(main)
    assert all(r.url == urls[0] for r in during)


def test_calls_wait_while_no_server_is_healthy(fleet, urls):
    hung = fleet[1]
    got: list[GenerateResult] = []

    async def main():
        async with EngineClient([urls[1]], health_check_interval_s=0.2, health_timeout_s=0.3) as client:
            os.kill(hung.process.pid, signal.SIGSTOP)
            try:
                with trio.fail_after(10):
                    while _healthy(client):
                        await trio.sleep(0.05)
                async with trio.open_nursery() as n:
                    n.start_soon(lambda: _append(got, client.generate([3, 3], GREEDY)))
                    with trio.fail_after(20):  # the waiting call re-probes the hung engine, again and again
                        probes = [client._last_probe]
                        while len(set(probes)) < 4:
                            await trio.sleep(0.05)
                            probes.append(client._last_probe)
                    assert not got, "the call should still be waiting"
                    os.kill(hung.process.pid, signal.SIGCONT)
            finally:
                os.kill(hung.process.pid, signal.SIGCONT)

    trio.run(main)
    assert len(got) == 1 and got[0].finish_reason["type"] == "length"


class _FlakyServer:
    """A stand-in HTTP server for the retry logic: 503 twice, then an SGLang-shaped answer; 400 on demand."""

    def __init__(self):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        self.calls = 0
        self.rids: list[str] = []

        async def generate(request):
            self.calls += 1
            body = await request.json()
            self.rids.append(body["rid"])
            if body["sampling_params"].get("bad"):
                return JSONResponse({"error": {"message": "sampling_params has an unknown field 'bad'"}}, 400)
            if self.calls <= 2:
                return JSONResponse({"error": {"message": "busy"}}, 503)
            return JSONResponse(
                {
                    "text": "x",
                    "output_ids": [4],
                    "meta_info": {
                        "id": body["rid"],
                        "finish_reason": {"type": "length", "length": 1},
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                        "weight_version": "3",
                        "output_token_logprobs": [[-0.5, 4, None]],
                    },
                }
            )

        async def health(request):  # no /ping: the client falls back to /health
            return Response(status_code=200)

        app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def test_5xx_is_retried_with_backoff_and_4xx_is_not():
    flaky = _FlakyServer()
    with flaky as url:

        async def main():
            async with EngineClient([url], backoff_s=0.01, max_retries=3) as client:
                ok = await client.generate([1], {"max_new_tokens": 1})
                with pytest.raises(EngineRequestError, match="unknown field 'bad'"):
                    await client.generate([1], {"bad": True})
                return ok

        ok = trio.run(main)
    assert ok.output_ids == [4] and ok.output_logprobs == [-0.5] and ok.weight_version == "3"
    assert flaky.calls == 4  # 503, 503, then the answer; the 400 was not retried


def test_paused_engines_hold_calls_and_aborted_results_are_returned(urls):
    async def main():
        async with EngineClient(urls[:1], health_check_interval_s=0.5) as client:
            await client.pause("in_place")
            held: list[GenerateResult] = []
            async with trio.open_nursery() as n:
                n.start_soon(lambda: _append(held, client.generate([4, 4], GREEDY)))
                with trio.fail_after(20):  # the call reached the engine's queue ...
                    while not server_info(urls[0])["num_waiting"]:
                        await trio.sleep(0.02)
                await scheduler_turns(urls[0])  # ... where the scheduler saw it and left it
                assert not held, "a call ran while the engine was paused"
                await client.continue_generation()
            long: list[GenerateResult] = []
            async with trio.open_nursery() as n:
                n.start_soon(lambda: _append(long, client.generate([5], {"max_new_tokens": 900, "ignore_eos": True})))
                with trio.fail_after(20):
                    while server_info(urls[0])["num_generated_tokens"] == 0 or not server_info(urls[0])["num_running"]:
                        await trio.sleep(0.05)
                await client.pause("abort")
            await client.continue_generation()
            return held[0], long[0]

    held, aborted = trio.run(main)
    assert held.finish_reason["type"] == "length"
    assert aborted.finish_reason["type"] == "abort" and 0 < len(aborted.output_ids) < 900
    assert len(aborted.output_logprobs) == len(aborted.output_ids)


def test_a_paused_engine_stays_in_rotation_and_health_probes_park_nothing(urls):
    """The client probes /ping, which answers from a flag while paused. SGLang's /health (the embedded
    engine's too) would park a one-token request at the pause gate, outlive the probe's time limit and
    drop the engine: shown first, as the border the client's probes must stay inside."""
    url = urls[0]

    async def main():
        async with EngineClient([url], health_check_interval_s=0.05, health_timeout_s=0.5) as client:
            await client.pause("in_place")
            try:
                async with httpx.AsyncClient() as http:
                    with pytest.raises(httpx.ReadTimeout):
                        await http.get(url + "/health", timeout=0.5)
                    parked = server_info(url)["num_waiting"]
                    await http.post(url + "/abort_request", json={"abort_all": True})
                    probes: list[str] = []
                    _hook_requests(client, lambda r: _append_now(probes, r.url.path))
                    with trio.fail_after(30):  # several health intervals of the background loop
                        while len(probes) < 5:
                            await trio.sleep(0.02)
                    during = (_healthy(client), server_info(url)["num_waiting"], set(probes))
            finally:
                await client.continue_generation()
            return parked, during

    parked, (healthy, waiting, paths) = trio.run(main)
    assert parked == 1  # /health parked its generation
    assert healthy == [url] and waiting == 0 and paths == {"/ping"}


async def _append_now(out: list, item) -> None:
    out.append(item)


def _hook_requests(client: EngineClient, hook) -> None:
    """Call ``hook`` on every probe and control request ``client`` sends from now on (each server's pool)."""
    for http in {id(h): h for h in (client._http_for(s) for s in client.servers)}.values():
        http.event_hooks["request"].append(hook)


def test_router_url_takes_generation_and_control_goes_to_each_engine(urls):
    async def main():
        # An engine URL stands in for sglang-router: it speaks the same /generate.
        async with EngineClient(urls, router_url=urls[1]) as client:
            results = [await client.generate([6, i], GREEDY, affinity_key="e") for i in range(3)]
            await client.pause("in_place")
            paused = [server_info(u)["paused"] for u in urls]
            await client.continue_generation()
            return results, paused

    results, paused = trio.run(main)
    assert all(r.url == urls[1] for r in results)
    assert paused == [True, True]
    assert not any(server_info(u)["paused"] for u in urls)


def test_the_background_probe_skips_an_engine_that_just_answered(urls):
    """An engine that replied within the health interval is alive: the loop's round probes only the others (at
    hundreds of engines, probing every one every 2 s cost an idle actor half a core, docs/scaling.md)."""

    async def main():
        async with EngineClient(urls, health_check_interval_s=3600) as client:
            probed: list[str] = []
            _hook_requests(
                client,
                lambda r: (
                    _append_now(probed, f"{r.url.scheme}://{r.url.netloc.decode()}")
                    if r.url.path in ("/ping", "/health")
                    else _append_now([], None)
                ),
            )
            await client.check_health(answered_within_s=60)  # every engine answered the probe on entry
            assert probed == []
            for engine in client.engines:
                engine.answered_at = 0.0  # as if those answers were long ago
            answered = (await client.generate([5, 6, 7], GREEDY)).url
            await client.check_health(answered_within_s=60)
            skipped = list(probed)
            probed.clear()
            await client.check_health()  # a plain check still probes every one
            return answered, skipped, sorted(probed)

    answered, skipped, everyone = trio.run(main)
    assert answered in urls and skipped == [u for u in urls if u != answered]
    assert everyone == sorted(urls)


def test_probes_and_control_calls_share_one_http_client_per_16_servers():
    """A pool's CPU per request grows with its connections (docs/scaling.md): 40 servers get 3 clients,
    a server always the same one, so its keep-alive connection is reused round after round."""
    client = EngineClient([f"http://127.0.0.1:{9000 + i}" for i in range(40)])
    first = [client._http_for(s) for s in client.engines]
    again = [client._http_for(s) for s in client.engines]
    trio.run(client.aclose)
    assert [id(h) for h in first] == [id(h) for h in again]
    assert len({id(h) for h in first}) == 3
    assert all(h is first[0] for h in first[:16]) and all(h is first[16] for h in first[16:32])
    assert first[16] is not first[0] and first[32] is not first[16]
