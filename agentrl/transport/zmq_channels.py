"""The ZeroMQ channels between actors and learner (the learner binds, actors connect).

Trajectories, ZMQ PUSH/PULL: :class:`GroupSender` (trio) hands bytes to ZMQ from the caller's thread
with ``NOBLOCK`` and waits on the socket's descriptor only when ZMQ's queue is full;
:class:`GroupReceiver` receives in the learner's thread. Progress, ZMQ PUB/SUB: a daemon thread owns
each socket and talks to its users through a :class:`~agentrl.transport.mailbox.Mailbox`; the
publisher repeats its latest message every ``heartbeat_s`` (PUB drops messages for subscribers not
yet connected), and :attr:`ProgressSubscriber.latest` stays current when no task reads.

Invariants: nothing busy-waits, and closing wakes blocked callers; every queue is bounded
(``max_queued_groups``), so a learner that stops reading makes :meth:`GroupSender.send` wait and
nothing is dropped while both ends are open; malformed messages are counted in
``stats["malformed"]`` (``last_malformed`` says why), logged and dropped; beyond loopback CURVE is
required (``security=``). ``PushSocket``/``PullSocket`` are the byte layer under the group classes.
See docs/transport.md; measurements in docs/performance.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio
import zmq

from agentrl.protocol import Progress, ProtocolError, TrajectoryGroup, decode, encode
from agentrl.transport.base import GroupSink, GroupSource, ProgressSink, ProgressSource, TransportError
from agentrl.transport.mailbox import Mailbox
from agentrl.transport.security import PLAINTEXT, ChannelSecurity

log = logging.getLogger(__name__)

T = TypeVar("T")


# ---------------------------------------------------------------------------- socket thread


class _PrivateContext:
    """A one-I/O-thread ZMQ context for one socket, with the CURVE authenticator its socket
    needs when it is a CURVE server (see :mod:`agentrl.transport.security`)."""

    def __init__(self, security: ChannelSecurity, bind: bool) -> None:
        self.ctx = zmq.Context(io_threads=1)
        try:
            self._auth = security.start_authenticator(self.ctx, bind)
        except BaseException:
            self.ctx.term()
            raise

    def term(self) -> None:
        """Stop the authenticator, then terminate: wakes blocked calls with ETERM and returns
        once every socket of the context is closed (and their linger has passed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()


def _own_socket(
    name: str, socket_type: int, endpoint: str, bind: bool, options: dict[int, Any], security: ChannelSecurity
) -> tuple[_PrivateContext, zmq.Socket, str]:
    """A private context and its socket (see :func:`_open_socket`); the context is terminated
    again when the socket cannot be opened."""
    security.check(name, endpoint, bind)
    ctx = _PrivateContext(security, bind)
    try:
        sock, address = _open_socket(ctx.ctx, name, socket_type, endpoint, bind, options, security)
    except TransportError:
        ctx.term()
        raise
    return ctx, sock, address


def _open_socket(
    ctx: zmq.Context,
    name: str,
    socket_type: int,
    endpoint: str,
    bind: bool,
    options: dict[int, Any],
    security: ChannelSecurity,
) -> tuple[zmq.Socket, str]:
    """A socket with linger 0, ``options`` and the security's CURVE options, bound or connected;
    returns it and the address actually bound (a ``*`` or ``0`` port resolved). Failures name
    the endpoint."""
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        for opt, value in {**options, **security.socket_options(bind)}.items():
            sock.setsockopt(opt, value)
        if bind:
            sock.bind(endpoint)
            return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return sock, endpoint
    except (zmq.ZMQError, TypeError, ValueError) as e:
        sock.close(linger=0)
        verb = "bind" if bind else "connect"
        raise TransportError(f"cannot {verb} {name} socket to {endpoint!r}: {e}") from e


class _SocketThread:
    """Runs ``loop(socket)`` in a daemon thread that owns one ZMQ socket in a private context.

    The constructor returns once the socket is bound or connected, raising TransportError
    (naming the endpoint) when that fails. :meth:`stop` terminates the context, which makes
    every blocking ZMQ call in the thread raise ``ContextTerminated``, and joins the thread;
    ``stop(graceful=True)`` first waits for ``loop`` to return by itself (its caller has told
    it to) and then closes the socket with ``linger_ms``, so what it sent last goes out.
    """

    def __init__(
        self,
        name: str,
        socket_type: int,
        endpoint: str,
        bind: bool,
        options: dict[int, Any],
        loop: Callable[[zmq.Socket], None],
        on_exit: Callable[[], None],
        security: ChannelSecurity = PLAINTEXT,
        linger_ms: int = 0,
    ) -> None:
        security.check(name, endpoint, bind)
        self.requested_endpoint = endpoint
        self.endpoint = endpoint
        self._name = name
        self.error: BaseException | None = None
        self._bind = bind
        self._socket_type = socket_type
        self._options = options
        self._loop = loop
        self._on_exit = on_exit
        self._security = security
        self._linger_ms = linger_ms
        self._ready = threading.Event()
        self._stopped = False
        self._ctx = _PrivateContext(security, bind)
        self._thread = threading.Thread(target=self._main, name=f"agentrl-{name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            err = self.error
            self.stop()
            raise err

    def _main(self) -> None:
        try:
            sock, self.endpoint = _open_socket(
                self._ctx.ctx,
                self._name,
                self._socket_type,
                self.requested_endpoint,
                self._bind,
                self._options,
                self._security,
            )
        except Exception as e:  # never leave the constructor waiting
            self.error = e if isinstance(e, TransportError) else TransportError(f"{self._name}: {e}")
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(sock)
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # a bug: remember it for the caller, do not die silently
            log.exception("transport thread %s failed", threading.current_thread().name)
            self.error = e
        finally:
            sock.close(linger=self._linger_ms)
            self._on_exit()

    def stop(self, graceful: bool = False) -> None:
        """Close the socket and join the thread; idempotent (see the class docstring)."""
        if self._stopped:
            return
        self._stopped = True
        if graceful:
            self._thread.join()
        self._ctx.term()  # blocks until the thread has closed its socket (and its linger passed)
        self._thread.join()


def _recv_batch(sock: zmq.Socket, limit: int) -> list[bytes]:
    """Block for one message, then take up to ``limit`` in all without waiting.

    One frame is one message (agentrl never sends multi-frame messages; a stranger's frames
    are each dropped as malformed by the caller).
    """
    out = [sock.recv()]
    while len(out) < limit:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


class _MalformedLog:
    """Counts malformed messages and logs the first few, then every 1000th."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self.last = ""

    def add(self, reason: str) -> None:
        self.count += 1
        self.last = reason
        if self.count <= 5 or self.count % 1000 == 0:
            log.warning("dropped malformed %s message (%d so far): %s", self.what, self.count, reason)


def _decode_as(data: bytes, kind: type[T], bad: _MalformedLog) -> T | None:
    try:
        msg = decode(data)
    except ProtocolError as e:
        bad.add(str(e))
        return None
    if not isinstance(msg, kind):
        bad.add(f"expected a {kind.__name__}, got a {type(msg).__name__}")
        return None
    return msg


# ---------------------------------------------------------------------------- trajectories


class PullSocket:
    """A ZMQ PULL socket behind a synchronous, thread-safe ``get``: the byte layer under
    GroupReceiver.

    The caller's thread receives, in a blocking ``recv`` (with ``RCVTIMEO`` for a timeout):
    ZMQ's own I/O thread already buffers up to ``max_queued`` messages (the receive
    high-water mark) in the background, so a Python thread in between would only add a
    hand-off per message. :meth:`close` may come from another thread while a ``get`` is
    blocked: it terminates the socket's private context, which makes that ``recv`` fail
    with ETERM; whoever holds the socket last closes it.
    """

    _name = "pull"

    def __init__(
        self, endpoint: str, *, bind: bool = True, max_queued: int = 64, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._bad = _MalformedLog(self._name)
        self._received = 0
        self._bytes = 0
        self._closed = False
        self._sock_closed = False
        self._timeout_ms = -1  # the socket's current RCVTIMEO
        self._lock = threading.Lock()  # held by the get() that is using the socket
        self._close_lock = threading.Lock()
        self._ctx, self._sock, self.endpoint = _own_socket(
            self._name, zmq.PULL, endpoint, bind, {zmq.RCVHWM: max_queued}, security
        )

    def _convert(self, frame: bytes) -> Any | None:
        """What get() returns for one message; None drops it (counted as malformed)."""
        return frame

    def get(self, timeout_s: float | None = None) -> Any | None:
        """The next message, waiting up to ``timeout_s`` (None: forever); None on timeout
        or when another thread closes the socket meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self._closed:
            raise TransportError(f"{type(self).__name__}({self.endpoint}) is closed")
        with self._lock:
            try:
                while True:
                    if self._closed:
                        return None  # closed by another thread since this get() began
                    if deadline is None:
                        self._set_timeout(-1)
                    else:
                        remaining_ms = int(1000 * (deadline - time.monotonic()))
                        if remaining_ms <= 0:
                            return None
                        self._set_timeout(remaining_ms)
                    try:
                        # One frame is one message: agentrl never sends multi-frame messages,
                        # and a stranger's frames are each dropped as malformed.
                        frame = self._sock.recv()
                    except zmq.Again:
                        continue  # RCVTIMEO passed: the loop re-checks the deadline
                    except zmq.ContextTerminated:
                        return None  # closed by another thread
                    item = self._convert(frame)
                    if item is not None:
                        self._received += 1
                        self._bytes += len(frame)
                        return item
            finally:
                if self._closed:  # close() came while we held the socket: we close it
                    self._close_socket()

    def _set_timeout(self, ms: int) -> None:
        """Set RCVTIMEO, skipping the call (it costs as much as a recv) when the current
        value is within 1 ms + 1 % of the wanted one; -1 waits forever."""
        now = self._timeout_ms
        if now == ms or (ms >= 0 and now >= 0 and abs(now - ms) <= 1 + ms // 100):
            return
        self._sock.setsockopt(zmq.RCVTIMEO, ms)
        self._timeout_ms = ms

    def _close_socket(self) -> None:  # with self._lock held
        if not self._sock_closed:
            self._sock_closed = True
            self._sock.close(linger=0)

    @property
    def stats(self) -> dict[str, int]:
        return {
            "received": self._received,  # well-formed messages returned by get()
            "malformed": self._bad.count,  # counted and dropped
            "bytes": self._bytes,
        }

    @property
    def last_malformed(self) -> str:
        """Why the last malformed message was dropped ('' if none was)."""
        return self._bad.last

    def close(self) -> None:
        """Close (linger 0); a get() blocked in another thread returns None. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True  # from here on, a get() closes the socket before it lets go of it
        if self._lock.acquire(blocking=False):
            try:
                self._close_socket()
            finally:
                self._lock.release()
        self._ctx.term()  # wakes a blocked recv (ETERM); returns once the socket is closed

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GroupReceiver(PullSocket, GroupSource):
    """Learner side of the trajectory channel: ZMQ PULL, synchronous API.

    :meth:`get` returns a :class:`TrajectoryGroup`. Malformed messages never reach the
    caller: they are counted in ``stats["malformed"]`` and logged (``last_malformed`` says
    why the last one was dropped). Up to ``max_queued_groups`` wait in ZMQ's queue; past
    that the kernel's socket buffers fill and then the actors' ``send`` waits.
    """

    _name = "group-receiver"

    def __init__(
        self, endpoint: str, *, bind: bool = True, max_queued_groups: int = 64, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        super().__init__(endpoint, bind=bind, max_queued=max_queued_groups, security=security)

    def _convert(self, frame: bytes) -> TrajectoryGroup | None:
        return _decode_as(frame, TrajectoryGroup, self._bad)

    def get(self, timeout_s: float | None = None) -> TrajectoryGroup | None:
        return super().get(timeout_s)


class PushSocket:
    """A ZMQ PUSH socket usable from trio: the byte layer under GroupSender.

    :meth:`send` hands the bytes to ZMQ without blocking (``NOBLOCK``); ZMQ's I/O thread
    writes them out. Only when ``max_queued`` messages are waiting in ZMQ (the send
    high-water mark: the learner is not keeping up) does it wait, in trio, for the socket's
    file descriptor, re-checking ``ZMQ_EVENTS`` before every wait (the descriptor is
    edge-triggered). Tasks that have to wait go in FIFO order, and a new send does not
    overtake them. ``send`` is always a cancellation point but yields to other tasks only
    when it waits or when it has not yielded for ``_YIELD_EVERY_S``: a trio checkpoint costs
    about as much as the send itself, and actors send one group per finished task.

    Use it from one trio thread. Delivery is not confirmed: closing (linger 0) drops what
    ZMQ still holds.
    """

    _name = "push"
    _YIELD_EVERY_S = 0.001
    _WARN_EVERY_S = 60.0  # a send blocked this long says why it may be (every as long again)

    def __init__(
        self, endpoint: str, *, bind: bool = False, max_queued: int = 16, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._sent = 0
        self._waits = 0
        self._closed = False
        self._last_yield = 0.0
        self._wait_lock = trio.Lock()
        self._ctx, self._sock, self.endpoint = _own_socket(
            self._name, zmq.PUSH, endpoint, bind, {zmq.SNDHWM: max_queued}, security
        )
        self._fd = self._sock.fileno()  # zmq.FD

    def _try_send(self, data: bytes) -> bool:
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._sent += 1
        return True

    async def send(self, data: bytes) -> None:
        """Hand one message to ZMQ; waits while ``max_queued`` are waiting there."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        if not self._wait_lock.locked() and self._try_send(data):
            now = time.monotonic()
            if now - self._last_yield > self._YIELD_EVERY_S:
                self._last_yield = now
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self._waits += 1
        async with self._wait_lock:
            started = warned = time.monotonic()
            while True:
                self._check_open()  # another task may have closed the socket while we waited
                if self._try_send(data):
                    break
                if not int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:  # an int option (typed int | bytes)
                    with trio.move_on_after(self._WARN_EVERY_S):
                        await trio.lowlevel.wait_readable(self._fd)  # ClosedResourceError on close
                    if time.monotonic() - warned >= self._WARN_EVERY_S:
                        warned = time.monotonic()
                        log.warning(
                            "sending to %s has waited %.0f s: the receiver is not taking messages (busy, not "
                            "running, or refusing this side's CURVE key: see actors.curve_secret_key_env)",
                            self.endpoint,
                            warned - started,
                        )
        self._last_yield = time.monotonic()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"{type(self).__name__}({self.endpoint}) is closed")

    @property
    def stats(self) -> dict[str, int]:
        return {"sent": self._sent, "waits": self._waits}  # waits: sends that met back-pressure

    def close(self) -> None:
        """Close (linger 0): what ZMQ still holds is dropped; waiting sends raise
        trio.ClosedResourceError. Call it from the trio thread that sends. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:  # outside trio: nobody can be waiting
            pass
        self._sock.close(linger=0)
        self._ctx.term()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class GroupSender(PushSocket, GroupSink):
    """Actor side of the trajectory channel: ZMQ PUSH, usable from trio.

    :meth:`send` encodes in the calling task, so a group that cannot be encoded raises
    :class:`ProtocolError` there, then hands it to ZMQ like :meth:`PushSocket.send`.
    """

    _name = "group-sender"

    def __init__(
        self, endpoint: str, *, bind: bool = False, max_queued_groups: int = 16, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        super().__init__(endpoint, bind=bind, max_queued=max_queued_groups, security=security)

    async def send(self, group: TrajectoryGroup) -> None:  # type: ignore[override]
        """Send one group to the learner; waits while ``max_queued_groups`` are waiting."""
        await super().send(encode(group))


# ---------------------------------------------------------------------------- progress


class ProgressPublisher(ProgressSink):
    """Learner side of the progress channel: ZMQ PUB, synchronous API.

    :meth:`publish` never blocks. The socket thread sends every published message and,
    when nothing new was published for ``heartbeat_s`` seconds, repeats the latest one
    for subscribers that joined late (0 disables the repeat). :meth:`close` sends what was
    published before it and lets ZMQ deliver it to the connected subscribers for up to
    ``close_linger_s`` (the learner's final ``done`` was lost with linger 0).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool = True,
        heartbeat_s: float = 1.0,
        close_linger_s: float = 2.0,
        security: ChannelSecurity = PLAINTEXT,
    ) -> None:
        if heartbeat_s < 0:
            raise ValueError(f"heartbeat_s must be >= 0, got {heartbeat_s}")
        self._heartbeat_s = heartbeat_s or None
        self._box: Mailbox[bytes] = Mailbox(64, drop_oldest=True)
        self._published = 0
        self._closed = False
        self._thread = _SocketThread(
            "progress-publisher",
            zmq.PUB,
            endpoint,
            bind,
            {zmq.SNDHWM: 64},
            self._loop,
            on_exit=self._box.close,
            security=security,
            linger_ms=int(1000 * close_linger_s),
        )
        self.endpoint = self._thread.endpoint

    def _loop(self, sock: zmq.Socket) -> None:
        latest: bytes | None = None
        while True:
            batch = self._box.take_all(self._heartbeat_s)
            for data in batch:
                sock.send(data)
            if self._box.closed:
                return  # after sending what was published before close(); the linger delivers it
            if batch:
                latest = batch[-1]
            elif latest is not None:
                sock.send(latest)  # heartbeat: the same state again

    def publish(self, progress: Progress) -> None:
        if self._closed:
            raise TransportError(f"ProgressPublisher({self.endpoint}) is closed")
        if not self._box.put_nowait(encode(progress)):
            raise TransportError(f"ProgressPublisher({self.endpoint}) thread failed: {self._thread.error}")
        self._published += 1

    @property
    def stats(self) -> dict[str, int]:
        return {"published": self._published}

    def close(self) -> None:
        """Send what was published, give connected subscribers up to ``close_linger_s`` to get
        it, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._box.close(discard=False)
        self._thread.stop(graceful=True)

    def __enter__(self) -> ProgressPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProgressSubscriber(ProgressSource):
    """Actor side of the progress channel: ZMQ SUB, usable from trio.

    :meth:`receive` returns the next message in order (heartbeat repeats included); the
    newest ``max_buffered`` unread ones are kept. :attr:`latest` is the last message seen,
    whether or not anyone called :meth:`receive`.
    """

    def __init__(
        self, endpoint: str, *, bind: bool = False, max_buffered: int = 64, security: ChannelSecurity = PLAINTEXT
    ) -> None:
        self._box: Mailbox[Progress] = Mailbox(max_buffered, drop_oldest=True)
        self._bad = _MalformedLog("progress")
        self._received = 0
        self._closed = False
        self.latest: Progress | None = None
        self._thread = _SocketThread(
            "progress-subscriber",
            zmq.SUB,
            endpoint,
            bind,
            {zmq.SUBSCRIBE: b"", zmq.RCVHWM: max_buffered},
            self._loop,
            on_exit=lambda: self._box.close(discard=False),
            security=security,
        )
        self.endpoint = self._thread.endpoint

    def _loop(self, sock: zmq.Socket) -> None:
        while True:
            frames = _recv_batch(sock, self._box.maxlen)
            msgs = [m for m in (_decode_as(f, Progress, self._bad) for f in frames) if m is not None]
            if msgs:
                self._received += len(msgs)
                self.latest = msgs[-1]
                self._box.put_many(msgs)

    async def receive(self) -> Progress:
        """The next progress message (callers bound the wait with trio.fail_after)."""
        try:
            return await self._box.aget()
        except trio.ClosedResourceError:
            if self._thread.error is not None:
                raise TransportError(
                    f"ProgressSubscriber({self.endpoint}) thread failed: {self._thread.error}"
                ) from None
            raise

    @property
    def stats(self) -> dict[str, int]:
        return {"received": self._received, "malformed": self._bad.count, "queued": len(self._box)}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._box.close()
        self._thread.stop()

    async def aclose(self) -> None:
        if self._closed:
            return
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> ProgressSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
