"""Wire messages between actors and learner, and their msgpack codec.

:class:`TrajectoryGroup` (actors -> learner): the samples of one task as token-level
:class:`Trajectory` s, stamped ``(actor_id, session, seq)`` so the learner trains on each group
exactly once. :class:`Progress` (learner -> actors): the policy version, the cumulative budget of
groups all actors may have started, and per actor id an :class:`ActorAck` of what the learner holds.

Invariants: every message is a msgpack map with ``"v"`` (``PROTOCOL_VERSION``) and ``"kind"``, and
anything off (version, field, type, truncation) raises :class:`ProtocolError`, one type to count and
drop; an unstamped group or a value msgpack cannot carry fails in :func:`encode`, in the sender.
Per-token arrays travel as raw little-endian bytes and decode to read-only views (copy before
changing one). ``weight_versions`` holds the policy version of each generated token, -1 elsewhere.
Rewards travel as scored, non-finite included: the learner's border judges them. Images travel as the PNG
bytes of agentrl/images.py, each at most ``MAX_IMAGE_BYTES``; whether they decode is the learner's check. See
docs/transport.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import numpy as np

from agentrl.images import MAX_IMAGE_BYTES

PROTOCOL_VERSION = 3  # 3: trajectories carry images
MAX_SEQ = 2**63 - 1  # sequence numbers and counts are non-negative int64

_ARRAY_DTYPES = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "behavior_logprobs": np.dtype("<f4"),
    "weight_versions": np.dtype("<i4"),
}


class ProtocolError(ValueError):
    """A message that cannot be decoded: malformed, truncated, wrong kind or wrong version."""


@dataclass
class Trajectory:
    """One episode as the model saw it, token for token."""

    tokens: np.ndarray  # int32 [T], from the first prompt token to the last
    loss_mask: np.ndarray  # uint8 [T], 1 on model-generated tokens only
    behavior_logprobs: np.ndarray  # float32 [T], engine logprob of each model token; 0 elsewhere
    weight_versions: np.ndarray  # int32 [T], policy version per model token; -1 elsewhere
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    # env name, num_turns, num_tool_calls, num_tool_errors, finish_reason, timings, messages...
    metadata: dict[str, Any] = field(default_factory=dict)
    # PNG bytes of each image, in the order of their image-pad runs in ``tokens`` (agentrl/images.py)
    images: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, dtype in _ARRAY_DTYPES.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        n = len(self.tokens)
        for name in ("loss_mask", "behavior_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ProtocolError(f"trajectory field {name} has length {len(getattr(self, name))}, tokens has {n}")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def oldest_version(self) -> int:
        """The oldest policy version among the model tokens (-1 when there are none)."""
        model = self.weight_versions[self.loss_mask.astype(bool)]
        return int(model.min()) if len(model) else -1


@dataclass
class TrajectoryGroup:
    """The samples of one task, scored; the unit GRPO normalises over."""

    group_id: str
    task_id: str
    env: str
    trajectories: list[Trajectory]
    actor_id: str = ""  # the actor's stable name ("actor0"), the same after a restart
    created_at: float = 0.0
    session: str = ""  # the actor process's incarnation: new at every start
    seq: int = -1  # 0, 1, 2, ... per session, in the order the actor sends; -1: not stamped yet

    @property
    def key(self) -> tuple[str, str, int]:
        """What identifies the group however often it is sent."""
        return (self.actor_id, self.session, self.seq)

    def oldest_version(self) -> int:
        versions = [t.oldest_version() for t in self.trajectories if t.loss_mask.any()]
        return min(versions) if versions else -1

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclass
class ActorAck:
    """What the learner holds durably from one actor id (one entry per actor id in Progress)."""

    actor_id: str
    groups: int  # distinct groups from this actor id, all its sessions together
    session: str  # the actor's latest session (the last one whose first group arrived)
    session_groups: int  # distinct groups from that session
    # sequence numbers of that session held, as sorted, disjoint, inclusive (first, last) ranges;
    # usually one, (0, n - 1). At most the newest MAX_ACK_RANGES are published.
    acked: list[tuple[int, int]] = field(default_factory=list)


MAX_ACK_RANGES = 32


@dataclass
class Progress:
    """Published by the learner after every step and every weight update (and as a heartbeat)."""

    policy_version: int
    # Cumulative budget: how many groups all actors together may have STARTED since the learner
    # started. The learner sets it to (groups it has consumed or dropped) + (groups it still needs
    # for this step) + max_staleness * groups_per_step, so that dropped groups are replaced and at
    # most max_staleness steps' worth of data is generated ahead of the policy. Actor process i of
    # k takes the share accept_groups // k (+1 when i < accept_groups % k).
    accept_groups: int
    step: int = 0
    max_staleness: int = 1
    done: bool = False  # the learner has finished; actors may stop
    learner_session: str = ""  # new at every learner start: actors resend what was not acked
    actors: list[ActorAck] = field(default_factory=list)


# ---------------------------------------------------------------------------- codec


def _traj_to_wire(t: Trajectory) -> dict[str, Any]:
    return {
        # memoryviews (``.data``) of the (contiguous, little-endian) arrays: msgpack copies them straight
        # into its buffer; ``tobytes()`` first would add a copy (and, past 128 KB, an mmap).
        "tokens": t.tokens.data,
        "loss_mask": t.loss_mask.data,
        "behavior_logprobs": t.behavior_logprobs.data,
        "weight_versions": t.weight_versions.data,
        "reward": float(t.reward),
        "reward_components": {str(k): float(v) for k, v in t.reward_components.items()},
        "metadata": t.metadata,
        "images": list(t.images),
    }


def _array(d: dict[str, Any], name: str) -> np.ndarray:
    raw = _field(d, name, bytes)
    dtype = _ARRAY_DTYPES[name]
    if len(raw) % dtype.itemsize:
        raise ProtocolError(f"field {name}: {len(raw)} bytes is not a whole number of {dtype} items")
    return np.frombuffer(raw, dtype=dtype)


def _field(d: Any, name: str, typ: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict):
        raise ProtocolError(f"expected a map around field {name!r}, got {type(d).__name__}")
    if name not in d:
        raise ProtocolError(f"missing field {name!r}")
    value = d[name]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} has type {type(value).__name__}")
    return value


def _count(d: dict[str, Any], name: str, low: int = 0) -> int:
    """An int field in [low, MAX_SEQ]."""
    value = _field(d, name, int)
    if not low <= value <= MAX_SEQ:
        raise ProtocolError(f"field {name!r} is {value}, outside [{low}, {MAX_SEQ}]")
    return value


def _name(d: dict[str, Any], name: str) -> str:
    """A non-empty str field."""
    value = _field(d, name, str)
    if not value:
        raise ProtocolError(f"field {name!r} is empty")
    return value


def _ack_to_wire(a: ActorAck) -> dict[str, Any]:
    return {
        "actor_id": a.actor_id,
        "groups": int(a.groups),
        "session": a.session,
        "session_groups": int(a.session_groups),
        "acked": [[int(lo), int(hi)] for lo, hi in a.acked],
    }


def _ack_from_wire(d: Any) -> ActorAck:
    ranges = []
    previous = -2
    for item in _field(d, "acked", list):
        if not (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)):
            raise ProtocolError(f"field 'acked' holds {item!r}, not a [first, last] pair of ints")
        lo, hi = item
        if not (previous + 1 < lo <= hi <= MAX_SEQ):
            raise ProtocolError(f"field 'acked' ranges must be sorted, disjoint and within [0, {MAX_SEQ}]: {item}")
        ranges.append((lo, hi))
        previous = hi
    ack = ActorAck(
        actor_id=_name(d, "actor_id"),
        groups=_count(d, "groups"),
        session=_name(d, "session"),
        session_groups=_count(d, "session_groups"),
        acked=ranges,
    )
    if ack.session_groups > ack.groups or sum(hi - lo + 1 for lo, hi in ranges) > ack.session_groups:
        raise ProtocolError(f"inconsistent counts for actor {ack.actor_id!r}: {ack}")
    return ack


def _traj_from_wire(d: dict[str, Any]) -> Trajectory:
    comps = _field(d, "reward_components", dict)
    try:
        comps = {str(k): float(v) for k, v in comps.items()}
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"field 'reward_components' is not a map of numbers: {e}") from None
    return Trajectory(
        tokens=_array(d, "tokens"),
        loss_mask=_array(d, "loss_mask"),
        behavior_logprobs=_array(d, "behavior_logprobs"),
        weight_versions=_array(d, "weight_versions"),
        reward=_field(d, "reward", float),
        reward_components=comps,
        metadata=_field(d, "metadata", dict),
        images=_images(d),
    )


def _images(d: dict[str, Any]) -> list[bytes]:
    images = _field(d, "images", list)
    for i, png in enumerate(images):
        if not isinstance(png, bytes):
            raise ProtocolError(f"field 'images' item {i} has type {type(png).__name__}, not bytes")
        if len(png) > MAX_IMAGE_BYTES:
            raise ProtocolError(f"field 'images' item {i} has {len(png)} bytes, more than {MAX_IMAGE_BYTES}")
    return images


def encode(msg: TrajectoryGroup | Progress) -> bytes:
    """Encode a message to msgpack bytes."""
    if isinstance(msg, TrajectoryGroup):
        if not msg.actor_id or not msg.session or not 0 <= msg.seq <= MAX_SEQ:
            raise ProtocolError(
                f"group {msg.group_id!r} is not stamped (actor_id={msg.actor_id!r}, session={msg.session!r}, "
                f"seq={msg.seq}): actors stamp groups through agentrl.transport.delivery.Outbox"
            )
        body = {
            "v": PROTOCOL_VERSION,
            "kind": "group",
            "group_id": msg.group_id,
            "task_id": msg.task_id,
            "env": msg.env,
            "actor_id": msg.actor_id,
            "session": msg.session,
            "seq": int(msg.seq),
            "created_at": float(msg.created_at),
            "trajectories": [_traj_to_wire(t) for t in msg.trajectories],
        }
    elif isinstance(msg, Progress):
        body = {
            "v": PROTOCOL_VERSION,
            "kind": "progress",
            "policy_version": int(msg.policy_version),
            "accept_groups": int(msg.accept_groups),
            "step": int(msg.step),
            "max_staleness": int(msg.max_staleness),
            "done": bool(msg.done),
            "learner_session": msg.learner_session,
            "actors": [_ack_to_wire(a) for a in msg.actors],
        }
    else:
        raise TypeError(f"cannot encode {type(msg).__name__}")
    try:
        return cast(bytes, msgpack.packb(body, use_bin_type=True, default=_to_builtin))  # msgpack is untyped
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {e}") from None


def _to_builtin(obj: Any) -> Any:
    """msgpack fallback for values in ``metadata``: numpy scalars and arrays become Python values."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(
        f"a metadata value of type {type(obj).__name__} cannot be sent (use str, int, float, bool, None, list, dict)"
    )


def decode(data: bytes) -> TrajectoryGroup | Progress:
    """Decode bytes from the wire; any problem raises :class:`ProtocolError`."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ProtocolError(f"message is a msgpack {type(d).__name__}, not a map")
    version = d.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 and 1.0 == 1 in Python
        raise ProtocolError(f"protocol version {version!r}, this build speaks {PROTOCOL_VERSION}")
    kind = d.get("kind")
    try:
        if kind == "group":
            trajs = _field(d, "trajectories", list)
            return TrajectoryGroup(
                group_id=_field(d, "group_id", str),
                task_id=_field(d, "task_id", str),
                env=_field(d, "env", str),
                actor_id=_name(d, "actor_id"),
                session=_name(d, "session"),
                seq=_count(d, "seq"),
                created_at=_field(d, "created_at", float),
                trajectories=[_traj_from_wire(t) for t in trajs],
            )
        if kind == "progress":
            return Progress(
                policy_version=_field(d, "policy_version", int),
                accept_groups=_field(d, "accept_groups", int),
                step=_field(d, "step", int),
                max_staleness=_field(d, "max_staleness", int),
                done=_field(d, "done", bool),
                learner_session=_field(d, "learner_session", str),
                actors=[_ack_from_wire(a) for a in _field(d, "actors", list)],
            )
    except ProtocolError:
        raise
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"malformed {kind} message: {e}") from None
    raise ProtocolError(f"unknown message kind {kind!r}")
