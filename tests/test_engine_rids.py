"""Request ids as SGLang 0.5.23 treats them, and the rids agentrl sends.

SGLang aborts by rid prefix (``Scheduler.abort_request``: every live rid that ``startswith`` the one
named, once that one is live) and refuses a rid that is still live (``TokenizerManager``: 400
"Duplicate request ID detected"). So every rid the client sends is :func:`attempt_rid` of the caller's
base (prefix-free, fresh per attempt), and the embedded engine behaves as SGLang does. Real engines on
loopback (tests/conftest_engine.py); the dropped connection is a real TCP proxy that forwards a request
and then closes the client's side only, so the engine still holds the first attempt.
"""

from __future__ import annotations

import json

import httpx
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.engine.client import RID_SUFFIX_HEX, EngineClient, attempt_rid

LONG = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab#%-_1"), max_size=6), min_size=1, max_size=6))
def test_attempt_rids_are_prefix_free_and_fresh(bases):
    rids = [attempt_rid(b) for b in bases + bases]  # each base twice: two attempts of it
    assert len(set(rids)) == len(rids)
    for a in rids:
        assert a[-RID_SUFFIX_HEX - 1] == "#"
        for b in rids:
            assert a == b or not b.startswith(a), (a, b)


def test_a_prefix_of_a_base_does_not_make_a_prefix_rid():
    """The attack the scheme exists for: ``ep-1-1`` and ``ep-1-10`` (and a base holding the separator)."""
    for short, long in (("ep-1-1", "ep-1-10"), ("a", "a#0123456789abcdef"), ("x%", "x%23")):
        assert not attempt_rid(long).startswith(attempt_rid(short))


# ---------------------------------------------------------------------- the embedded engine, as SGLang


async def _until_waiting(http: httpx.AsyncClient, url: str, n: int) -> None:
    with trio.fail_after(30):
        while (await http.get(url + "/server_info")).json()["num_waiting"] < n:
            await trio.sleep(0.02)


def _post(http: httpx.AsyncClient, url: str, rid, out: dict, ids=(1, 2)):
    async def go():
        r = await http.post(url + "/generate", json={"input_ids": list(ids), "rid": rid, "sampling_params": LONG})
        out[rid if isinstance(rid, str) else json.dumps(rid)] = r

    return go


def test_abort_by_a_live_rid_aborts_every_rid_it_prefixes_and_a_live_rid_is_not_taken_twice(engine_urls):
    url = engine_urls[1]

    async def main():
        got: dict = {}
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await http.post(url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
            try:
                async with trio.open_nursery() as n:
                    for rid in ("ep-1-1", "ep-1-10", "ep-1-2"):
                        n.start_soon(_post(http, url, rid, got))
                    await _until_waiting(http, url, 3)
                    dup = await http.post(url + "/generate", json={"input_ids": [5], "rid": "ep-1-10"})
                    batch = await http.post(url + "/generate", json={"input_ids": [[5], [6]], "rid": ["b", "b"]})
                    # not a live rid itself: SGLang ignores it, although live rids start with it
                    await http.post(url + "/abort_request", json={"rid": "ep-1-"})
                    assert (await http.get(url + "/server_info")).json()["num_waiting"] == 3
                    await http.post(url + "/abort_request", json={"rid": "ep-1-1"})
                    with trio.fail_after(30):
                        while len(got) < 2:
                            await trio.sleep(0.02)
                    await http.post(url + "/continue_generation")
            finally:
                await http.post(url + "/continue_generation")
        return got, dup, batch

    got, dup, batch = trio.run(main)
    assert (dup.status_code, dup.json()) == (400, {"error": {"message": "Duplicate request ID detected: ep-1-10"}})
    assert batch.status_code == 400
    assert batch.json()["error"]["message"] == "rid: Duplicate request IDs detected within the request: ['b']"
    reasons = {rid: r.json()["meta_info"]["finish_reason"]["type"] for rid, r in got.items()}
    assert reasons == {"ep-1-1": "abort", "ep-1-10": "abort", "ep-1-2": "length"}
    # a finished rid is free again
    again = httpx.post(
        url + "/generate", json={"input_ids": [5], "rid": "ep-1-10", "sampling_params": LONG}, timeout=60
    )
    assert again.status_code == 200 and again.json()["meta_info"]["id"] == "ep-1-10"


# ---------------------------------------------------------------------- retries after a dropped connection


class DroppingProxy:
    """TCP proxy to ``upstream``: the first ``POST /generate`` is forwarded, then its client side closed
    (no answer) while the engine side stays open, so the engine keeps that request live. Every
    ``/generate`` request's JSON body is recorded."""

    def __init__(self, upstream: str):
        self.host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream_port = int(port)
        self.bodies: list[dict] = []
        self.dropped = trio.Event()
        self.held: list[trio.SocketStream] = []
        self.port = 0

    async def serve(self, nursery: trio.Nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._one, listeners, handler_nursery=nursery)

    async def _one(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream(self.host, self.upstream_port)
        first = await client.receive_some()
        if first.startswith(b"POST /generate"):
            head, _, body = first.partition(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
                )
            )
            while len(body) < length:
                body += await client.receive_some()
            first = head + b"\r\n\r\n" + body
            self.bodies.append(json.loads(body))
            if not self.dropped.is_set():
                await upstream.send_all(first)
                self.held.append(upstream)  # the engine still holds the request
                self.dropped.set()
                await client.aclose()
                return
        await upstream.send_all(first)
        async with trio.open_nursery() as n:
            n.start_soon(_pump, client, upstream)
            n.start_soon(_pump, upstream, client)


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while data := await src.receive_some():
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        with trio.move_on_after(1):
            await dst.aclose()


def test_a_retry_after_a_dropped_connection_has_a_fresh_rid_and_abort_reaches_every_attempt(engine_urls):
    """While the engine is paused the first attempt stays live there: a retry with the same rid would be
    SGLang's 400 "Duplicate request ID"; with a fresh one it is queued too, and ``abort(base)`` ends both."""
    url = engine_urls[1]

    async def main():
        proxy = DroppingProxy(url)
        async with httpx.AsyncClient(timeout=60) as http, trio.open_nursery() as n:
            await n.start(proxy.serve, n)
            assert (await http.post(url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
            try:
                async with EngineClient(
                    [f"http://127.0.0.1:{proxy.port}"], backoff_s=0.01, health_check_interval_s=0.1
                ) as client:
                    results = []

                    async def call():
                        results.append(await client.generate([3, 4], LONG, rid="ep-7-1"))

                    n.start_soon(call)
                    await _until_waiting(http, url, 2)  # the dropped attempt and its retry
                    await client.abort("ep-7-1")
                    with trio.fail_after(30):
                        while not results:
                            await trio.sleep(0.02)
                    left = (await http.get(url + "/server_info")).json()["num_waiting"]
            finally:
                for s in proxy.held:
                    await s.aclose()
                await http.post(url + "/continue_generation")
            n.cancel_scope.cancel()
        return proxy.bodies, results[0], left

    bodies, result, left = trio.run(main)
    rids = [b["rid"] for b in bodies]
    assert len(rids) == 2 and rids[0] != rids[1] and all(r.startswith("ep-7-1#") for r in rids), rids
    assert result.finish_reason["type"] == "abort" and result.meta_info["id"] == rids[1]
    assert left == 0  # the dropped attempt too, although its connection is still open


def test_each_5xx_retry_gets_a_fresh_rid():
    from tests.test_engine_client import _FlakyServer

    flaky = _FlakyServer()
    with flaky as url:

        async def main():
            async with EngineClient([url], backoff_s=0.01, max_retries=3) as client:
                return await client.generate([1], {"max_new_tokens": 1}, rid="turn-3")

        result = trio.run(main)
    assert len(flaky.rids) == 3 and len(set(flaky.rids)) == 3 and all(r.startswith("turn-3#") for r in flaky.rids)
    assert result.meta_info["id"] == flaky.rids[-1]
