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

import httpx
import pytest
import torch
import trio

from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.launch import EngineProcess, free_port, wait_ready
from agentrl.learner.weight_push import WeightUpdater
from tests.conftest_engine import ENGINE_FLAGS, Teacher, max_abs_diff


def _start(model, log_dir, *flags: str) -> list[EngineProcess]:
    """One engine per flag list, started together."""
    procs = [EngineProcess(str(model), free_port(), extra=[*ENGINE_FLAGS, *f], log_path=log_dir / f"engine{i}.log")
             .start(wait_s=0) for i, f in enumerate(flags)]
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


def _perturbed(model_path, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _greedy(url: str, prompt: list[int], n: int = 8, headers: dict | None = None) -> tuple[list[int], list[float]]:
    body = httpx.post(url + "/generate", headers=headers, timeout=60, json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}).json()
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

    from agentrl.actors.rollout import EpisodeLimits, run_episode, toolbox_for
    from tests._actors_user_env import AddEnv

    url = engine.url
    r = httpx.post(url + "/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert r.status_code == 200  # as SGLang started without --weight-version
    tokenizer = AutoTokenizer.from_pretrained(engine_model)
    env = AddEnv()
    limits = EpisodeLimits(max_turns=2, max_total_tokens=512, max_new_tokens_per_turn=16)
    task = next(env.tasks())
    logger = logging.getLogger("agentrl.actors.rollout")

    def learner_connects() -> list[str]:
        with WeightUpdater([url]) as updater:
            updater.connect()
            assert updater.align_versions(0) is False  # told its version, no push needed
            return updater.engine_versions()

    async def main():
        waiting = trio.Event()
        handler = _Seen(f"{url} reports weight_version 'default'", waiting)
        logger.addHandler(handler)
        out: dict = {}
        try:
            with trio.fail_after(180):
                async with EngineClient([url]) as client:
                    async def play():
                        out["traj"] = await run_episode(client, tokenizer, env, toolbox_for(env), task,
                                                        {"temperature": 1.0}, limits)

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
    cfg = load_config(None, [f'model.path="{engine_model}"', f'run.run_dir="{tmp_path}"', "learner.max_steps=1",
                             "learner.groups_per_step=1", "learner.max_tokens_per_microbatch=128",
                             "learner.checkpoint_every_steps=0", 'learner.device="cpu"', "tracking.enabled=false",
                             "actors.group_size=4", f"engine.urls=['{url}']", "engine.weight_group_backend=gloo"])
    weights = WeightUpdater.from_config(cfg.engine)
    weights.connect()
    io = LearnerIO(source=ListSource([make_group(np.random.default_rng(0))]), progress=Progress(), weights=weights)
    try:
        assert Learner(cfg, io=io).run() == "done"
    finally:
        with WeightUpdater([url]) as restore:
            restore.push_from_disk(str(engine_model), 0)
    assert seen[0] == (0, "0")  # set before the first message, without a push (the engine serves model.path)
    assert seen[-1] == (1, "1")


def test_e2e_after_engine_strict_tp_ranks_keys_and_no_begin_end(engine_model, tmp_path, monkeypatch, caplog):
    """Engine A joins with 2 TP ranks and reports "default"; engine B has no begin/end; both want
    keys. The learner's group has world 4 (offsets 1 and 3), A is told its version, a push reaches
    both, B's missing begin/end is warned about once, and a client without keys is refused."""
    from agentrl.config import load_config

    api, admin = "e2e-api-key-1234", "e2e-admin-key-5678"
    keys = ["--api-key", api, "--admin-api-key", admin]
    a, b = _start(engine_model, tmp_path, ["--tp-size", "2", "--weight-version", "default", *keys],
                  ["--disable-weight-update-bracket", "--weight-version", "0", *keys])
    monkeypatch.setenv("AGENTRL_ENGINE_API_KEY", api)
    monkeypatch.setenv("AGENTRL_ENGINE_ADMIN_API_KEY", admin)
    cfg = load_config(None, [f"engine.urls=['{a.url}', '{b.url}']", "engine.weight_group_backend=gloo",
                             "engine.weight_bucket_mb=1"])
    new = _perturbed(engine_model, seed=6)
    try:
        with WeightUpdater.from_config(cfg.engine) as updater, caplog.at_level(logging.WARNING):
            updater.connect()
            assert (updater.rank_offsets, updater.world_size) == ([1, 3], 4)
            assert updater.align_versions(0) is False and updater.engine_versions() == ["0", "0"]
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
