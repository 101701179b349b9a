"""Any child can die and the run goes on: a real ``agentrl run`` (the calculator quickstart's
config without its warm start, 12 short synchronous steps) during which the engine, the actor
and the learner are each killed with SIGKILL (``bench/chaos.py`` drives it; the full run with
the warm start and seeded random moments is ``python bench/chaos.py``).

Checked: every victim was restarted and the run finished every step; where every group went
balances exactly (``agentrl.run.accounting``); the engine, restarted without a weight version, got
the learner's policy before anything it generated was trained on (with ``max_staleness = 0``
every batch is the current policy's, so the learner's recomputed logprobs must equal the
behaviour logprobs the engines reported, step after step across the restart); the learner came
back from its checkpoint; the actor came back under its id, continuing its budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.learner.loop import groups_for_step
from tests._learner_helpers import tiny_model  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"
MAX_STEPS = 12


@pytest.mark.timeout(900)
def test_a_run_survives_kill_9_of_its_engine_actor_and_learner(tiny_model: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import chaos

    overrides = [
        *chaos.CHAOS_OVERRIDES,
        f"model.path={tiny_model}",
        "sft.enabled=false",
        f"learner.max_steps={MAX_STEPS}",
        "learner.groups_per_step=4",
        "actors.group_size=4",
        "actors.num_concurrent_episodes=16",
        "learner.dynamic_sampling=false",
        "learner.max_staleness=0",
        "actors.max_staleness=0",
        "eval.num_tasks=8",
        "tracking.enabled=false",
        "actors.max_new_tokens_per_turn=32",
        "learner.checkpoint_every_steps=2",
    ]
    faults = [chaos.Fault("engine0", 2), chaos.Fault("actor0", 4), chaos.Fault("learner", 7)]
    run_dir = tmp_path / "run"
    code, faults, summary = chaos.run_with_faults(
        EXAMPLE, run_dir, faults, overrides, timeout_s=740
    )  # its stop (up to 120 s) fits in the 900 s
    log = lambda name: (run_dir / "logs" / f"{name}.log").read_text()  # noqa: E731

    assert not chaos.survived(code, faults, summary, MAX_STEPS), (
        chaos.report(code, faults, summary, MAX_STEPS),
        log("learner")[-3000:],
    )
    assert summary["restarts"] == {"engine0": 1, "actor0": 1, "learner": 1}
    assert len(summary["restart_events"]) == 3 and all("status -9" in e for e in summary["restart_events"])

    # exact accounting across the three kills
    acc = summary["accounting"]
    assert acc["balanced"], acc
    assert acc["produced"] == acc["received"] + acc["abandoned_by_killed_actors"] + acc["unacked_at_end"]
    assert acc["received"] == acc["consumed"] + sum(acc["dropped"].values()) + acc["held"]
    first = load_config(EXAMPLE).learner.first_groups_per_step  # the quickstart's first steps are smaller
    trained = sum(groups_for_step(step, 4, first) for step in range(1, MAX_STEPS + 1))
    assert acc["consumed"] == acc["trained"] == trained and acc["trained_twice"] == 0
    assert acc["actor_sessions"] == 2 and acc["actor_sessions_killed"] == 1

    # the engine came back without a version and was given the policy before its tokens counted: every
    # step of the first learner process (steps 1..7, across the engine's restart after step 2) trained on
    # behaviour logprobs equal to its own
    rows = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # one row per step: redone ones replaced
    resumed = int(log("learner").split("resumed from ")[1].split(":")[0].rsplit("step_", 1)[1])
    first = [r for r in rows if r["step"] <= resumed]  # the first learner process's (up to its checkpoint)
    assert [r["step"] for r in first][-1] >= 5
    assert max(r["policy/behavior_logprob_diff"] for r in first) <= 1e-4, [
        (r["step"], r["policy/behavior_logprob_diff"]) for r in first
    ]
    engine_log = log("engine0")
    assert engine_log.count("agentrl engine serving") == 2
    assert "re-forming the weight group" in log("learner") and "answers and is not in the group" in log("learner")

    # the learner came back from its checkpoint; the actor's restart continued under its id
    assert "resumed from " + str(run_dir / "checkpoints" / "learn" / "step_0000000") in log("learner")
    assert "the learner restarted" in log("actor0")
    assert summary["eval_after"] is not None and summary["eval_after"]["n"] + summary["eval_after"]["n_failed"] == 8

    # the balance has teeth: a group trained twice, or one received that no actor produced, is named
    from agentrl.run.accounting import account

    batches = run_dir / "learner_batches.jsonl"
    rows = batches.read_text().splitlines()
    last = json.loads(rows[-1])
    last["groups"].append(json.loads(rows[0])["groups"][0])
    batches.write_text("\n".join([*rows[:-1], json.dumps(last)]) + "\n")
    dump = run_dir / "trajectories" / "actor0.jsonl"
    dump.write_text("".join(dump.read_text().splitlines(keepends=True)[1:]))
    problems = account(run_dir)["problems"]
    assert any("1 groups trained more than once" in p for p in problems), problems
    assert any("1 received groups that no actor produced" in p for p in problems), problems
