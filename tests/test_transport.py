"""Transport over real ZMQ sockets (tcp on loopback, ipc under tmp_path) and the in-memory twins."""

from __future__ import annotations

import random
import threading
import time

import msgpack
import numpy as np
import pytest
import trio
import zmq
from trio.testing import wait_all_tasks_blocked

from agentrl.protocol import ActorAck, Progress, ProtocolError, Trajectory, TrajectoryGroup, encode
from agentrl.transport import (
    GroupReceiver,
    GroupSender,
    InMemoryGroupChannel,
    InMemoryProgressChannel,
    ProgressPublisher,
    ProgressSubscriber,
    TransportError,
)

pytestmark = pytest.mark.timeout(60)
ANY_PORT = "tcp://127.0.0.1:*"


def group(i: int, num_tokens: int = 8) -> TrajectoryGroup:
    traj = Trajectory(
        tokens=np.arange(num_tokens) + i,
        loss_mask=np.ones(num_tokens),
        behavior_logprobs=np.full(num_tokens, -0.5),
        weight_versions=np.full(num_tokens, i),
        reward=float(i),
        metadata={"i": i},
    )
    return TrajectoryGroup(
        group_id=f"g{i}", task_id=f"t{i}", env="test", trajectories=[traj], actor_id="a0", session="s0", seq=i
    )


def assert_no_thread_named(prefix: str) -> None:
    assert not [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


# ------------------------------------------------------------------ trajectories


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request, tmp_path) -> str:
    return ANY_PORT if request.param == "tcp" else f"ipc://{tmp_path}/groups.sock"


def test_groups_arrive_in_order_from_trio(endpoint: str) -> None:
    with GroupReceiver(endpoint) as receiver:
        if endpoint.startswith("tcp"):
            assert receiver.endpoint.startswith("tcp://127.0.0.1:") and not receiver.endpoint.endswith(":*")

        async def main() -> list[TrajectoryGroup]:
            async with GroupSender(receiver.endpoint) as sender:
                for i in range(50):
                    await sender.send(group(i))
                got = [await trio.to_thread.run_sync(receiver.get, 10.0) for _ in range(50)]
                assert sender.stats["sent"] == 50
            return got

        got = trio.run(main)
        assert [g.group_id for g in got] == [f"g{i}" for i in range(50)]
        assert got[7].trajectories[0].weight_versions.tolist() == [7] * 8
        assert got[7].trajectories[0].metadata == {"i": 7}
        assert receiver.stats["received"] == 50 and receiver.stats["bytes"] > 50 * 8 * 13
        assert receiver.stats["malformed"] == 0
        assert receiver.get(timeout_s=0.05) is None  # timeout, not an error


def test_many_actors_fan_in() -> None:
    with GroupReceiver(ANY_PORT) as receiver:
        ids: list[str] = []

        async def actor(k: int, all_received: trio.Event) -> None:
            async with GroupSender(receiver.endpoint) as sender:
                for i in range(20):
                    await sender.send(group(100 * k + i))
                await all_received.wait()  # closing drops what is in flight

        async def learner(all_received: trio.Event) -> None:
            for _ in range(60):
                ids.append((await trio.to_thread.run_sync(receiver.get, 10.0)).group_id)
            all_received.set()

        async def main() -> None:
            all_received = trio.Event()
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(learner, all_received)
                    for k in range(3):
                        nursery.start_soon(actor, k, all_received)

        trio.run(main)
        assert sorted(ids) == sorted(f"g{100 * k + i}" for k in range(3) for i in range(20))
        for k in range(3):  # each actor's groups stay in order
            mine = [int(x[1:]) for x in ids if int(x[1:]) // 100 == k]
            assert mine == sorted(mine)


def test_back_pressure_blocks_send_and_loses_nothing(tmp_path) -> None:
    big = 64 * 1024  # 832 KB groups: the kernel's socket buffers hold only a few of them
    with GroupReceiver(f"ipc://{tmp_path}/bp.sock", max_queued_groups=2) as receiver:

        async def main() -> None:
            async with GroupSender(receiver.endpoint, max_queued_groups=2) as sender:
                sent = 0
                with trio.move_on_after(1.0) as scope:
                    while sent < 100:
                        await sender.send(group(sent, big))
                        sent += 1
                assert scope.cancelled_caught, "send() should block when nobody reads"
                assert 4 <= sent < 40  # bounded: the queues on both sides plus kernel buffers
                assert sender.stats["waits"] >= 1 and sender.stats["sent"] == sent

                async def consume() -> list[str]:
                    return [(await trio.to_thread.run_sync(receiver.get, 10.0)).group_id for _ in range(sent + 5)]

                async with trio.open_nursery() as nursery:  # reading again unblocks the sender
                    result: list[list[str]] = []
                    nursery.start_soon(lambda: _collect(consume, result))
                    for i in range(sent, sent + 5):
                        await sender.send(group(i, big))
                assert result[0] == [f"g{i}" for i in range(sent + 5)]

        trio.run(main)


async def _collect(fn, out: list) -> None:
    out.append(await fn())


def test_malformed_messages_are_counted_and_dropped(endpoint: str) -> None:
    with GroupReceiver(endpoint) as receiver:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(receiver.endpoint)
        wrong_version = msgpack.unpackb(encode(group(1)))
        wrong_version["v"] = 999
        push.send(b"\x00garbage")
        push.send(msgpack.packb(wrong_version))
        push.send(encode(Progress(policy_version=1, accept_groups=1)))  # wrong kind for this channel
        push.send(encode(group(1))[:-5])  # truncated
        push.send_multipart([b"a", b"b"])  # a stranger's two frames: two malformed messages
        push.send(encode(group(2)))
        try:
            got = receiver.get(timeout_s=10)
            assert got is not None and got.group_id == "g2"
            assert receiver.stats["malformed"] == 6 and receiver.stats["received"] == 1
            assert receiver.last_malformed == "message is a msgpack int, not a map"  # b"b" is the int 98
            assert receiver.get(timeout_s=0.05) is None
        finally:
            push.close(linger=0)
            ctx.term()


def _mutations(rng: random.Random, wire: bytes, n: int) -> list[bytes]:
    """Fuzzed copies of one encoded message: truncated, byte-flipped, or a field replaced."""
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            out.append(wire[: rng.randrange(len(wire))])
        elif kind == 1:
            raw = bytearray(wire)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            out.append(bytes(raw))
        else:
            d = msgpack.unpackb(wire, raw=False)
            key = rng.choice(sorted(d))
            d[key] = rng.choice([None, -1, 2**63, "", b"x", [], {}, [[0, 1]], 1.5, True])
            out.append(msgpack.packb(d, use_bin_type=True))
    return out


def test_fuzzed_frames_are_delivered_or_counted_never_raised() -> None:
    """Through a real socket: every frame either arrives as a valid group or is counted malformed."""
    rng = random.Random(7)
    ack = ActorAck("a0", groups=3, session="s0", session_groups=2, acked=[(0, 0), (2, 2)])
    frames = _mutations(rng, encode(group(1)), 150)
    frames += _mutations(
        rng, encode(Progress(policy_version=1, accept_groups=2, learner_session="L", actors=[ack])), 50
    )
    with GroupReceiver(ANY_PORT) as receiver:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(receiver.endpoint)
        try:
            for frame in frames:
                push.send(frame)
            push.send(encode(group(2)))  # the end marker
            got = []
            while not got or got[-1].group_id != "g2":
                g = receiver.get(timeout_s=10)
                assert g is not None
                got.append(g)
            assert receiver.stats["received"] + receiver.stats["malformed"] == len(frames) + 1
            assert receiver.stats["malformed"] >= 150  # most mutations break something
            assert all(isinstance(g, TrajectoryGroup) and g.seq >= 0 and g.actor_id for g in got)
        finally:
            push.close(linger=0)
            ctx.term()


def test_sender_encodes_in_the_caller() -> None:
    with GroupReceiver(ANY_PORT) as receiver:
        bad = group(0)
        bad.trajectories[0].metadata = {"x": object()}

        async def main() -> None:
            async with GroupSender(receiver.endpoint) as sender:
                with pytest.raises(ProtocolError, match="object"):
                    await sender.send(bad)
                await sender.send(group(1))
                assert (await trio.to_thread.run_sync(receiver.get, 10.0)).group_id == "g1"

        trio.run(main)


def test_close_is_prompt_with_no_peer_and_wakes_waiting_senders(tmp_path) -> None:
    """linger 0: closing a sender whose learner never came does not hang, and the tasks
    waiting in send() (the queue is full) get ClosedResourceError."""

    async def main() -> None:
        sender = GroupSender(f"ipc://{tmp_path}/nobody.sock", max_queued_groups=2)
        errors: list[BaseException] = []

        async def keep_sending() -> None:
            try:
                for i in range(100):
                    await sender.send(group(i))
            except trio.ClosedResourceError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(keep_sending)
            await wait_all_tasks_blocked()
            assert sender.stats["sent"] == 2 and sender.stats["waits"] == 2  # both blocked
            t0 = time.monotonic()
            await sender.aclose()
            assert time.monotonic() - t0 < 1.0
        assert len(errors) == 2
        with pytest.raises(trio.ClosedResourceError):
            await sender.send(group(0))
        await sender.aclose()  # idempotent

    trio.run(main)


def test_get_from_another_thread_returns_when_closed() -> None:
    receiver = GroupReceiver(ANY_PORT)
    results: list = []
    t = threading.Thread(target=lambda: results.append(receiver.get()))
    t.start()
    deadline = time.monotonic() + 10
    while not receiver._lock.locked():  # held by the get() waiting on the socket
        assert time.monotonic() < deadline, "get() never started waiting"
        time.sleep(0.001)
    receiver.close()
    t.join(5)
    assert not t.is_alive() and results == [None]
    with pytest.raises(TransportError, match="closed"):
        receiver.get(0)


def test_bind_conflict_and_bad_endpoint_name_the_endpoint() -> None:
    with GroupReceiver(ANY_PORT) as first:
        with pytest.raises(TransportError, match=first.endpoint.replace(".", r"\.")):
            GroupReceiver(first.endpoint)
    with pytest.raises(TransportError, match="nonsense"):
        GroupReceiver("nonsense://x")
    with pytest.raises(TransportError, match="connect"):
        GroupSender("tcp://")


# ------------------------------------------------------------------ progress


def test_progress_reaches_late_subscribers_through_heartbeat() -> None:
    with ProgressPublisher(ANY_PORT, heartbeat_s=0.1) as pub:
        pub.publish(Progress(policy_version=3, accept_groups=40))  # nobody is listening yet

        async def main() -> None:
            async with ProgressSubscriber(pub.endpoint) as sub:
                assert sub.latest is None
                with trio.fail_after(10):
                    first = await sub.receive()
                assert first.policy_version == 3 and first.accept_groups == 40
                pub.publish(Progress(policy_version=4, accept_groups=56, step=1))
                with trio.fail_after(10):
                    while (await sub.receive()).policy_version != 4:
                        pass
                assert sub.latest == Progress(policy_version=4, accept_groups=56, step=1)
                assert sub.stats["malformed"] == 0

        trio.run(main)
    assert_no_thread_named("agentrl-progress")


def test_progress_fans_out_and_receive_can_be_cancelled(tmp_path) -> None:
    with ProgressPublisher(f"ipc://{tmp_path}/progress.sock", heartbeat_s=0) as pub:

        async def main() -> None:
            subs = [ProgressSubscriber(pub.endpoint) for _ in range(3)]
            with trio.move_on_after(0.3) as scope:  # nothing published: receive waits, cancellably
                await subs[0].receive()
            assert scope.cancelled_caught
            with trio.fail_after(10):
                # publish until every subscriber has joined (no heartbeat here)
                while not all(s.latest for s in subs):
                    pub.publish(Progress(policy_version=1, accept_groups=8))
                    await trio.sleep(0.05)
                pub.publish(Progress(policy_version=2, accept_groups=8, done=True))
                for s in subs:
                    while not (await s.receive()).done:
                        pass
            for s in subs:
                await s.aclose()

        trio.run(main)


def test_subscriber_keeps_only_the_newest_messages() -> None:
    with ProgressPublisher(ANY_PORT, heartbeat_s=0) as pub:

        async def main() -> None:
            async with ProgressSubscriber(pub.endpoint, max_buffered=4) as sub:
                with trio.fail_after(10):
                    while sub.latest is None:
                        pub.publish(Progress(policy_version=0, accept_groups=0))
                        await trio.sleep(0.05)
                    for v in range(1, 21):
                        pub.publish(Progress(policy_version=v, accept_groups=v))
                    while sub.latest.policy_version != 20:
                        await trio.sleep(0.01)
                assert [(await sub.receive()).policy_version for _ in range(4)] == [17, 18, 19, 20]

        trio.run(main)


def test_subscriber_counts_malformed_progress() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ANY_PORT)
    try:

        async def main() -> None:
            async with ProgressSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT)) as sub:
                with trio.fail_after(10):
                    while sub.latest is None:
                        pub.send(b"junk")
                        pub.send(encode(group(0)))
                        pub.send(encode(Progress(policy_version=9, accept_groups=1)))
                        await trio.sleep(0.05)
                assert sub.latest.policy_version == 9
                assert sub.stats["malformed"] >= 2

        trio.run(main)
    finally:
        pub.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------ in-memory twins


def test_in_memory_group_channel_behaves_like_the_sockets() -> None:
    chan = InMemoryGroupChannel(max_queued_groups=3)

    async def main() -> None:
        for i in range(3):
            await chan.send(group(i))
        with trio.move_on_after(0.2) as scope:
            await chan.send(group(3))  # full: waits
        assert scope.cancelled_caught
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chan.send, group(3))
            await wait_all_tasks_blocked()  # the send waits for room
            assert chan.get(0).group_id == "g0"  # makes room; the pending send completes
        bad = group(9)
        bad.trajectories[0].metadata = {"x": object()}
        with pytest.raises(ProtocolError):
            await chan.send(bad)

    trio.run(main)
    got = [chan.get(0) for _ in range(3)]
    assert [g.group_id for g in got] == ["g1", "g2", "g3"]
    assert not got[0].trajectories[0].tokens.flags.writeable  # exactly what the wire gives
    assert chan.get(timeout_s=0.01) is None
    chan.send_nowait(group(5))
    assert chan.get(0).group_id == "g5"
    assert chan.stats["received"] == 5 and chan.stats["sent"] == 5


def test_in_memory_progress_channel() -> None:
    chan = InMemoryProgressChannel(max_buffered=2)
    assert chan.latest is None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            got: list[Progress] = []

            async def waiter() -> None:
                got.append(await chan.receive())

            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            chan.publish(Progress(policy_version=1, accept_groups=2))
        assert got[0].policy_version == 1
        for v in (2, 3, 4):
            chan.publish(Progress(policy_version=v, accept_groups=2))
        assert [(await chan.receive()).policy_version for _ in range(2)] == [3, 4]
        assert chan.latest.policy_version == 4

    trio.run(main)
