"""Transport between actors and learner: interfaces, ZeroMQ channels, in-memory twins.

``base`` declares the interfaces both sides import; ``zmq_channels`` implements them over ZeroMQ
(groups PUSH/PULL, progress PUB/SUB); ``mailbox`` is the thread/trio bridge under the progress
sockets; ``memory`` holds the in-memory twins; ``security`` adds CURVE, required beyond loopback;
``delivery`` makes delivery exactly once (the actor's ``Outbox``, the learner's ``Ledger``).

See docs/transport.md; measurements in docs/performance.md.
"""

from agentrl.transport.base import GroupSink, GroupSource, ProgressSink, ProgressSource, TransportError
from agentrl.transport.delivery import Ledger, Outbox
from agentrl.transport.memory import InMemoryGroupChannel, InMemoryProgressChannel
from agentrl.transport.security import ChannelSecurity, CurveKey, security_from_config
from agentrl.transport.zmq_channels import (
    GroupReceiver,
    GroupSender,
    ProgressPublisher,
    ProgressSubscriber,
    PullSocket,
    PushSocket,
)

__all__ = [
    "ChannelSecurity",
    "CurveKey",
    "GroupReceiver",
    "GroupSender",
    "GroupSink",
    "GroupSource",
    "InMemoryGroupChannel",
    "InMemoryProgressChannel",
    "Ledger",
    "Outbox",
    "ProgressPublisher",
    "ProgressSink",
    "ProgressSource",
    "ProgressSubscriber",
    "PullSocket",
    "PushSocket",
    "TransportError",
    "security_from_config",
]
