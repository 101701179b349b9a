"""Wire protocol: round trips, raw-bytes arrays, and fuzzing (only ProtocolError may escape decode)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from agentrl.protocol import (
    MAX_SEQ,
    PROTOCOL_VERSION,
    ActorAck,
    Progress,
    ProtocolError,
    Trajectory,
    TrajectoryGroup,
    decode,
    encode,
)

# Example counts are sized for a busy 2-core machine; raise them locally when changing the codec.
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(FUZZ, max_examples=40)

# ------------------------------------------------------------------ strategies

finite = st.floats(allow_nan=False, allow_infinity=False)
json_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | st.text(max_size=20)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def trajectories(draw) -> Trajectory:
    n = draw(st.integers(0, 40))
    return Trajectory(
        tokens=draw(hnp.arrays(np.int32, n)),
        loss_mask=draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1))),
        behavior_logprobs=draw(hnp.arrays(np.float32, n)),  # NaN and inf included: compared bitwise
        weight_versions=draw(hnp.arrays(np.int32, n, elements=st.integers(-1, 1000))),
        reward=draw(st.floats()),  # NaN and inf travel; the learner's border judges them
        reward_components=draw(st.dictionaries(st.text(max_size=8), finite, max_size=3)),
        metadata=draw(st.dictionaries(st.text(max_size=10), json_value, max_size=5)),
    )


groups = st.builds(
    TrajectoryGroup,
    group_id=st.text(max_size=20),
    task_id=st.text(max_size=20),
    env=st.text(max_size=10),
    trajectories=st.lists(trajectories(), max_size=3),
    actor_id=st.text(min_size=1, max_size=10),
    created_at=finite,
    session=st.text(min_size=1, max_size=12),
    seq=st.integers(0, MAX_SEQ),
)


@st.composite
def acks(draw) -> ActorAck:
    """Sorted, disjoint, non-adjacent ranges (anywhere in int64) and counts that cover them."""
    first = draw(st.integers(0, MAX_SEQ - 10_000))
    ranges = []
    for gap, length in draw(st.lists(st.tuples(st.integers(1, 100), st.integers(1, 100)), max_size=4)):
        lo = first if not ranges else ranges[-1][1] + 1 + gap
        ranges.append((lo, lo + length - 1))
    session_groups = draw(st.integers(sum(hi - lo + 1 for lo, hi in ranges), MAX_SEQ))
    return ActorAck(
        actor_id=draw(st.text(min_size=1, max_size=8)),
        groups=draw(st.integers(session_groups, MAX_SEQ)),
        session=draw(st.text(min_size=1, max_size=8)),
        session_groups=session_groups,
        acked=ranges,
    )


progresses = st.builds(
    Progress,
    policy_version=st.integers(-(2**63), 2**63 - 1),
    accept_groups=st.integers(-(2**63), 2**63 - 1),
    step=st.integers(0, 2**63 - 1),
    max_staleness=st.integers(0, 100),
    done=st.booleans(),
    learner_session=st.text(max_size=12),
    actors=st.lists(acks(), max_size=3),
)


def assert_same_group(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    for name in ("group_id", "task_id", "env", "actor_id", "created_at", "session", "seq"):
        assert getattr(a, name) == getattr(b, name), name
    assert len(a.trajectories) == len(b.trajectories)
    for ta, tb in zip(a.trajectories, b.trajectories):
        for name in ("tokens", "loss_mask", "behavior_logprobs", "weight_versions"):
            xa, xb = getattr(ta, name), getattr(tb, name)
            assert xa.dtype == xb.dtype and xa.tobytes() == xb.tobytes(), name  # bitwise, NaN included
        assert np.float64(ta.reward).tobytes() == np.float64(tb.reward).tobytes()  # NaN included
        assert ta.reward_components == tb.reward_components
        assert ta.metadata == tb.metadata


def sample_group(num_tokens: int = 6, n: int = 2) -> TrajectoryGroup:
    trajs = [
        Trajectory(
            tokens=np.arange(num_tokens) + i,
            loss_mask=[0, 0] + [1] * (num_tokens - 2),
            behavior_logprobs=np.linspace(-1, 0, num_tokens),
            weight_versions=[-1, -1] + [3] * (num_tokens - 2),
            reward=float(i),
            reward_components={"correct": float(i)},
            metadata={"turns": 2, "finish_reason": "stop"},
        )
        for i in range(n)
    ]
    return TrajectoryGroup(
        group_id="g1", task_id="t1", env="calc", trajectories=trajs, actor_id="a0", session="s", seq=4
    )


# ------------------------------------------------------------------ round trips


@ROUND_TRIP
@given(groups)
def test_group_round_trip(group: TrajectoryGroup) -> None:
    assert_same_group(decode(encode(group)), group)


@FUZZ
@given(progresses)
def test_progress_round_trip(progress: Progress) -> None:
    assert decode(encode(progress)) == progress


def test_arrays_travel_as_raw_little_endian_bytes() -> None:
    group = sample_group(num_tokens=1000)
    wire = msgpack.unpackb(encode(group), raw=False)
    t = wire["trajectories"][0]
    assert isinstance(t["tokens"], bytes) and len(t["tokens"]) == 4 * 1000
    assert t["tokens"] == np.arange(1000, dtype="<i4").tobytes()
    assert t["behavior_logprobs"] == np.linspace(-1, 0, 1000).astype("<f4").tobytes()
    assert len(t["loss_mask"]) == 1000
    assert wire["v"] == PROTOCOL_VERSION and wire["kind"] == "group"
    # 2 trajectories x 1000 tokens x 13 bytes, plus a little framing: no per-element encoding anywhere.
    assert len(encode(group)) < 2 * 13 * 1000 + 500


def test_decoded_group_keeps_staleness_information() -> None:
    group = decode(encode(sample_group()))
    assert group.oldest_version() == 3
    assert group.rewards == [0.0, 1.0]
    assert group.trajectories[0].num_tokens == 6


def test_numpy_metadata_is_converted_and_bad_metadata_named() -> None:
    group = sample_group()
    group.trajectories[0].metadata = {"n": np.int64(3), "x": np.float32(0.5), "v": np.arange(2), "s": (1, 2)}
    meta = decode(encode(group)).trajectories[0].metadata
    assert meta == {"n": 3, "x": 0.5, "v": [0, 1], "s": [1, 2]}
    group.trajectories[0].metadata = {"obj": object()}
    with pytest.raises(ProtocolError, match="object"):
        encode(group)


def test_trajectory_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ProtocolError, match="loss_mask"):
        Trajectory(tokens=[1, 2], loss_mask=[1], behavior_logprobs=[0, 0], weight_versions=[0, 0], reward=0.0)


def test_non_finite_rewards_travel_for_the_learner_to_judge() -> None:
    group = sample_group()
    group.trajectories[0].reward = float("nan")
    group.trajectories[1].reward = float("-inf")
    got = decode(encode(group))
    assert np.isnan(got.trajectories[0].reward) and got.trajectories[1].reward == float("-inf")


def test_unstamped_groups_fail_in_the_sender() -> None:
    for change in ({"actor_id": ""}, {"session": ""}, {"seq": -1}, {"seq": MAX_SEQ + 1}):
        group = sample_group()
        for name, value in change.items():
            setattr(group, name, value)
        with pytest.raises(ProtocolError, match="not stamped"):
            encode(group)
    assert sample_group().key == ("a0", "s", 4)


def test_progress_carries_acks() -> None:
    p = Progress(
        policy_version=2,
        accept_groups=9,
        learner_session="L1",
        actors=[ActorAck("actor0", groups=12, session="s2", session_groups=7, acked=[(0, 3), (5, 7)])],
    )
    assert decode(encode(p)) == p


# ------------------------------------------------------------------ rejection


def _wire(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(d) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("version", [0, 1, PROTOCOL_VERSION + 1, True, 2.0, "2", None, [2]])
def test_wrong_version_is_rejected(version) -> None:
    for msg in (sample_group(), Progress(policy_version=1, accept_groups=2)):
        d = _wire(msg)
        d["v"] = version
        with pytest.raises(ProtocolError, match="version"):
            decode(_pack(d))
        del d["v"]
        with pytest.raises(ProtocolError, match="version"):
            decode(_pack(d))


def test_specific_malformations_raise_protocol_error() -> None:
    d = _wire(sample_group())
    cases = {
        "unknown message kind": {**d, "kind": "weights"},
        "missing field 'group_id'": {k: v for k, v in d.items() if k != "group_id"},
        "field 'trajectories' has type": {**d, "trajectories": "x"},
        "not a whole number": {**d, "trajectories": [{**d["trajectories"][0], "tokens": b"\x00" * 7}]},
        "has length": {**d, "trajectories": [{**d["trajectories"][0], "loss_mask": b"\x01"}]},
        "field 'seq' is -1": {**d, "seq": -1},
        "field 'seq' has type": {**d, "seq": 1.0},
        "field 'session' is empty": {**d, "session": ""},
        "field 'actor_id' is empty": {**d, "actor_id": ""},
        "missing field 'session'": {k: v for k, v in d.items() if k != "session"},
        "reward_components": {**d, "trajectories": [{**d["trajectories"][0], "reward_components": {"a": [1]}}]},
        "expected a map": {**d, "trajectories": [7]},
    }
    for expected, body in cases.items():
        with pytest.raises(ProtocolError, match=expected):
            decode(_pack(body))
    p = _wire(
        Progress(
            policy_version=1,
            accept_groups=2,
            learner_session="L",
            actors=[ActorAck("a", groups=5, session="s", session_groups=4, acked=[(0, 1), (3, 4)])],
        )
    )
    ack = p["actors"][0]
    bad_acks = {
        "sorted, disjoint": {**ack, "acked": [[3, 4], [0, 1]]},
        "sorted, disjoint ": {**ack, "acked": [[0, 2], [3, 4]]},  # adjacent ranges are one range
        "within": {**ack, "acked": [[-1, 1]]},
        "not a \\[first, last\\] pair": {**ack, "acked": [[0, 1, 2]]},
        "not a \\[first, last\\] pair ": {**ack, "acked": [[0, True]]},
        "inconsistent counts": {**ack, "session_groups": 3},
        "inconsistent counts ": {**ack, "groups": 3},
        "field 'groups' is -1": {**ack, "groups": -1},
        "field 'session' is empty": {**ack, "session": ""},
        "field 'actors' has type": None,
    }
    for expected, bad in bad_acks.items():
        body = {**p, "actors": [bad]} if bad is not None else {**p, "actors": {"a": 1}}
        with pytest.raises(ProtocolError, match=expected.strip()):
            decode(_pack(body))
    with pytest.raises(ProtocolError, match="not a map"):
        decode(_pack([1, 2, 3]))
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        decode(encode(sample_group())[:-3])
    with pytest.raises(ProtocolError):
        decode(b"")


def _decode_or_protocol_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, (TrajectoryGroup, Progress))


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_protocol_error(data)


@FUZZ
@given(groups | progresses, st.data())
def test_fuzz_truncated_and_byte_mutated_messages(msg, data) -> None:
    raw = bytearray(encode(msg))
    cut = data.draw(st.integers(0, len(raw) - 1))
    _decode_or_protocol_error(bytes(raw[:cut]))  # every strict prefix
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(raw))


msgpack_value = st.recursive(
    json_leaf | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.integers(-(2**63), 2**63 - 1), inner, max_size=3)
    ),
    max_leaves=8,
)


@FUZZ
@given(groups | progresses, st.data())
def test_fuzz_structurally_mutated_messages(msg, data) -> None:
    """Replace or delete any field at any depth with any msgpack value."""
    d = _wire(msg)
    node = d
    while True:  # walk down to a random map
        keys = list(node)
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, list) and child and isinstance(child[0], dict) and data.draw(st.booleans()):
            node = data.draw(st.sampled_from(child))
            continue
        if data.draw(st.booleans()):
            del node[key]
        else:
            node[key] = data.draw(msgpack_value)
        break
    _decode_or_protocol_error(_pack(d))
