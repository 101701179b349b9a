"""CURVE encryption and authentication of the trajectory and progress sockets.

One secret per run: a CURVE secret key (40 characters of Z85) read from the environment variable
that ``actors.curve_secret_key_env`` names (``AGENTRL_CURVE_SECRET_KEY``, or its ``_FILE``), never
from the config or the run folder. Make one with
``python -c "import zmq; print(zmq.curve_keypair()[1].decode())"``.

The learner binds as the CURVE server with that key pair; actors and ``agentrl run``'s progress
view connect as clients with the same pair, and a ZAP handler admits only that public key. So
pushing a group, reading progress and posing as the learner all need the secret.

Invariant: plain TCP is refused for an endpoint beyond loopback unless a key is set or
``actors.allow_plaintext_network = true``; on loopback, ``ipc://`` and ``inproc://`` the key is
used when set. See docs/transport.md.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import zmq

from agentrl.transport.base import TransportError

log = logging.getLogger(__name__)

_LOCAL_TRANSPORTS = ("ipc", "inproc")


def is_local(endpoint: str) -> bool:
    """Whether ``endpoint`` stays on this machine: ipc/inproc, or TCP on a loopback address."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in _LOCAL_TRANSPORTS:
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(";")[2].rpartition(":")[0].strip("[]")  # "src;host:port" connects from src
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", a host name or an interface name: assume the network
        return False


@dataclass(frozen=True)
class CurveKey:
    """A CURVE key pair (Z85 bytes) derived from its secret half."""

    secret: bytes
    public: bytes

    @classmethod
    def from_secret(cls, secret: str, *, source: str) -> CurveKey:
        raw = secret.strip().encode()
        try:
            if len(raw) != 40:
                raise ValueError(f"{len(raw)} characters")
            public = zmq.curve_public(raw)
        except (ValueError, zmq.ZMQError) as e:
            raise ValueError(
                f"{source} is not a CURVE secret key (40 characters of Z85, e.g. from "
                f'python -c "import zmq; print(zmq.curve_keypair()[1].decode())"): {e}'
            ) from None
        return cls(secret=raw, public=public)


class _AdmitOne:
    """ZAP credentials provider: admits exactly one client public key (pyzmq passes it in Z85)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = key == self.public
        if not admitted:
            log.warning("refused a CURVE client with an unknown key")
        return admitted


@dataclass(frozen=True)
class ChannelSecurity:
    """How the trajectory and progress sockets protect themselves (module docstring)."""

    curve: CurveKey | None = None
    allow_plaintext_network: bool = False

    def check(self, name: str, endpoint: str, bind: bool) -> None:
        """Refuse plain TCP beyond loopback unless explicitly allowed."""
        if self.curve is None and not self.allow_plaintext_network and not is_local(endpoint):
            verb = "bind" if bind else "connect"
            raise TransportError(
                f"refusing to {verb} the {name} socket to {endpoint!r} without encryption: it is not a loopback "
                f"address. Set the CURVE secret key (the environment variable named by actors.curve_secret_key_env) "
                f"on the learner and every actor, or set actors.allow_plaintext_network = true on a network you trust"
            )

    def socket_options(self, bind: bool) -> dict[int, Any]:
        """CURVE options for a socket: the binding side is the server, the connecting side the client."""
        if self.curve is None:
            return {}
        key = self.curve
        if bind:
            return {zmq.CURVE_SERVER: 1, zmq.CURVE_SECRETKEY: key.secret, zmq.CURVE_PUBLICKEY: key.public}
        return {zmq.CURVE_SERVERKEY: key.public, zmq.CURVE_PUBLICKEY: key.public, zmq.CURVE_SECRETKEY: key.secret}

    def start_authenticator(self, ctx: zmq.Context, bind: bool) -> Any:
        """For a CURVE server: a ZAP handler in ``ctx`` admitting only the run's key (stop it
        before terminating the context). None when not needed."""
        if self.curve is None or not bind:
            return None
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("agentrl.transport.zap"))
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_AdmitOne(self.curve.public))
        return auth


PLAINTEXT = ChannelSecurity()


def security_from_config(actors: Any) -> ChannelSecurity:
    """The ``[actors]`` section's security: the key from the environment, and the opt-out."""
    from agentrl.secrets import read_secret

    secret = read_secret(actors.curve_secret_key_env)
    curve = CurveKey.from_secret(secret, source=f"${actors.curve_secret_key_env}") if secret else None
    return ChannelSecurity(curve=curve, allow_plaintext_network=actors.allow_plaintext_network)
