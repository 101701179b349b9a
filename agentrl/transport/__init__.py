"""Transport between actors and learner: interfaces, ZeroMQ channels, in-memory twins.

* :mod:`agentrl.transport.base`: the interfaces both sides import (``GroupSink``,
  ``GroupSource``, ``ProgressSink``, ``ProgressSource``) and ``TransportError``.
* :mod:`agentrl.transport.zmq_channels`: ``GroupSender``/``GroupReceiver`` (PUSH/PULL) and
  ``ProgressPublisher``/``ProgressSubscriber`` (PUB/SUB), over ``PushSocket``/``PullSocket``.
* :mod:`agentrl.transport.mailbox`: the thread/trio bridge under the progress sockets.
* :mod:`agentrl.transport.memory`: ``InMemoryGroupChannel``/``InMemoryProgressChannel``.
* :mod:`agentrl.transport.security`: CURVE on both channels (``ChannelSecurity``,
  ``security_from_config``), required beyond loopback.
* :mod:`agentrl.transport.delivery`: exactly-once delivery, the actor's ``Outbox`` and the
  learner's ``Ledger``.

See docs/architecture.md ("Transport") for the design, docs/performance.md ("Transport") for its measurements.
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
