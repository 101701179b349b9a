"""The first update as soon as the data allows: a first step smaller than ``groups_per_step``
(doubled each step up to it), the budget that follows the steps' sizes (and so ramps the actors'
concurrency), and progress published at once when an actor can use it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentrl.config import LearnerSection
from agentrl.learner.loop import FAST_PUBLISH_S, groups_ahead, groups_for_step
from tests._learner_helpers import ListSource, Recorder, learner_overrides, make_group, tiny_model  # noqa: F401


def test_the_first_steps_double_from_first_groups_per_step_up_to_groups_per_step():
    assert [groups_for_step(s, 8, 2) for s in range(1, 6)] == [2, 4, 8, 8, 8]
    assert [groups_for_step(s, 8, 1) for s in range(1, 6)] == [1, 2, 4, 8, 8]
    assert [groups_for_step(s, 8, 3) for s in range(1, 4)] == [3, 6, 8]
    assert [groups_for_step(s, 12, 4) for s in range(1, 4)] == [4, 8, 12]
    assert groups_for_step(10**9, 8, 1) == 8  # a resumed run far past the ramp (no huge shift)
    for first in (0, 8, 20):  # off, or not below groups_per_step: the full batch from the first step
        assert [groups_for_step(s, 8, first) for s in range(1, 4)] == [8, 8, 8]


@pytest.mark.parametrize(
    ("first", "sync_every", "staleness", "since_sync", "step", "expected"),
    [
        (0, 1, 1, 0, 0, 16),  # G * k * (s + 1): the budget without a ramp
        (0, 2, 1, 1, 1, 24),  # ... less G * steps_since_sync
        (2, 1, 1, 0, 0, 2 + 4),  # the two steps that may train a group started now: the first two
        (2, 1, 1, 0, 1, 4 + 8),
        (2, 1, 1, 0, 2, 8 + 8),  # past the ramp: as without one
        (1, 1, 0, 0, 0, 1),  # synchronous: the next step's groups only
        (1, 2, 1, 1, 1, 2 + 4 + 8),  # steps 2, 3 and 4 (one left of this version, two of the next)
    ],
)
def test_the_budget_follows_the_sizes_of_the_steps_ahead(first, sync_every, staleness, since_sync, step, expected):
    lc = LearnerSection(
        groups_per_step=8, first_groups_per_step=first, sync_every_steps=sync_every, max_staleness=staleness
    )
    assert groups_ahead(step, since_sync, lc) == expected


def _learner(tiny_model, tmp_path, source, rec, **extra):
    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO

    init_distributed("cpu")
    cfg = load_config(None, learner_overrides(tiny_model, tmp_path, **{"learner.first_groups_per_step": 1, **extra}))
    return Learner(cfg, io=LearnerIO(source=source, progress=rec, weights=rec))


def test_the_first_step_trains_on_its_smaller_batch_and_the_budget_ramps(tiny_model, tmp_path):
    rng = np.random.default_rng(3)
    groups = [make_group(rng, group_id=f"g{i}", session="s", seq=i, rewards=[1, 0, 1, 0]) for i in range(5)]
    rec = Recorder()
    # groups_per_step 4, first 1: steps of 1 and 2 groups (version-0 groups: trainable up to version 1)
    extra = {"learner.max_steps": 2, "learner.groups_per_step": 4, "learner.max_wait_for_data_s": 30}
    learner = _learner(tiny_model, tmp_path, ListSource(groups), rec, **extra)
    assert learner.run() == "done" and learner.trainer.step == 2
    batches = [json.loads(line) for line in (tmp_path / "learner_batches.jsonl").read_text().splitlines()]
    assert [[key[2] for key in b["groups"]] for b in batches] == [[0], [1, 2]]  # (actor, session, seq)
    rows = [json.loads(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["batch/groups"] for r in rows] == [1, 2]
    # before any data: steps 1 and 2 may train what starts now (max_staleness 1): 1 + 2 groups, not 4 + 4
    assert rec.progress[0].accept_groups == 1 + 2 and rec.progress[0].step == 0
    # after step 1: steps 2 and 3, less the groups buffered (5 received, 1 trained: 4 buffered)
    after_first = next(p for p in rec.progress if p.step == 1)
    assert after_first.accept_groups == 5 + 2 + 4 - 4
    assert len(learner.buffer) == 2  # g3, g4 wait for step 3


def test_progress_goes_out_at_once_before_data_and_when_a_dropped_group_frees_budget(tiny_model, tmp_path):
    rng = np.random.default_rng(4)
    rec = Recorder()
    learner = _learner(tiny_model, tmp_path, ListSource([]), rec, **{"learner.dynamic_sampling": "true"})
    learner._resume()
    learner._publish()
    t0 = learner._published_at
    assert len(rec.progress) == 1 and rec.progress[0].accept_groups == 3
    # no group yet: an actor that subscribes now must hear its budget within FAST_PUBLISH_S
    assert learner._publish_if_due(t0 + FAST_PUBLISH_S / 2) and len(rec.progress) == 1
    assert learner._publish_if_due(t0 + 2 * FAST_PUBLISH_S) and len(rec.progress) == 2
    # a group the next step can train: buffered, the budget unchanged, nothing to say
    learner._accept(make_group(rng, group_id="good", session="s", seq=0, rewards=[1, 0, 0, 0]))
    t1 = learner._published_at
    assert not learner._publish_if_due(t1 + 10 * FAST_PUBLISH_S) and len(rec.progress) == 2
    # a zero-variance group is dropped: the actors may replace it now, not at the next poll
    learner._accept(make_group(rng, group_id="flat", session="s", seq=1, rewards=[0, 0, 0, 0]))
    assert learner.buffer.counters["dropped_zero_variance"] == 1
    assert learner._publish_if_due(t1 + FAST_PUBLISH_S / 2) and len(rec.progress) == 2  # at most this often
    assert not learner._publish_if_due(t1 + 2 * FAST_PUBLISH_S) and len(rec.progress) == 3
    assert rec.progress[-1].accept_groups == rec.progress[1].accept_groups + 1
    assert rec.progress[-1].actors[0].acked == [(0, 1)]  # and both groups acknowledged (journal synced first)
