"""One actor process's scheduling in-process: gating on the learner's budget, max_groups, lost
groups, back-pressure, stopping. The engine is a scripted HTTP server; sender and progress are
in-memory doubles of the transport interface."""

from __future__ import annotations

import json
import re

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from agentrl.actors.actor import ActorEnv, ActorService, ActorSettings, budget_share, waiting_at_gate_path
from agentrl.episode.rollout import toolbox_for
from agentrl.episode.turn import EpisodeLimits
from agentrl.protocol import ActorAck, Progress
from tests._actors_helpers import (
    HttpEngineClient,
    MemoryProgress,
    MemorySender,
    ScriptedEngine,
    TurnScript,
    load_tokenizer,
    tiny_tokenizer_dir,
)
from tests._actors_user_env import AddAgentEnv, AddEnv, prompt_solver, solver

LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=1024, max_new_tokens_per_turn=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))


def service(
    client, tokenizer, env=None, sender=None, progress=None, dump_path=None, envs=None, agents=None, **settings
) -> ActorService:
    env = env or AddEnv()
    envs = envs or [ActorEnv(env, toolbox_for(env), LIMITS)]
    defaults = dict(group_size=2, num_concurrent_episodes=4, log_interval_s=0, drain_timeout_s=1.0)
    return ActorService(
        client=client,
        tokenizer=tokenizer,
        envs=envs,
        agents=agents,
        sampling={},
        settings=ActorSettings(**{**defaults, **settings}),
        sender=sender,
        progress=progress,
        dump_path=dump_path,
    )


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


async def settled(svc: ActorService) -> None:
    """Until every task is blocked: the service has acted on every change so far (a group it would start
    is counted in ``groups_started`` by now), and its gate is shut, so nothing starts until something changes."""
    with trio.fail_after(20):
        await wait_all_tasks_blocked()
    assert not svc.may_start()


def test_budget_share():
    assert [budget_share(5, i, 2) for i in range(2)] == [3, 2]
    assert [budget_share(7, i, 3) for i in range(3)] == [3, 2, 2]
    assert sum(budget_share(1001, i, 4) for i in range(4)) == 1001
    with pytest.raises(ValueError, match="actor index 2 is not in"):
        ActorSettings(actor_index=2, num_actors=2)


def test_free_run_max_groups_and_dump(tokenizer, tmp_path):
    dump = tmp_path / "groups.jsonl"
    sender = MemorySender()
    with ScriptedEngine(TurnScript(tokenizer, solver), version=3) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await service(client, tokenizer, sender=sender, dump_path=dump, max_groups=5).run()

        report = trio.run(main)
    assert report["stop_reason"] == "delivered max_groups=5" and not report["failed"]
    assert report["groups_delivered"] == 5 == len(sender.groups) and report["groups_started"] == 5
    assert report["episodes"] == 10 and report["reward_mean"] == 1.0
    assert report["finish_reasons"] == {"answer": 10} and report["turns_mean"] == 2.0
    assert report["tool_calls_mean"] == 1.0 and report["generation_latency_mean_s"] > 0
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [g["group_id"] for g in lines] == [g.group_id for g in sender.groups]
    assert len({g["task_id"] for g in lines}) == 5  # one task per group, n samples each
    for g, sent in zip(lines, sender.groups):
        assert len(g["trajectories"]) == 2
        for t, st in zip(g["trajectories"], sent.trajectories):
            assert t["tokens"] == st.tokens.tolist() and t["loss_mask"] == st.loss_mask.tolist()
            assert len(t["behavior_logprobs"]) == len(t["weight_versions"]) == len(t["tokens"])
            assert t["reward"] == 1.0 and t["metadata"]["messages"][-1]["content"].startswith("The answer is")
            assert set(t["weight_versions"]) == {-1, 3}
            assert t["metadata"]["finish_reason"] == "answer" and t["metadata"]["policy_version_at_start"] == -1


def test_max_staleness_zero_is_synchronous(tokenizer):
    """With a budget of one step per version, the actor starts exactly that step's groups and waits."""
    sender, progress = MemorySender(), MemoryProgress()
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(
                    client,
                    tokenizer,
                    sender=sender,
                    progress=progress,
                    wait_for_learner=True,
                    max_staleness=0,
                    num_concurrent_episodes=8,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await settled(svc)
                    assert svc.stats.groups_started == 0  # waits for the learner
                    for step in range(3):
                        progress.publish(
                            Progress(policy_version=step, accept_groups=3 * (step + 1), step=step, max_staleness=0)
                        )
                        await wait_for(lambda: len(sender.groups) == 3 * (step + 1))
                        await settled(svc)
                        assert svc.stats.groups_started == 3 * (step + 1)  # nothing beyond the budget
                        engine.version = step + 1  # the learner trains, pushes weights, publishes
                    progress.publish(Progress(policy_version=3, accept_groups=12, step=3, max_staleness=0, done=True))
                return svc

        svc = trio.run(main)
    assert svc.stop_reason == "the learner is done"
    for i, group in enumerate(sender.groups):  # one batch per version
        assert group.oldest_version() == i // 3
        for t in group.trajectories:
            assert set(t.weight_versions[t.loss_mask == 1].tolist()) == {i // 3}
            assert t.metadata["policy_version_at_start"] == i // 3


def test_no_group_starts_before_the_start_gate_opens_even_with_a_budget(tokenizer, tmp_path):
    """`agentrl run` starts its actors during the evaluation before RL: up and subscribed, they say so
    (the file the run waits for before it starts RL) and start nothing until the run creates the gate
    file, then their whole budget at once."""
    gate = tmp_path / "rl_started"
    sender, progress = MemorySender(), MemoryProgress()
    progress.publish(Progress(policy_version=0, accept_groups=3, max_staleness=1))
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(
                    client, tokenizer, sender=sender, progress=progress, wait_for_learner=True, start_gate=gate
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: svc.progress is not None)  # it heard the learner's budget
                    await settled(svc)
                    assert svc.stats.groups_started == 0 and not engine.requests  # the gate holds it
                    assert waiting_at_gate_path(gate, svc.settings.actor_id).exists()
                    gate.touch()
                    await wait_for(lambda: len(sender.groups) == 3)
                    await settled(svc)
                    assert svc.stats.groups_started == 3
                    progress.publish(Progress(policy_version=1, accept_groups=3, step=1, max_staleness=1, done=True))

        trio.run(main)


def test_actor_takes_its_share_and_replaces_lost_groups(tokenizer):
    calls = {"n": 0}
    script = TurnScript(tokenizer, solver)

    def flaky(ids, params):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine hiccup")  # HTTP 500: that episode's group is lost
        return script(ids, params)

    sender, progress = MemorySender(), MemoryProgress()
    progress.publish(Progress(policy_version=0, accept_groups=7, max_staleness=1))
    with ScriptedEngine(flaky) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(
                    client,
                    tokenizer,
                    sender=sender,
                    progress=progress,
                    actor_index=1,
                    num_actors=3,
                    wait_for_learner=True,
                    max_staleness=1,
                    group_size=1,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: len(sender.groups) == 2)
                    await settled(svc)
                    svc.request_stop("test over")
                return svc

        svc = trio.run(main)
    # actor 1 of 3 gets 7 // 3 = 2 groups; the lost one was replaced
    assert len(sender.groups) == 2
    assert svc.stats.groups_lost == 1 and svc.stats.groups_started == 3
    assert "500" in next(iter(svc.stats.lost_reasons))


def test_a_restarted_actor_continues_its_share(tokenizer):
    """The learner holds 8 groups from actor0's previous process: a budget of 10 leaves 2."""
    sender, progress = MemorySender(), MemoryProgress()
    old = ActorAck("actor0", groups=8, session="previous-process", session_groups=8, acked=[(0, 7)])
    progress.publish(Progress(policy_version=0, accept_groups=10, max_staleness=1, learner_session="L", actors=[old]))
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(client, tokenizer, sender=sender, progress=progress, wait_for_learner=True)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: len(sender.groups) == 2)
                    await settled(svc)
                    assert svc.stats.groups_started == 2 and svc.budget_used() == 10  # and waits
                    # the learner got them: 10 held from actor0 now, budget 12: two more
                    ack = ActorAck("actor0", groups=10, session=svc.outbox.session, session_groups=2, acked=[(0, 1)])
                    progress.publish(
                        Progress(policy_version=1, accept_groups=12, max_staleness=1, learner_session="L", actors=[ack])
                    )
                    await wait_for(lambda: len(sender.groups) == 4)
                    await settled(svc)
                    assert svc.stats.groups_started == 4 and svc.outbox.held == 2
                    svc.request_stop("test over")
                return svc

        svc = trio.run(main)
    assert [g.key for g in sender.groups] == [("actor0", svc.outbox.session, i) for i in range(4)]


def test_groups_a_restarted_learner_lost_are_sent_again(tokenizer):
    sender, progress = MemorySender(), MemoryProgress()
    progress.publish(Progress(policy_version=0, accept_groups=3, max_staleness=1, learner_session="L1"))
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(
                    client, tokenizer, sender=sender, progress=progress, wait_for_learner=True, drain_timeout_s=5
                )
                session = svc.outbox.session

                def acked(*ranges):
                    n = sum(hi - lo + 1 for lo, hi in ranges)
                    return [ActorAck("actor0", groups=n, session=session, session_groups=n, acked=list(ranges))]

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: len(sender.groups) == 3)
                    progress.publish(
                        Progress(policy_version=0, accept_groups=3, learner_session="L1", actors=acked((0, 0)))
                    )
                    await wait_for(lambda: svc.outbox.held == 2)
                    # the learner restarts with group 0 on disk: 1 and 2 were in its queue, lost
                    progress.publish(
                        Progress(policy_version=0, accept_groups=3, learner_session="L2", actors=acked((0, 0)))
                    )
                    await wait_for(lambda: len(sender.groups) == 5)
                    svc.request_stop("test over")  # waits for the acknowledgement
                    await settled(svc)
                    assert svc.stop_reason and svc.outbox.held == 2
                    progress.publish(
                        Progress(policy_version=0, accept_groups=3, learner_session="L2", actors=acked((0, 2)))
                    )
                return svc.report()

        report = trio.run(main)
    assert [g.seq for g in sender.groups] == [0, 1, 2, 1, 2]
    assert (report["groups_produced"], report["groups_acked"], report["groups_resent"], report["groups_unacked"]) == (
        3,
        3,
        2,
        0,
    )


def test_persistent_failure_stops_the_actor(tokenizer):
    def broken(ids, params):
        raise RuntimeError("down")

    with ScriptedEngine(broken) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await service(client, tokenizer, max_consecutive_lost=3).run()

        report = trio.run(main)
    assert report["failed"] and report["groups_lost"] >= 3 and report["groups_delivered"] == 0
    assert report["stop_reason"].startswith("3 groups lost in a row, last: generate failed")


def test_back_pressure_bounds_open_groups_and_stop_reports(tokenizer):
    """A learner that stops reading: open groups fill up to the limit, then nothing starts; on stop
    the finished groups are reported unsent."""
    sender = MemorySender()
    sender.blocked = True
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(client, tokenizer, env=env, sender=sender, drain_timeout_s=0.3)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: svc.stats.groups_completed == 2)
                    await settled(svc)
                    assert svc.stats.groups_started == 2 == svc.open_groups  # 4 episodes / 2 per group
                    svc.request_stop("test over")
                return svc.report()

        report = trio.run(main)
    assert report["groups_unsent"] == 2 and report["groups_delivered"] == 0 and report["groups_abandoned"] == 0
    assert env.cleaned_up == 4


def test_stop_abandons_running_groups(tokenizer):
    env = AddEnv()
    sender = MemorySender()
    with ScriptedEngine(TurnScript(tokenizer, solver), delay_s=0.4) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(client, tokenizer, env=env, sender=sender, num_concurrent_episodes=6)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: len(engine.requests) >= 6)
                    svc.request_stop("received SIGTERM")
                return svc.report()

        report = trio.run(main)
    assert report["stop_reason"] == "received SIGTERM"
    assert report["groups_abandoned"] == 3 and report["episodes_abandoned"] == 6
    assert report["groups_delivered"] == 0 and len(sender.groups) == 0
    assert env.cleaned_up == 6  # cleanup runs for cancelled episodes too


def test_reward_errors_do_not_stop_the_actor(tokenizer):
    sender = MemorySender()
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                return await service(
                    client, tokenizer, env=AddEnv(reward_raises=True), sender=sender, max_groups=3
                ).run()

        report = trio.run(main)
    assert report["groups_delivered"] == 3 and report["reward_errors"] == 6 and report["reward_mean"] == 0.0
    assert all(
        t.metadata["reward_error"].endswith("RuntimeError: the scorer crashed")
        for g in sender.groups
        for t in g.trajectories
    )


def test_limits_and_sampling_from_config():
    from agentrl.config import load_config
    from agentrl.episode.rollout import sampling_from_config

    cfg = load_config(
        None,
        [
            "env.max_turns=6",
            "env.max_total_tokens=900",
            "actors.max_new_tokens_per_turn=50",
            "actors.temperature=0.7",
            "engine.max_context_tokens=1000",
        ],
    )
    assert EpisodeLimits.from_config(cfg) == EpisodeLimits(
        max_turns=6, max_total_tokens=900, max_new_tokens_per_turn=50, max_abs_reward=1000.0
    )
    env = AddEnv()
    env.max_turns, env.max_total_tokens = 2, 5000  # an env's own limits win, capped by the engine's context
    assert EpisodeLimits.from_config(cfg, env) == EpisodeLimits(
        max_turns=2, max_total_tokens=1000, max_new_tokens_per_turn=50, max_abs_reward=1000.0
    )
    assert sampling_from_config(cfg) == {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
    assert sampling_from_config(cfg, greedy=True) == {"temperature": 0.0}


def test_finite_split_then_blocked_send_still_stops(tokenizer):
    """A test split runs once; if the learner is gone at the end, a stop still ends the actor."""
    sender = MemorySender()
    sender.blocked = True
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                svc = service(
                    client,
                    tokenizer,
                    env=AddEnv(num_tasks=3),
                    sender=sender,
                    split="test",
                    num_concurrent_episodes=6,
                    drain_timeout_s=0.2,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await wait_for(lambda: svc.stats.groups_completed == 3)
                    await settled(svc)
                    svc.request_stop("received SIGTERM")
                return svc.report()

        report = trio.run(main)
    assert report["groups_started"] == 3 and report["groups_unsent"] == 3 and report["groups_delivered"] == 0


# ----------------------------------------------------------------------------- agent envs and several envs


def agent_runner(tokenizer, url: str):
    from agentrl.agents.agent_runner import AgentRunner

    return AgentRunner(
        tokenizer, lambda: HttpEngineClient([url]), forced_sampling={"temperature": 1.0}, default_max_tokens=64
    )


def test_two_envs_one_of_them_an_agent_env_share_one_actor(tokenizer, tmp_path):
    """An AgentEnv (whose episodes are two sequences each) next to a built-in-style env: groups are picked by
    weight and never mix envs, stamping is exactly-once in one sequence, counts are per episode and per env."""
    sender = MemorySender()
    add, agent = AddEnv(), AddAgentEnv(rewrite_history=True)
    envs = [
        ActorEnv(add, toolbox_for(add), LIMITS, weight=1.0),
        ActorEnv(agent, toolbox_for(agent), LIMITS, weight=3.0),
    ]
    with ScriptedEngine(TurnScript(tokenizer, prompt_solver), version=2) as engine:

        async def main():
            async with HttpEngineClient([engine.url]) as client, agent_runner(tokenizer, engine.url) as runner:
                return await service(
                    client,
                    tokenizer,
                    envs=envs,
                    agents=runner,
                    sender=sender,
                    max_groups=16,
                    dump_path=tmp_path / "groups.jsonl",
                ).run()

        report = trio.run(main)
    by_env = {}
    for g in sender.groups:
        by_env.setdefault(g.env, []).append(g)
        assert {t.metadata["env"] for t in g.trajectories} == {g.env}  # a group never mixes envs
        assert all(t.metadata["success"] is True and t.reward == 1.0 for t in g.trajectories)
    assert set(by_env) == {"add", "add-agent"} and len(by_env["add-agent"]) > len(by_env["add"])  # weight 3 : 1
    assert [g.seq for g in sender.groups] == list(range(16)) and len({g.session for g in sender.groups}) == 1
    for g in by_env["add-agent"]:
        assert len(g.trajectories) == 4 and len({t.metadata["episode_id"] for t in g.trajectories}) == 2
        assert [t.metadata["new_sequence_reason"] for t in g.trajectories] == ["first_call", "history_differs"] * 2
        assert all(set(t.weight_versions[t.loss_mask == 1].tolist()) == {2} for t in g.trajectories)
        assert all(t.metadata["policy_version_at_start"] == -1 for t in g.trajectories)
    assert report["groups_delivered"] == 16 and report["episodes"] == 32  # episodes, not sequences
    assert report["by_env"]["add-agent"]["episodes"] == 2 * len(by_env["add-agent"])
    assert report["by_env"]["add"]["success_rate"] == report["by_env"]["add-agent"]["success_rate"] == 1.0
    dumped = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [d["env"] for d in dumped] == [g.env for g in sender.groups]


def test_an_agent_env_is_gated_and_survives_weight_updates_like_any_env(tokenizer):
    """max_staleness = 0 with an AgentEnv: exactly one step's groups per policy version, and a turn aborted by
    a weight update is continued (its tokens carry both versions)."""
    sender, progress = MemorySender(), MemoryProgress()
    agent = AddAgentEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver), version=0) as engine:
        engine.abort_plan = [4]  # the first request is cut by a weight update, version 0 -> 1

        async def main():
            async with HttpEngineClient([engine.url]) as client, agent_runner(tokenizer, engine.url) as runner:
                svc = service(
                    client,
                    tokenizer,
                    envs=[ActorEnv(agent, toolbox_for(agent), LIMITS)],
                    agents=runner,
                    sender=sender,
                    progress=progress,
                    wait_for_learner=True,
                    max_staleness=0,
                    num_concurrent_episodes=8,
                    group_size=1,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(svc.run)
                    await settled(svc)
                    assert svc.stats.groups_started == 0  # waits for the learner
                    for step in range(2):
                        progress.publish(
                            Progress(policy_version=step + 1, accept_groups=2 * (step + 1), step=step, max_staleness=0)
                        )
                        await wait_for(lambda: len(sender.groups) == 2 * (step + 1))
                        await settled(svc)
                        assert svc.stats.groups_started == 2 * (step + 1)  # nothing beyond the budget
                        engine.version = step + 2
                    progress.publish(Progress(policy_version=3, accept_groups=4, step=2, max_staleness=0, done=True))
                return svc

        svc = trio.run(main)
    assert svc.stop_reason == "the learner is done" and len(sender.groups) == 4
    versions = [
        sorted(set(t.weight_versions[t.loss_mask == 1].tolist())) for g in sender.groups for t in g.trajectories
    ]
    assert [0, 1] in versions  # the interrupted turn went on under the new weights
    assert sum(t.metadata["num_aborts"] for g in sender.groups for t in g.trajectories) == 1
    assert all(t.reward == 1.0 for g in sender.groups for t in g.trajectories)


def llama3_solver(turn: int, prompt: str) -> str:
    """:func:`solver` with Llama 3's JSON tool call on the first turn."""
    if turn == 0:
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
        return json.dumps({"name": "add", "parameters": {"a": int(a), "b": int(b)}})
    return solver(turn, prompt)


@pytest.mark.parametrize("tool_format", ["llama3", ""])
def test_an_agent_env_reads_tool_calls_in_its_own_format_through_the_processs_runner(tokenizer, tool_format):
    """serve-actors' wiring (the env built from the config, the runner from ``agent_runner(cfg)``): an AgentEnv
    whose ``tool_parser`` is llama3 (set from ``env.kwargs``) gets the model's Llama 3 JSON calls as OpenAI
    ``tool_calls``; with the default (Hermes) the same text is plain content."""
    from agentrl.config import load_config
    from agentrl.run.actor_process import agent_runner as runner_from_config
    from agentrl.run.actor_process import build_actor_envs

    cfg = load_config(None, ["env.cls=tests._actors_user_env:AddAgentEnv", f"env.kwargs.tool_format={tool_format}"])
    envs = build_actor_envs(cfg)
    sender = MemorySender()
    with ScriptedEngine(TurnScript(tokenizer, llama3_solver)) as engine:

        async def main():
            async with (
                HttpEngineClient([engine.url]) as client,
                runner_from_config(cfg, tokenizer, lambda: HttpEngineClient([engine.url])) as runner,
            ):
                return await service(client, tokenizer, envs=envs, agents=runner, sender=sender, max_groups=2).run()

        report = trio.run(main)
    assert report["groups_delivered"] == 2
    trajectories = [t for g in sender.groups for t in g.trajectories]
    assert len(trajectories) == 4  # 2 groups of 2 episodes, one sequence each
    for t in trajectories:
        if tool_format == "llama3":
            assert t.metadata["call_finish_reasons"] == ["tool_calls", "stop"] and t.reward == 1.0
            assert t.metadata["num_stitched_calls"] == 1  # the tool result extended the sequence
        else:  # not read as a call: the agent got the JSON as its answer
            assert t.metadata["call_finish_reasons"] == ["stop"]


def test_an_agent_env_needs_a_runner_and_env_names_are_unique(tokenizer):
    agent = AddAgentEnv()
    with pytest.raises(ValueError, match="AgentEnv"):
        service(None, tokenizer, envs=[ActorEnv(agent, toolbox_for(agent), LIMITS)])
    with pytest.raises(ValueError, match="unique"):
        service(None, tokenizer, envs=[ActorEnv(AddEnv(), toolbox_for(AddEnv()), LIMITS)] * 2)
