"""The weight push end to end against real embedded engine processes.

* After an update, a turn that continues a cached prefix must not reuse K/V computed under the
  old weights (the learner flushes the cache on the last bucket; an engine honours
  ``flush_cache`` as SGLang does).
* An actor whose engine still reports SGLang's ``"default"`` waits until the learner connects
  and sets the version, then plays on.
* SGLang-strict engines: ``--tp-size 2`` (two ranks in the weight group), an admin key, and a
  build without ``/begin_weight_update``/``/end_weight_update``.
"""

from __future__ import annotations

import logging
import time

import httpx
import pytest
import torch
import trio

from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.launch import EngineProcess, wait_ready
from agentrl.learner.weight_push import EngineLost, WeightUpdater, full_tensors, plan_buckets, without_tied_head
from agentrl.net import free_port
from tests.conftest_engine import ENGINE_FLAGS, Teacher, max_abs_diff


def _start(model, log_dir, *flags: str) -> list[EngineProcess]:
    """One engine per flag list, started together."""
    procs = [
        EngineProcess(str(model), free_port(), extra=[*ENGINE_FLAGS, *f], log_path=log_dir / f"engine{i}.log").start(
            wait_s=0
        )
        for i, f in enumerate(flags)
    ]
    try:
        for p in procs:
            wait_ready(p.url, 240, process=p.process)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@pytest.fixture(scope="module")
def engine(engine_model, tmp_path_factory):
    (proc,) = _start(engine_model, tmp_path_factory.mktemp("push_engine"), ["--weight-version", "0"])
    yield proc
    proc.stop()


def _versions(*urls: str, api_key: str = "") -> list[str]:
    """The ``weight_version`` each engine reports (``/model_info``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return [str(httpx.get(u + "/model_info", headers=headers, timeout=10).json()["weight_version"]) for u in urls]


def _perturbed(model_path, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _greedy(url: str, prompt: list[int], n: int = 8, headers: dict | None = None) -> tuple[list[int], list[float]]:
    body = httpx.post(
        url + "/generate",
        headers=headers,
        timeout=60,
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        },
    ).json()
    return body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]


def _cache_hits(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["prefix_cache_hit_tokens"]


def test_a_turn_after_an_update_is_computed_with_the_new_weights_only(engine, engine_model):
    """Turn 1 under the old weights fills the prefix cache; after the update, turn 2 continues
    that prefix: its logprobs must be a teacher-forced recompute under the NEW weights. (With
    ``flush_cache: false`` on every bucket, as the learner sent before, an engine that keeps its
    cache unless told, like SGLang, serves turn 2 from old-policy K/V and this fails.)"""
    url = engine.url
    new = _perturbed(engine_model, seed=5)
    prompt = [5, 17, 42, 99, 7, 3, 250, 31, 64, 12]
    out1, _ = _greedy(url, prompt)
    probe = prompt + out1 + [1, 2, 3]  # the setup is sound: a continuation is served from the cache
    hits = _cache_hits(url)
    _greedy(url, probe, 1)
    assert _cache_hits(url) > hits
    with WeightUpdater([url], bucket_bytes=1 << 20) as updater:
        updater.push(list(new.named_parameters()), 1)
        try:
            turn2 = prompt + out1 + [9, 8, 7]
            out2, lps = _greedy(url, turn2)
            assert max_abs_diff(lps, Teacher(new).logprobs(turn2, out2)) <= 1e-4
            assert max_abs_diff(lps, Teacher(engine_model).logprobs(turn2, out2)) > 1e-2  # the weights did change
        finally:
            updater.push_from_disk(str(engine_model), 0)


class _Seen(logging.Handler):
    """Sets a trio event when a log message contains ``text`` (logged from the trio thread)."""

    def __init__(self, text: str, event: trio.Event):
        super().__init__()
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_an_actor_waits_for_the_learner_to_set_the_engines_version(engine, engine_model):
    from transformers import AutoTokenizer

    from agentrl.episode.rollout import run_episode, toolbox_for
    from agentrl.episode.turn import EpisodeLimits
    from tests._actors_user_env import AddEnv

    url = engine.url
    r = httpx.post(url + "/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert r.status_code == 200  # as SGLang started without --weight-version
    tokenizer = AutoTokenizer.from_pretrained(engine_model)
    env = AddEnv()
    limits = EpisodeLimits(max_turns=2, max_total_tokens=512, max_new_tokens_per_turn=16)
    task = next(env.tasks())
    logger = logging.getLogger("agentrl.episode.rollout")

    def learner_connects() -> list[str]:
        from transformers import AutoModelForCausalLM

        with WeightUpdater([url]) as updater:
            updater.connect()
            assert updater.lagging(0) == [url]  # "default": no policy's weights, so it gets the learner's
            model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
            updater.push(list(model.named_parameters()), 0)
            return _versions(url)

    async def main():
        waiting = trio.Event()
        handler = _Seen(f"{url} reports weight_version 'default'", waiting)
        logger.addHandler(handler)
        out: dict = {}
        try:
            with trio.fail_after(180):
                async with EngineClient([url]) as client:

                    async def play():
                        out["traj"] = await run_episode(
                            client, tokenizer, env, toolbox_for(env), task, {"temperature": 1.0}, limits
                        )

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(play)
                        await waiting.wait()  # the actor is waiting, not failing
                        assert "traj" not in out
                        out["versions"] = await trio.to_thread.run_sync(learner_connects)
        finally:
            logger.removeHandler(handler)
        return out

    out = trio.run(main)
    assert out["versions"] == ["0"]
    traj = out["traj"]
    assert traj.metadata["num_turns"] >= 1
    assert set(traj.weight_versions[traj.loss_mask == 1].tolist()) == {0}


def test_the_learner_sets_the_version_before_its_first_progress_message(engine, engine_model, tmp_path):
    """What deadlocked a run against SGLang without --weight-version: the engine said "default",
    every episode failed, no group reached the learner, so it never pushed. Now the engine
    reports the learner's version before any actor is let in."""
    import numpy as np

    from agentrl.config import load_config
    from agentrl.learner.distributed import init_distributed
    from agentrl.learner.loop import Learner, LearnerIO
    from tests._learner_helpers import ListSource, make_group

    url = engine.url
    assert httpx.post(url + "/update_weight_version", json={"new_version": "default"}).status_code == 200
    seen: list[tuple[int, str]] = []

    class Progress:
        def publish(self, progress) -> None:  # what an actor would see when this message arrives
            seen.append((progress.policy_version, httpx.get(url + "/model_info", timeout=10).json()["weight_version"]))

        def close(self) -> None:
            pass

    init_distributed("cpu")
    cfg = load_config(
        None,
        [
            f'model.path="{engine_model}"',
            f'run.run_dir="{tmp_path}"',
            "learner.max_steps=1",
            "learner.groups_per_step=1",
            "learner.max_tokens_per_microbatch=128",
            "learner.checkpoint_every_steps=0",
            'learner.device="cpu"',
            "tracking.enabled=false",
            "actors.group_size=4",
            f"engine.urls=['{url}']",
            "engine.weight_group_backend=gloo",
        ],
    )
    weights = WeightUpdater.from_config(cfg.engine)
    weights.connect()
    io = LearnerIO(source=ListSource([make_group(np.random.default_rng(0))]), progress=Progress(), weights=weights)
    try:
        assert Learner(cfg, io=io).run() == "done"
    finally:
        with WeightUpdater([url]) as restore:
            restore.push_from_disk(str(engine_model), 0)
    assert seen[0] == (0, "0")  # pushed before the first message
    assert seen[-1] == (1, "1")


def test_e2e_after_engine_strict_tp_ranks_keys_and_no_begin_end(engine_model, tmp_path, monkeypatch, caplog):
    """Engine A joins with 2 TP ranks and reports "default"; engine B has no begin/end; both want
    keys. The learner's group has world 4 (offsets 1 and 3), A lags (it gets the weights), a push reaches
    both, B's missing begin/end is warned about once, and a client without keys is refused."""
    from agentrl.config import load_config

    api, admin = "e2e-api-key-1234", "e2e-admin-key-5678"
    keys = ["--api-key", api, "--admin-api-key", admin]
    a, b = _start(
        engine_model,
        tmp_path,
        ["--tp-size", "2", "--weight-version", "default", *keys],
        ["--disable-weight-update-bracket", "--weight-version", "0", *keys],
    )
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", api)
    monkeypatch.setenv("AGENTRL_ENGINE_ADMIN_API_KEY", admin)
    cfg = load_config(
        None, [f"engine.urls=['{a.url}', '{b.url}']", "engine.weight_group_backend=gloo", "engine.weight_bucket_mb=1"]
    )
    new = _perturbed(engine_model, seed=6)
    try:
        with WeightUpdater.from_config(cfg.engine) as updater, caplog.at_level(logging.WARNING):
            updater.connect()
            assert (updater.rank_offsets, updater.world_size) == ([1, 3], 4)
            assert updater.lagging(0) == [a.url] and _versions(a.url, b.url, api_key=api) == ["default", "0"]
            updater.push(list(new.named_parameters()), 1)
            updater.push(list(new.named_parameters()), 2)
        assert len([r for r in caplog.records if "begin_weight_update" in r.getMessage()]) == 1
        prompt = [3, 1, 4, 1, 5]
        for url in (a.url, b.url):
            out, lps = _greedy(url, prompt, headers={"Authorization": f"Bearer {api}"})
            assert max_abs_diff(lps, Teacher(new).logprobs(prompt, out)) <= 1e-4

        async def no_keys():
            async with EngineClient([a.url]) as client:
                await client.generate(prompt, {"max_new_tokens": 1})

        with pytest.raises(EngineRequestError, match="401"):
            trio.run(no_keys)
    finally:
        for p in (a, b):
            p.stop()
    assert api not in caplog.text and admin not in caplog.text


def _kill_9(proc: EngineProcess) -> None:
    import os
    import signal

    os.killpg(proc.process.pid, signal.SIGKILL)
    proc.process.wait()


def _restarted(proc: EngineProcess, *flags: str) -> EngineProcess:
    """The same server again on the same port, as a supervisor restarts it (its own flags)."""
    port = int(proc.url.rsplit(":", 1)[1])
    again = EngineProcess(proc.argv[proc.argv.index("--model") + 1], port, extra=list(flags), log_path=proc.log_path)
    again.start(wait_s=0)
    wait_ready(again.url, 240, process=again.process)
    return again


def test_an_engine_killed_and_restarted_rejoins_the_group_and_serves_the_policy(engine_model, tmp_path):
    """kill -9 of one of two engines: its next push breaks at once (EngineLost, no hang), the
    survivor is not left stuck, the group is re-formed without it and the push reaches the
    survivor; restarted without a version it reports "default" (actors wait on it), the learner
    notices, re-forms the group with both and pushes: the restarted engine then answers with
    the learner's version and exactly the learner's weights. The actors' client takes it back."""
    restart_flags = [*ENGINE_FLAGS[:-1], "default"]  # what agentrl's supervisor restarts an engine with
    a, b = _start(engine_model, tmp_path, ENGINE_FLAGS, ENGINE_FLAGS)
    new1, new2 = _perturbed(engine_model, seed=7), _perturbed(engine_model, seed=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        with WeightUpdater([a.url, b.url], bucket_bytes=1 << 18, probe_timeout_s=2.0) as updater:
            updater.connect()
            updater.push(list(new1.named_parameters()), 1)
            assert updater.membership_change(1) == "" and updater.lagging(1) == []

            # B dies in the middle of a push (after the pause, while the first bucket is gathered)
            plan = plan_buckets(without_tied_head(list(new2.named_parameters())), updater.bucket_bytes)
            assert len(plan) >= 2
            gathered: list[int] = []

            def materialize(bucket):
                if not gathered:
                    _kill_9(b)
                gathered.append(1)
                return full_tensors(bucket)

            started = time.monotonic()
            with pytest.raises(EngineLost):  # the member is gone: its HTTP call and the broadcast break
                updater.push_plan(plan, 2, materialize)
            assert time.monotonic() - started < 60 and len(gathered) == len(plan)
            assert updater.group is None
            # the survivor is not stuck in a receive, and answers without a policy's number: it may
            # hold part of version 2
            assert httpx.get(a.url + "/model_info", timeout=10).json()["weight_version"] == "default"
            assert updater.membership_change(2) == f"{b.url} does not answer"
            updater.connect()
            assert updater.members == [a.url] and updater.world_size == 2 and updater.lagging(2) == [a.url]
            updater.push(list(new2.named_parameters()), 2)
            out, lps = _greedy(a.url, prompt)
            assert max_abs_diff(lps, Teacher(new2).logprobs(prompt, out)) <= 1e-4

            b = _restarted(b, *restart_flags)
            assert httpx.get(b.url + "/model_info", timeout=10).json()["weight_version"] == "default"
            reason = updater.membership_change(2)
            assert reason == f"{b.url} answers and is not in the group", reason
            updater.connect()
            assert updater.members == [a.url, b.url] and updater.lagging(2) == [b.url]
            updater.push(list(new2.named_parameters()), 2)
            assert _versions(a.url, b.url) == ["2", "2"] and updater.membership_change(2) == ""
            for url in (a.url, b.url):
                out, lps = _greedy(url, prompt)
                assert max_abs_diff(lps, Teacher(new2).logprobs(prompt, out)) <= 1e-4

            # restarted by something else, e.g. Kubernetes with --weight-version 0: a number this
            # updater did not leave there is a restart too
            _kill_9(b)
            b = _restarted(b, *ENGINE_FLAGS)
            assert updater.membership_change(2) == f"{b.url} reports weight_version '0', not '2' (restarted?)"
    finally:
        for p in (a, b):
            p.stop()


def test_the_client_takes_a_restarted_engine_back_and_a_call_in_flight_does_not_hang(engine_model, tmp_path):
    """A /generate in flight on an engine that is killed: with another engine it is retried
    there; with none, and no retries, it fails at once with EngineUnavailableError (the actor
    counts its group as lost). The health loop drops the dead engine and re-admits it after
    its restart."""
    from agentrl.engine.client import EngineUnavailableError

    a, b = _start(engine_model, tmp_path, ENGINE_FLAGS, ENGINE_FLAGS)
    long = {"max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True}
    try:

        async def main():
            with trio.fail_after(240):
                async with (
                    EngineClient([a.url, b.url], health_check_interval_s=0.2) as both,
                    EngineClient([b.url], max_retries=0, health_check_interval_s=0.2) as only_b,
                ):
                    results: dict = {}

                    async def call(name, client, key):
                        try:
                            results[name] = await client.generate([1, 2, 3], long, affinity_key=key)
                        except EngineUnavailableError as e:
                            results[name] = e

                    both._affinity["episode"] = both.engines[1]  # the episode's turns go to B
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(call, "retried", both, "episode")
                        nursery.start_soon(call, "alone", only_b, None)
                        async with httpx.AsyncClient(timeout=10) as http:
                            while True:  # both calls are generating on B (bounded by the fail_after)
                                info = (await http.get(b.url + "/server_info")).json()
                                if info["num_running"] >= 2 and info["num_generated_tokens"] > 0:
                                    break
                                await trio.sleep(0.02)
                        await trio.to_thread.run_sync(_kill_9, b)
                    assert results["retried"].url == a.url and len(results["retried"].output_ids) == 600
                    assert isinstance(results["alone"], EngineUnavailableError)
                    assert [s.url for s in both.engines if s.healthy] == [a.url]
                    restarted = await trio.to_thread.run_sync(lambda: _restarted(b, *ENGINE_FLAGS))
                    while b.url not in [s.url for s in both.engines if s.healthy]:
                        await trio.sleep(0.05)
                    return restarted

        b = trio.run(main)
    finally:
        for p in (a, b):
            p.stop()


def test_a_new_learner_cleans_up_what_a_learner_killed_mid_push_left_on_the_engine(engine, engine_model):
    """A learner killed between pause and end leaves the engine paused, labelled "default", inside
    an update session and holding a group whose trainer is gone. The next learner's updater
    continues generation when it forms its group, and its first push ends the stale session and
    goes through."""
    url = engine.url
    old = WeightUpdater([url])
    old.connect()  # the dead learner's group
    for path, body in (
        ("/pause_generation", {"mode": "abort"}),
        ("/begin_weight_update", {}),
        ("/update_weight_version", {"new_version": "default", "abort_all_requests": False}),
    ):
        assert httpx.post(url + path, json=body, timeout=10).status_code == 200
    old._drop_group()  # its trainer end is gone, as with SIGKILL (the engine still holds its group)
    info = httpx.get(url + "/server_info", timeout=10).json()
    assert info["paused"] and info["updating_weights"]
    model = _perturbed(engine_model, seed=9)
    try:
        with WeightUpdater([url]) as updater:
            updater.connect()
            assert not httpx.get(url + "/server_info", timeout=10).json()["paused"]
            assert updater.lagging(0) == [url]
            updater.push(list(model.named_parameters()), 0)
            prompt = [2, 7, 1, 8, 2, 8]
            out, lps = _greedy(url, prompt)
            assert max_abs_diff(lps, Teacher(model).logprobs(prompt, out)) <= 1e-4
            info = httpx.get(url + "/server_info", timeout=10).json()
            assert not info["paused"] and not info["updating_weights"] and info["weight_version"] == "0"
    finally:
        old.close()
        with WeightUpdater([url]) as restore:
            restore.push_from_disk(str(engine_model), 0)


def test_the_first_group_waits_for_an_engine_that_is_still_loading(engine_model, tmp_path):
    """A learner started before its engines (learner.engines_start_timeout_s): its first group waits
    until they answer instead of leaving them out until an engine check; an engine that never answers
    is left out once the wait is over."""
    proc = EngineProcess(str(engine_model), free_port(), extra=ENGINE_FLAGS, log_path=tmp_path / "e.log").start(
        wait_s=0
    )
    nobody = f"http://127.0.0.1:{free_port()}"
    try:
        with WeightUpdater([proc.url], backend="gloo") as updater:
            assert updater.probe() == {proc.url: None}  # still importing
            updater.wait_until_answering(240)
            updater.connect()
            assert updater.members == [proc.url]
        with WeightUpdater([nobody], backend="gloo", probe_timeout_s=0.2) as updater:
            updater.wait_until_answering(0.5)
            updater.connect()
            assert updater.members == []
    finally:
        proc.stop()
