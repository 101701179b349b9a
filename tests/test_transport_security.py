"""CURVE on the trajectory and progress sockets, over real ZMQ: who holds the run's key gets
through, nobody else does; plain TCP beyond loopback is refused unless the user opts out."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio
import zmq

from agentrl.protocol import Progress, Trajectory, TrajectoryGroup, encode
from agentrl.transport import (
    ChannelSecurity,
    CurveKey,
    GroupReceiver,
    GroupSender,
    ProgressPublisher,
    ProgressSubscriber,
    TransportError,
    security_from_config,
)
from agentrl.transport.security import is_local

pytestmark = pytest.mark.timeout(60)
ANY_PORT = "tcp://127.0.0.1:*"


def group(i: int) -> TrajectoryGroup:
    traj = Trajectory(
        tokens=np.arange(4),
        loss_mask=np.ones(4),
        behavior_logprobs=np.full(4, -0.5),
        weight_versions=np.zeros(4),
        reward=1.0,
    )
    return TrajectoryGroup(
        group_id=f"g{i}", task_id="t", env="test", trajectories=[traj], actor_id="a0", session="s", seq=i
    )


def curve() -> ChannelSecurity:
    return ChannelSecurity(curve=CurveKey.from_secret(zmq.curve_keypair()[1].decode(), source="test"))


def raw_push(endpoint: str, *, server_key: bytes | None = None, client: tuple[bytes, bytes] | None = None):
    """A stranger's PUSH socket: plain, or CURVE with a key pair of its own."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    if server_key is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = client or zmq.curve_keypair()
    sock.connect(endpoint)
    return ctx, sock


def try_send(sock, data: bytes) -> None:
    """Send without blocking: a refused handshake can leave a PUSH socket with no peer at all."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        pass


async def send_and_receive(
    receiver: GroupReceiver, security: ChannelSecurity, groups: list[TrajectoryGroup], wait_s: float
) -> list[TrajectoryGroup | None]:
    """Send ``groups`` and take as many from ``receiver`` (None where ``wait_s`` passed) while the sender is
    still open: it closes with linger 0, which drops what ZMQ has not written yet."""
    async with GroupSender(receiver.endpoint, security=security) as sender:
        # without the key, the refused handshake can leave no peer to queue for: send then waits
        with trio.move_on_after(5):
            for g in groups:
                await sender.send(g)
        return [await trio.to_thread.run_sync(receiver.get, wait_s) for _ in groups]


def test_only_holders_of_the_key_can_push_groups() -> None:
    sec = curve()
    with GroupReceiver(ANY_PORT, security=sec) as receiver:
        strangers = [
            raw_push(receiver.endpoint),  # plain TCP
            raw_push(receiver.endpoint, server_key=sec.curve.public),  # knows the learner's public key, not the secret
            raw_push(receiver.endpoint, server_key=zmq.curve_keypair()[0]),  # a wrong server key
        ]
        for _, sock in strangers:
            try_send(sock, encode(group(99)))
        # our own sender without the key
        assert trio.run(send_and_receive, receiver, ChannelSecurity(), [group(98)], 1.0) == [None]
        got = trio.run(send_and_receive, receiver, sec, [group(0), group(1)], 5.0)
        assert [g.group_id for g in got] == ["g0", "g1"]
        assert receiver.get(timeout_s=0.5) is None
        assert receiver.stats["received"] == 2 and receiver.stats["malformed"] == 0  # strangers never reached us
        for ctx, sock in strangers:
            sock.close(0)
            ctx.term()


def test_a_key_holder_sending_garbage_is_counted_and_dropped() -> None:
    sec = curve()
    with GroupReceiver(ANY_PORT, security=sec) as receiver:
        ctx, sock = raw_push(
            receiver.endpoint, server_key=sec.curve.public, client=(sec.curve.public, sec.curve.secret)
        )
        sock.send(b"\x93not a group")
        sock.send(encode(group(5)))
        got = receiver.get(timeout_s=5.0)
        assert got is not None and got.seq == 5
        assert receiver.stats["malformed"] == 1 and "not a msgpack message" in receiver.last_malformed
        sock.close(0)
        ctx.term()


def test_only_holders_of_the_key_can_read_progress() -> None:
    sec = curve()
    with ProgressPublisher(ANY_PORT, security=sec, heartbeat_s=0.05) as publisher:
        publisher.publish(Progress(policy_version=3, accept_groups=7, learner_session="L"))

        async def main() -> None:
            async with (
                ProgressSubscriber(publisher.endpoint, security=sec) as ours,
                ProgressSubscriber(publisher.endpoint) as plain,
                ProgressSubscriber(publisher.endpoint, security=curve()) as other_key,
            ):
                with trio.fail_after(10):
                    assert (await ours.receive()).accept_groups == 7
                with trio.move_on_after(1.0):  # 20 heartbeats went out meanwhile
                    await plain.receive()
                    raise AssertionError("a subscriber without the key read progress")
                with trio.move_on_after(0.5):
                    await other_key.receive()
                    raise AssertionError("a subscriber with another key read progress")
                assert plain.latest is None and other_key.latest is None

        trio.run(main)


def test_plain_tcp_beyond_loopback_is_refused_unless_allowed() -> None:
    for endpoint in ("tcp://0.0.0.0:*", "tcp://*:*"):
        with pytest.raises(TransportError, match="allow_plaintext_network") as err:
            GroupReceiver(endpoint)
        assert endpoint in str(err.value) and "curve_secret_key_env" in str(err.value)
        with pytest.raises(TransportError, match="without encryption"):
            ProgressPublisher(endpoint)
    with pytest.raises(TransportError, match="refusing to connect"):
        ProgressSubscriber("tcp://10.9.8.7:5558")
    with pytest.raises(TransportError, match="refusing to connect"):
        GroupSender("tcp://example.org:5557")
    with GroupReceiver("tcp://0.0.0.0:*", security=ChannelSecurity(allow_plaintext_network=True)) as r:
        assert r.endpoint.startswith("tcp://0.0.0.0:")
    with GroupReceiver("tcp://0.0.0.0:*", security=curve()) as r:  # with the key it is fine
        assert r.endpoint.startswith("tcp://0.0.0.0:")


@pytest.mark.parametrize(
    "endpoint,local",
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.8.0.1:1", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("tcp://lo:5557", True),
        ("ipc:///tmp/x.sock", True),
        ("inproc://x", True),
        ("tcp://127.0.0.1;10.0.0.2:5557", False),
        ("tcp://10.0.0.2;127.0.0.1:5557", True),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False),
        ("tcp://eth0:5557", False),
        ("tcp://[::]:5557", False),
        ("tcp://host.example:5557", False),
        ("ws://127.0.0.1:5557", False),
        ("epgm://eth0;239.0.0.1:5555", False),
        ("garbage", False),
    ],
)
def test_what_counts_as_loopback(endpoint: str, local: bool) -> None:
    assert is_local(endpoint) is local


def test_the_key_comes_from_the_environment_or_a_file(monkeypatch, tmp_path) -> None:
    actors = SimpleNamespace(curve_secret_key_env="MY_RUN_KEY", allow_plaintext_network=False)
    monkeypatch.delenv("MY_RUN_KEY", raising=False)
    monkeypatch.delenv("MY_RUN_KEY_FILE", raising=False)
    assert security_from_config(actors) == ChannelSecurity()
    public, secret = zmq.curve_keypair()
    monkeypatch.setenv("MY_RUN_KEY", secret.decode())
    assert security_from_config(actors).curve == CurveKey(secret=secret, public=public)
    monkeypatch.delenv("MY_RUN_KEY")
    (tmp_path / "key").write_text(secret.decode() + "\n")
    monkeypatch.setenv("MY_RUN_KEY_FILE", str(tmp_path / "key"))
    assert security_from_config(actors).curve.public == public
    (tmp_path / "key").write_text("not-a-key")
    with pytest.raises(ValueError, match=r"\$MY_RUN_KEY is not a CURVE secret key"):
        security_from_config(actors)


def test_closing_the_publisher_delivers_what_it_published_last() -> None:
    """The learner's final ``done`` used to be lost: the socket closed with linger 0."""
    for round_ in range(5):
        publisher = ProgressPublisher(ANY_PORT, heartbeat_s=0)

        async def main() -> Progress:
            async with ProgressSubscriber(publisher.endpoint) as sub:
                with trio.fail_after(10):
                    while sub.latest is None:  # connected and subscribed
                        publisher.publish(Progress(policy_version=0, accept_groups=1))
                        await trio.sleep(0.02)
                    for i in range(50):
                        publisher.publish(Progress(policy_version=i, accept_groups=1))
                    publisher.publish(Progress(policy_version=99, accept_groups=0, done=True))
                    started = time.monotonic()
                    await trio.to_thread.run_sync(publisher.close)
                    assert time.monotonic() - started < 2.5  # bounded by the linger
                    while True:
                        msg = await sub.receive()
                        if msg.done:
                            return msg

        assert trio.run(main).policy_version == 99, round_


def test_a_sender_the_learner_refuses_says_so(monkeypatch, caplog) -> None:
    """Without the key the handshake fails and sends wait: the sender says why it may be."""
    monkeypatch.setattr(GroupSender, "_WARN_EVERY_S", 0.3)
    with GroupReceiver(ANY_PORT, security=curve()) as receiver:

        async def main() -> None:
            async with GroupSender(receiver.endpoint, max_queued_groups=1) as sender:
                with trio.move_on_after(1.5):
                    for i in range(100):
                        await sender.send(group(i))

        trio.run(main)
        assert receiver.stats["received"] == 0
    assert "refusing this side's CURVE key" in caplog.text and receiver.endpoint in caplog.text
