"""The learner's weight push (agentrl/learner/weight_push.py) against SGLang-like servers.

Where the embedded engine lacks what real SGLang has (TP ranks, data parallelism, a build
without begin/end, bearer keys), the engines are ``tests/_fake_sglang.py`` processes: real HTTP,
real torch.distributed ranks (one per TP rank) that receive every broadcast, SGLang's rules.
A bucket's two ends (packing, the engine's receiver) are also checked over a real gloo group
without HTTP, byte for byte.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from agentrl.learner.weight_push import (
    EngineLost,
    WeightUpdateError,
    WeightUpdater,
    full_tensors,
    plan_buckets,
    rank_layout,
    without_tied_head,
)
from agentrl.net import free_port
from agentrl.weight_group import bind_store_socket, destroy_weight_group, init_weight_group

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ helpers


class FakeSGLang:
    """``tests/_fake_sglang.py`` in a child process."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._fake_sglang", "--port", str(self.port), *flags],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, timeout_s: float = 120.0) -> FakeSGLang:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # an external process: polling with a bound
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake SGLang exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("fake SGLang did not start")

    def state(self) -> dict:
        return httpx.get(self.url + "/_fake/state", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fakes(*flag_sets: tuple[str, ...]) -> list[FakeSGLang]:
    started = [FakeSGLang(*flags) for flags in flag_sets]  # start together, wait together
    try:
        return [f.wait_ready() for f in started]
    except BaseException:
        for f in started:
            f.stop()
        raise


def tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=gen)),
        ("model.layers.0.mlp.weight", torch.randn(96, 32, generator=gen)),
        ("model.layers.0.norm.weight", torch.randn(32, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(32, generator=gen)),
        ("lm_head.weight", torch.randn(64, 32, generator=gen)),
    ]


def checksums(named) -> dict[str, float]:
    return {n: float(t.double().sum()) for n, t in named}


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket in LISTEN on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def non_loopback_ipv4() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


# ------------------------------------------------------------------------------ pure parts


def test_the_tied_head_rule():
    emb = torch.randn(10, 4)
    head = torch.randn(10, 4)
    state_dict_like = [("model.embed_tokens.weight", emb), ("x", torch.zeros(3)), ("lm_head.weight", emb)]
    assert [n for n, _ in without_tied_head(state_dict_like)] == ["model.embed_tokens.weight", "x"]
    untied = [("model.embed_tokens.weight", emb), ("lm_head.weight", head)]
    assert [n for n, _ in without_tied_head(untied)] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert [n for n, _ in without_tied_head(untied, tied=True)] == ["model.embed_tokens.weight"]
    shared = [("model.embed_tokens.weight", emb.detach()), ("lm_head.weight", emb.detach())]  # a state_dict's way
    assert [n for n, _ in without_tied_head(shared)] == ["model.embed_tokens.weight"]


def test_one_bucketing_pass_bounds_size_and_keeps_one_dtype():
    named = [
        ("a", torch.zeros(100)),
        ("b", torch.zeros(100)),
        ("c", torch.zeros(100, dtype=torch.bfloat16)),
        ("d", torch.zeros(300)),
        ("e", torch.zeros(50)),
        ("f", torch.zeros(50)),
    ]
    plan = plan_buckets(named, bucket_bytes=600)
    assert [[n for n, _ in b] for b in plan] == [["a"], ["b"], ["c"], ["d"], ["e", "f"]]
    for bucket in plan:
        assert len({t.dtype for _, t in bucket}) == 1
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 600
    # counted in the dtype they are sent in: in bf16, a and b fit one bucket and c joins them
    assert [[n for n, _ in b] for b in plan_buckets(named, 600, torch.bfloat16)] == [["a", "b", "c"], ["d"], ["e", "f"]]
    assert [t.dtype for _, t in full_tensors(plan[0], torch.bfloat16)] == [torch.bfloat16]


def test_rank_offsets_follow_the_tp_ranks_of_the_engines_before():
    assert rank_layout([1]) == ([1], 2)
    assert rank_layout([2, 1, 4]) == ([1, 3, 4], 8)


def test_the_group_store_listens_on_master_address_only():
    """torch's TCPStore alone listens on every interface; the group's store must not."""
    sock = bind_store_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    group = init_weight_group("gloo", "127.0.0.1", port, 1, 0, "bind_test", 30.0, listen_socket=sock)
    try:
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and nothing on 0.0.0.0 or ::
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        outside = non_loopback_ipv4()
        if outside is not None:  # the attack: reach the store from another interface of this machine
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=5).close()
    finally:
        destroy_weight_group(group)


# ------------------------------------------------------------------------------ against SGLang stand-ins


def test_tp_ranks_versions_flush_and_a_build_without_begin_end(caplog):
    """Engine A has 2 TP ranks, engine B is an older build (404 on begin/end): offsets 1 and 3,
    world 4; every TP rank receives every tensor; only the last bucket flushes the cache and
    carries the version; B's missing begin/end is warned about once over two pushes."""
    a, b = fakes(("--tp-size", "2"), ("--no-begin-end", "--weight-version", "7"))
    try:
        with WeightUpdater([a.url, b.url], bucket_bytes=8 << 10) as updater:
            updater.connect()
            assert (updater.rank_offsets, updater.world_size) == ([1, 3], 4)
            assert listening_addresses(updater.group_port) == ["0100007F"]
            assert a.state()["init"]["rank_offset"] == 1 and b.state()["init"]["rank_offset"] == 3
            assert a.state()["init"]["world_size"] == b.state()["init"]["world_size"] == 4

            # an engine that does not report the learner's version gets its weights: A ("default") and B
            # (another policy's 7) at version 0, only A at version 7
            assert updater.members == [a.url, b.url] and updater.labels == {a.url: "default", b.url: "7"}
            assert updater.lagging(0) == [a.url, b.url] and updater.lagging(7) == [a.url]
            assert updater.membership_change(0) == ""

            named = tensors()
            plan = plan_buckets(without_tied_head(named), updater.bucket_bytes)
            alive: list[weakref.ref] = []

            def materialize(bucket):  # the previous bucket must be gone before the next is gathered
                assert all(ref() is None for ref in alive), "two gathered buckets held at once"
                full = full_tensors(bucket)
                alive.extend(weakref.ref(t) for _, t in full)
                return full

            with caplog.at_level(logging.WARNING, logger="agentrl.learner.weight_push"):
                stats = updater.push_plan(plan, 1, materialize)
                updater.push(named, 2)
            assert stats["num_buckets"] == len(plan) >= 3
            warnings = [r.getMessage() for r in caplog.records if "begin_weight_update" in r.getMessage()]
            assert len(warnings) == 1 and b.url in warnings[0]
        for fake in (a, b):
            state = fake.state()
            updates = state["updates"]
            assert len(updates) == 2 * len(plan)
            assert state["weight_version"] == "2" and state["paused"] is None and not state["session"]
            # before each push, right after the pause: "default", so a cut-short push leaves no number
            assert state["version_updates"] == [{"new_version": "default", "abort_all_requests": False}] * 2
            first = updates[: len(plan)]
            assert [u["flush_cache"] for u in first] == [False] * (len(plan) - 1) + [True]
            assert [u["weight_version"] for u in first] == [None] * (len(plan) - 1) + ["1"]
            assert {u["paused"] for u in updates} == {"abort"}
            received: dict[str, float] = {}
            for u in first:
                assert all(ranks == u["checksums"][0] for ranks in u["checksums"])  # every TP rank got the same
                received.update(u["checksums"][0])
            assert len(first[0]["checksums"]) == (2 if fake is a else 1)
            assert received == pytest.approx(checksums(without_tied_head(named)), rel=1e-6)
            assert "lm_head.weight" in received  # not tied here: a distinct tensor is sent
    finally:
        for fake in (a, b):
            fake.stop()


def test_in_place_pause_never_flushes_and_a_failed_bucket_still_ends_and_continues():
    (fake,) = fakes(())
    try:
        with WeightUpdater([fake.url], bucket_bytes=8 << 10, pause_mode="in_place") as updater:
            updater.push(tensors(), 1)
            assert {u["flush_cache"] for u in fake.state()["updates"]} == {False}
            assert fake.state()["weight_version"] == "1"

            named = tensors()
            named.insert(2, ("model.refuse.weight", torch.zeros(2048)))  # the engine refuses this bucket
            plan = plan_buckets(named, updater.bucket_bytes)
            calls: list[int] = []

            def materialize(bucket):
                calls.append(next(i for i, b in enumerate(plan) if b is bucket))
                return full_tensors(bucket)

            with pytest.raises(WeightUpdateError, match="refused by the test") as refused:
                updater.push_plan(plan, 2, materialize)
            assert not isinstance(refused.value, EngineLost)  # an answer: not a membership problem
            assert updater.group is None  # this end is gone; the next push forms a new group
        assert calls == list(range(len(plan)))  # every bucket gathered, in order: the other ranks are in them
        state = fake.state()
        assert state["paused"] is None and not state["session"]  # continue and end still ran
        # the buckets before the refused one were applied: the engine holds no policy's weights, and says so
        assert state["weight_version"] == "default"
    finally:
        fake.stop()


def test_an_engine_with_data_parallel_replicas_is_refused_before_any_group():
    (fake,) = fakes(("--dp-size", "2"))
    try:
        with WeightUpdater([fake.url]) as updater:
            with pytest.raises(WeightUpdateError, match=r"dp_size=2.*own engine.*sglang-router"):
                updater.connect()
            assert updater.group is None
        assert fake.state()["init"] is None
    finally:
        fake.stop()


def test_keys_go_where_sglang_wants_them_and_never_into_logs(monkeypatch, caplog):
    """The second engine is an older build: for SGLang's auth its missing begin/end are NORMAL
    paths, which refuse the admin key (401) before they can answer 404."""
    api, admin = "api-key-0123456789", "admin-key-9876543210"
    keys = ("--api-key", api, "--admin-api-key", admin)
    fake, old_build = fakes(keys, (*keys, "--no-begin-end"))
    from agentrl.config import load_config

    cfg = load_config(None, [f"engine.urls=['{fake.url}', '{old_build.url}']", "engine.weight_group_backend=gloo"])
    caplog.set_level(logging.DEBUG)
    try:
        # right keys: /server_info and /model_info with the api key, every admin route with the admin key
        monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", api)
        monkeypatch.setenv("AGENTRL_ENGINE_ADMIN_API_KEY", admin)
        with WeightUpdater.from_config(cfg.engine) as updater:
            updater.connect()
            assert updater.lagging(0) == [fake.url, old_build.url]  # "default": they get the weights
            updater.push(tensors(), 1)
            updater.push(tensors(), 2)
        assert fake.state()["weight_version"] == old_build.state()["weight_version"] == "2"
        assert len([r for r in caplog.records if "has no /begin_weight_update" in r.getMessage()]) == 1

        # only the api key: the server has an admin key, so admin routes refuse it -- at once,
        # not after the rendezvous times out
        monkeypatch.delenv("AGENTRL_ENGINE_ADMIN_API_KEY")
        started = time.monotonic()
        with WeightUpdater.from_config(cfg.engine) as updater:
            with pytest.raises(WeightUpdateError, match="401.*AGENTRL_ENGINE_ADMIN_API_KEY") as refused:
                updater.connect()
        assert time.monotonic() - started < 30
        assert api not in str(refused.value) and admin not in str(refused.value)
    finally:
        fake.stop()
        old_build.stop()
    assert api not in caplog.text and admin not in caplog.text


# ------------------------------------------------------------------------------ NCCL: the host waits


def test_settle_synchronises_the_host_with_a_cuda_device_only(monkeypatch):
    """NCCL's work.wait() does not block the host (the stream waits): on CUDA the host is
    synchronised with the device; gloo's CPU tensors are done after wait(), nothing to do."""
    from agentrl.learner.weight_push import _settle

    synced: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    assert _settle(torch.device("cpu")) is False and _settle("cpu") is False
    assert synced == []
    assert _settle(torch.device("cuda", 1)) is True
    assert _settle("cuda:0") is True
    assert [torch.device(d) for d in synced] == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_a_broadcast_settles_on_its_device_after_every_wait_and_a_device_error_breaks_it(monkeypatch):
    """The broadcast's time is taken, and the engines' answers read, only after _broadcast
    returns: it must have settled by then; an error the device reports there is a broken broadcast."""
    import torch.distributed as dist

    from agentrl.learner import weight_push

    events: list[tuple[str, str]] = []

    class Work:
        def __init__(self, name: str):
            self.name = name

        def wait(self) -> None:
            events.append(("wait", self.name))

    bucket = [("a", torch.zeros(2)), ("b", torch.ones(3))]
    names = iter(n for n, _ in bucket)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group, async_op: Work(next(names)))
    monkeypatch.setattr(weight_push, "_settle", lambda device: events.append(("settle", torch.device(device).type)))
    updater = WeightUpdater(["http://127.0.0.1:9"])
    try:
        assert updater._broadcast([t for _, t in bucket]) == ""
        assert events == [("wait", "a"), ("wait", "b"), ("settle", "cpu")]

        def failing(device):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        names = iter(["a", "b"])
        monkeypatch.setattr(weight_push, "_settle", failing)
        assert "illegal memory access" in updater._broadcast([t for _, t in bucket])
    finally:
        updater.close()


# ------------------------------------------------------------------------------ a bucket's two ends


def bucket_tensors() -> list[tuple[str, torch.Tensor]]:
    """Odd sizes, a 0-d tensor, a dtype change (a bucket of its own), and one tensor larger than the rest."""
    gen = torch.Generator().manual_seed(7)
    return [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen)),
        ("c", torch.randn((), generator=gen)),
        ("d", torch.randn(64, 33, generator=gen)),
        ("e", torch.randn(5, 3, generator=gen).to(torch.bfloat16)),
        ("f", torch.randn(300, 40, generator=gen)),
        ("g", torch.randn(9, generator=gen)),
    ]


def test_a_flattened_bucket_is_every_byte_in_order_in_one_buffer_kept_across_buckets():
    updater = WeightUpdater(["http://127.0.0.1:9"])
    try:
        named = bucket_tensors()
        small, large = [t for _, t in named[:4]], [named[5][1]]
        flat = updater._pack(small)
        assert torch.equal(flat, torch.cat([t.reshape(-1).view(torch.uint8) for t in small]))
        grown = updater._pack(large)  # larger: the buffer grows
        assert grown.numel() == large[0].numel() * 4 and torch.equal(grown.view(torch.float32), large[0].reshape(-1))
        again = updater._pack(small)  # smaller: the same memory, no new allocation
        assert again.data_ptr() == grown.data_ptr()
        assert torch.equal(again, torch.cat([t.reshape(-1).view(torch.uint8) for t in small]))
    finally:
        updater.close()


@pytest.mark.parametrize("flattened", [False, True])
def test_a_packed_bucket_is_gathered_while_the_engines_apply_the_last_one_bucket_held_at_a_time(monkeypatch, flattened):
    """Per bucket: its HTTP update, its broadcasts, the answers, then the next bucket's gather; for
    ``flattened_bucket`` the gather (and packing) comes before the answers, while the engines apply.
    The previous bucket is gone before the next gather either way."""
    updater = WeightUpdater(["http://127.0.0.1:9"], load_format="flattened_bucket" if flattened else None)
    named = without_tied_head(bucket_tensors())
    plan = plan_buckets(named, 1 << 10)
    index = {bucket[0][0]: i for i, bucket in enumerate(plan)}
    events: list[tuple[str, int]] = []
    alive: list[weakref.ref] = []
    bodies: list[dict] = []

    def materialize(bucket):
        assert all(ref() is None for ref in alive), "two gathered buckets held at once"
        events.append(("gather", index[bucket[0][0]]))
        full = full_tensors(bucket, device=torch.device("cpu"))
        alive.extend(weakref.ref(t) for _, t in full)
        return [(n, t.clone()) for n, t in full]  # fresh tensors, as a gather makes

    def fire(urls, path, body_for):
        bodies.append(body_for(0))
        events.append(("fire", index[bodies[-1]["names"][0]]))
        return [len(bodies) - 1]

    monkeypatch.setattr(updater, "_fire", fire)
    monkeypatch.setattr(updater, "_broadcast", lambda payload: events.append(("broadcast", len(bodies) - 1)) or "")
    monkeypatch.setattr(updater, "_collect", lambda futures: events.append(("answers", futures[0])))
    gathered = [0]
    try:
        stats = {"bytes": 0, "num_tensors": 0, "num_buckets": 0, "gather_s": 0.0, "broadcast_s": 0.0}
        first = [updater._prepare(plan[0], materialize, stats, gathered)]
        updater._send_plan(plan, "5", first, materialize, stats, gathered)
    finally:
        updater.close()
    assert len(plan) >= 3 and gathered == [len(plan)] and stats["num_buckets"] == len(plan)
    expected = [("gather", 0)]
    for i in range(len(plan)):
        after = [("gather", i + 1)] if i + 1 < len(plan) else []
        answers = [("answers", i)]
        expected += [("fire", i), ("broadcast", i)] + (after + answers if flattened else answers + after)
    assert events == expected
    assert [b.get("weight_version") for b in bodies] == [None] * (len(plan) - 1) + ["5"]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(plan) - 1) + [True]
    assert {b.get("load_format") for b in bodies} == {"flattened_bucket" if flattened else None}
    assert [n for b in bodies for n in b["names"]] == [n for n, _ in named]


def _engine_end(port: int, spec: list, conn) -> None:
    """A child process: the engine's receiver over a model of ``spec`` (all fp32), answering each
    bucket with its parameters and the CPU scratch it holds."""
    from agentrl.engine.weights import EngineWeightReceiver

    torch.set_num_threads(1)
    params = {name: torch.zeros(shape) for name, shape in spec}
    runner = SimpleNamespace(device=torch.device("cpu"), lm_head=None, named_tensors=lambda: params)
    receiver = EngineWeightReceiver(runner)
    receiver.init_group("127.0.0.1", port, 1, 2, "exact", "gloo", timeout_s=60.0)
    for body in iter(conn.recv, None):
        problems = receiver.receive(
            receiver.check_spec(body["names"], body["dtypes"], body["shapes"]), body.get("load_format") is not None
        )
        scratch = receiver.scratch.buffer
        conn.send((problems, {n: t.clone() for n, t in params.items()}, scratch.data_ptr(), scratch.numel()))
    receiver.destroy_group()


@pytest.mark.parametrize("flattened", [False, True])
def test_a_bucket_arrives_byte_for_byte_in_the_engines_parameters(flattened):
    """Sender (the updater's gather, packing and broadcast) and receiver (the engine's) over a real
    gloo group: every parameter equals what was sent (bf16 sent into an fp32 model: cast on the
    way in), and a receiver's CPU scratch is one buffer, kept for smaller buckets."""
    named = bucket_tensors()
    sock = bind_store_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_engine_end, args=(port, [(n, tuple(t.shape)) for n, t in named], child_conn))
    child.start()
    updater = WeightUpdater(["http://127.0.0.1:9"], load_format="flattened_bucket" if flattened else None)
    group = init_weight_group("gloo", "127.0.0.1", port, 2, 0, "exact", 60.0, listen_socket=sock)
    updater.group, updater.group_id = group, "exact"
    answers = []
    try:
        for bucket in plan_buckets(named, 16 << 10):
            payload, body = updater._prepare(bucket, full_tensors, {"gather_s": 0.0}, [0])
            conn.send(body)
            assert updater._broadcast(payload) == ""
            answers.append(conn.recv())
        conn.send(None)
        child.join(60)
    finally:
        updater.group = None
        destroy_weight_group(group)
        updater.close()
        if child.is_alive():
            child.kill()
    assert [problems for problems, _, _, _ in answers] == [[]] * len(answers)
    received = answers[-1][1]
    for name, sent in named:
        assert torch.equal(received[name], sent.float()), name
    sizes = [numel for _, _, _, numel in answers]
    if flattened:  # buckets [a-d], [e] (bf16), [f], [g]: the scratch grows at f, then is kept
        assert len(answers) == 4 and sizes[2] == named[5][1].numel() * 4 and sizes[3] == sizes[2]
        assert answers[3][2] == answers[2][2]
    else:  # straight into the parameters, but e (bf16 into fp32) through scratch
        assert sizes[0] == 0 and sizes[1] > 0


def test_the_engine_answers_after_its_device_settled_and_a_device_error_fails_the_receive(monkeypatch):
    """On NCCL a receive's wait() only orders the stream: the engine's answer (the weights are in)
    comes after a device synchronisation, after the copies into the parameters, and an error the
    device reports there fails the update."""
    import torch.distributed as dist

    from agentrl.engine import weights as engine_weights
    from agentrl.engine.weights import EngineWeightReceiver

    params = {"w": torch.zeros(4), "v": torch.zeros(2)}
    runner = SimpleNamespace(device=torch.device("cpu"), lm_head=None, named_tensors=lambda: params)
    receiver = EngineWeightReceiver(runner)
    receiver.group = object()  # type: ignore[assignment]

    class Work:
        def wait(self) -> None:
            pass

    def broadcast(t, src, group, async_op=False):
        t.fill_(2)
        return Work()

    seen: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(engine_weights, "settle", lambda device: seen.append({n: t.clone() for n, t in params.items()}))
    spec = receiver.check_spec(["w", "v"], ["float32", "bfloat16"], [[4], [2]])
    assert receiver.receive(spec) == []
    assert torch.equal(seen[-1]["w"], torch.full((4,), 2.0)) and torch.equal(seen[-1]["v"], torch.full((2,), 2.0))
    assert receiver.receive(spec[:1], flattened=True) == []
    assert torch.equal(seen[-1]["w"], torch.full((16,), 2, dtype=torch.uint8).view(torch.float32))

    def failing(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine_weights, "settle", failing)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        receiver.receive(spec)


def test_the_engine_settles_a_cuda_device_only(monkeypatch):
    from agentrl.engine.weights import settle

    synced: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    settle(torch.device("cpu"))
    assert synced == []
    settle(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]
