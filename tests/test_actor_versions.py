"""How an actor reads an engine's weight_version (agentrl/episode/turn.py), over real HTTP
against a scripted SGLang-style engine: numbers are kept, SGLang's "default" is waited for,
anything else fails with the engine named and the fix."""

from __future__ import annotations

import logging

import pytest
import trio

from agentrl.envs.base import Task
from agentrl.episode.evaluation import evaluate
from agentrl.episode.rollout import run_episode, run_group, toolbox_for
from agentrl.episode.turn import EpisodeFailed, EpisodeLimits, GroupLost
from tests._actors_helpers import HttpEngineClient, ScriptedEngine, TurnScript, load_tokenizer, tiny_tokenizer_dir
from tests._actors_user_env import AddEnv, solver

TASK = Task(id="t1", data={"a": 12, "b": 30})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(tiny_tokenizer_dir(tmp_path_factory))


def _episode(engine: ScriptedEngine, tokenizer, limits: EpisodeLimits):
    env = AddEnv()

    async def main():
        async with HttpEngineClient([engine.url]) as client:
            with trio.fail_after(60):
                return await run_episode(client, tokenizer, env, toolbox_for(env), TASK, {"temperature": 1.0}, limits)

    return trio.run(main)


def test_an_engine_still_at_default_is_waited_for_until_the_learner_sets_a_version(tokenizer, caplog):
    script = TurnScript(tokenizer, solver)
    engine = ScriptedEngine(lambda ids, params: script(ids, params))
    engine.version = "default"
    calls = []

    def policy(ids, params):  # the third request finds the version set (by "the learner")
        calls.append(1)
        if len(calls) == 3:
            engine.version = 4
        return script(ids, params)

    engine.policy = policy
    with engine, caplog.at_level(logging.WARNING, logger="agentrl.episode.rollout"):
        traj = _episode(engine, tokenizer, EpisodeLimits(max_new_tokens_per_turn=96))
    assert traj.reward == 1.0
    assert set(traj.weight_versions[traj.loss_mask == 1].tolist()) == {4}  # nothing kept from "default"
    assert len(engine.requests) == 2 + traj.metadata["num_turns"]  # two replies dropped, then one per turn
    waiting = [r.getMessage() for r in caplog.records if "'default'" in r.getMessage()]
    assert len(waiting) == 1 and engine.url in waiting[0] and "--weight-version 0" in waiting[0]


def test_default_for_too_long_fails_the_episode_with_what_to_do(tokenizer):
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:
        engine.version = "default"
        with pytest.raises(EpisodeFailed, match=r"still reports weight_version 'default'.*--weight-version 0") as e:
            _episode(engine, tokenizer, EpisodeLimits(max_new_tokens_per_turn=96, max_version_wait_s=0.5))
    assert engine.url in str(e.value)


def test_a_version_that_is_not_a_number_fails_at_once_naming_the_engine(tokenizer):
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:
        engine.version = "step-12"

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                with trio.fail_after(30):
                    return await run_group(
                        client,
                        tokenizer,
                        env,
                        toolbox_for(env),
                        TASK,
                        {"temperature": 1.0},
                        EpisodeLimits(max_new_tokens_per_turn=96),
                        2,
                    )

        with pytest.raises(GroupLost, match=r"reports weight_version 'step-12'.*--weight-version 0") as e:
            trio.run(main)
        assert engine.url in str(e.value) and len(engine.requests) <= 2  # one per episode at most: no retry


def test_evaluation_takes_any_version(tokenizer):
    env = AddEnv()
    with ScriptedEngine(TurnScript(tokenizer, solver)) as engine:
        engine.version = "default"

        async def main():
            async with HttpEngineClient([engine.url]) as client:
                with trio.fail_after(60):
                    return await evaluate(
                        client, tokenizer, env, [TASK], limits=EpisodeLimits(max_new_tokens_per_turn=96)
                    )

        result = trio.run(main)
    assert result["n"] == 1 and result["n_failed"] == 0 and result["success_rate"] == 1.0
