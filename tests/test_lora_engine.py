"""LoRA adapter updates end to end: the learner's adapter, written as a PEFT folder and loaded
through ``/load_lora_adapter`` into a real embedded engine process, serves the learner's policy;
the engine's LoRA routes answer as SGLang's do, and ``lora_path`` is checked as documented."""

from __future__ import annotations

import httpx
import pytest
import torch

from agentrl.config import LORA_ADAPTER_NAME
from agentrl.learner.lora import LoraSpec
from tests._learner_helpers import fixed_samples, tiny_model  # noqa: F401
from tests.conftest_engine import Teacher, max_abs_diff, start_engines

SPEC = LoraSpec(rank=4, alpha=8.0)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


@pytest.fixture(scope="module")
def dist_info():
    from agentrl.learner.distributed import init_distributed

    torch.set_num_threads(1)
    return init_distributed("cpu")


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    (proc,) = start_engines(tiny_model, 1, tmp_path_factory.mktemp("lora_engine"))
    yield proc
    proc.stop()


def _trainer(path, dist_info):
    from agentrl.learner.trainer import Trainer, TrainerSpec

    return Trainer(TrainerSpec(model_path=str(path), lr=5e-2, max_tokens_per_microbatch=96, lora=SPEC), dist_info)


def _generate(url: str, lora_path=None, prompt=PROMPT, n: int = 10) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    return httpx.post(url + "/generate", json=body, timeout=60)


def _logprobs(resp: httpx.Response) -> tuple[list[int], list[float]]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]


def _merged_teacher(base_path, trainer) -> Teacher:
    from transformers import AutoModelForCausalLM

    from tests._learner_helpers import iter_full_tensors

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model.load_state_dict(dict(iter_full_tensors(trainer.policy)), strict=False)
    return Teacher(model)


def test_adapter_pushes_serve_the_learners_policy_and_unload_restores_the_base(tiny_model, dist_info, engine, tmp_path):
    from agentrl.learner.weight_push import WeightUpdater, push_adapter

    url = engine.url
    base = Teacher(tiny_model)
    base_out, base_lp = _logprobs(_generate(url))
    trainer = _trainer(tiny_model, dist_info)
    updater = WeightUpdater([url], backend="gloo")
    try:
        for version in (1, 2):  # the second push unloads the first adapter, then loads the new one
            trainer.rl_step(fixed_samples(20 + version))
            stats = push_adapter(
                trainer.policy,
                updater,
                version,
                folder_root=tmp_path / "adapters",
                spec=SPEC,
                base_model_path=str(tiny_model),
            )
            assert stats["bytes"] == sum(p.numel() * 4 for n, p in trainer.policy.named_parameters() if p.requires_grad)
            resp = _generate(url, LORA_ADAPTER_NAME)
            out, lp = _logprobs(resp)
            assert resp.json()["meta_info"]["weight_version"] == str(version)
            assert max_abs_diff(lp, _merged_teacher(tiny_model, trainer).logprobs(PROMPT, out)) <= 1e-4
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v00000001", "v00000002"]
        assert max_abs_diff(lp, base.logprobs(PROMPT, out)) > 1e-3  # the adapter does change the policy
        # without lora_path a request runs on the same weights (one adapter, merged: unlike SGLang's base)
        assert max_abs_diff(_logprobs(_generate(url))[1], lp) <= 1e-5

        unloaded = httpx.post(url + "/unload_lora_adapter", json={"lora_name": LORA_ADAPTER_NAME}, timeout=30)
        assert unloaded.status_code == 200
        assert unloaded.json() == {"success": True, "error_message": None, "loaded_adapters": {}}
        assert _logprobs(_generate(url)) == (base_out, base_lp)  # the base weights exactly, not base + d - d
        refused = _generate(url, LORA_ADAPTER_NAME)
        assert refused.status_code == 400 and "not loaded" in refused.json()["error"]["message"]
    finally:
        updater.close()
        httpx.post(url + "/update_weight_version", json={"new_version": "0"}, timeout=10)


def test_lora_routes_answer_as_sglang_and_lora_path_is_checked(tiny_model, dist_info, engine, tmp_path):
    from agentrl.learner.lora import adapter_parameters, write_adapter
    from agentrl.learner.weight_push import full_tensors

    url = engine.url
    never = _generate(url, "never-loaded")
    assert never.status_code == 400 and "has never been loaded: 'never-loaded'" in never.json()["error"]["message"]
    for bad in ({"input_ids": PROMPT, "lora_path": 3}, {"input_ids": [PROMPT, PROMPT], "lora_path": ["a"]}):
        resp = httpx.post(url + "/generate", json=bad, timeout=10)
        assert resp.status_code == 400 and "lora_path" in resp.json()["error"]["message"]

    trainer = _trainer(tiny_model, dist_info)
    trainer.rl_step(fixed_samples(30))
    folder = write_adapter(tmp_path / "a", dict(full_tensors(adapter_parameters(trainer.policy))), SPEC)
    missing = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400
    assert missing.json()["success"] is False and "adapter_config.json" in missing.json()["error_message"]
    no_name = httpx.post(url + "/load_lora_adapter", json={"lora_path": str(folder)})
    assert no_name.status_code == 400 and "lora_name" in no_name.json()["message"]  # SGLang's ErrorResponse
    before = _logprobs(_generate(url))
    for name, (a_shape, b_shape), needle in (
        ("model.layers.99.self_attn.q_proj", ((4, 128), (128, 4)), "no layer"),
        ("model.layers.0.self_attn.q_proj", ((4, 3), (5, 4)), "the weight is"),
        ("model.layers.0.self_attn", ((4, 128), (128, 4)), "no layer"),
    ):
        bad = tmp_path / f"bad{len(needle)}{a_shape[1]}"
        write_adapter(
            bad,
            {
                f"{name}.lora_A.default.weight": torch.ones(a_shape),
                f"{name}.lora_B.default.weight": torch.ones(b_shape),
            },
            SPEC,
        )
        refused = httpx.post(url + "/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, timeout=30)
        assert refused.status_code == 400 and needle in refused.json()["error_message"], refused.text
    after_out, after_lp = _logprobs(_generate(url))
    assert after_out == before[0] and max_abs_diff(after_lp, before[1]) <= 1e-5  # nothing was merged

    # a turn fills the prefix cache; the load must empty it (K/V of the base weights)
    _generate(url, prompt=PROMPT * 2)
    assert httpx.get(url + "/server_info").json()["prefix_cache_tokens"] > 0
    loaded = httpx.post(url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folder)}, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"success": True, "error_message": None, "loaded_adapters": {"a": str(folder)}}
    assert httpx.get(url + "/server_info").json()["prefix_cache_tokens"] == 0
    try:
        again = httpx.post(url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folder)})
        assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
        second = httpx.post(url + "/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folder)})
        assert second.status_code == 400 and "one LoRA adapter at a time" in second.json()["error_message"]
        batch = httpx.post(
            url + "/generate",
            timeout=60,
            json={
                "input_ids": [PROMPT, PROMPT],
                "lora_path": ["a", None],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
            },
        )
        assert batch.status_code == 200 and len(batch.json()) == 2
        wrong = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "b"})
        assert wrong.status_code == 400 and "LoRA with name b does not exist" in wrong.json()["error_message"]
    finally:
        assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "a"}, timeout=30).status_code == 200
    # an adapter that was loaded but is unloaded: accepted only while paused (the learner's swap)
    assert _generate(url, "a").status_code == 400
    httpx.post(url + "/pause_generation", json={"mode": "abort"}, timeout=10)
    try:
        with pytest.raises(httpx.ReadTimeout):  # accepted: it waits in the queue like any paused request
            httpx.post(
                url + "/generate",
                json={
                    "input_ids": PROMPT,
                    "lora_path": "a",
                    "rid": "paused-lora",
                    "sampling_params": {"max_new_tokens": 1},
                },
                timeout=1.0,
            )
    finally:
        httpx.post(url + "/abort_request", json={"rid": "paused-lora"}, timeout=10)
        httpx.post(url + "/continue_generation", json={}, timeout=10)


def test_a_full_update_under_a_merged_adapter_replaces_the_base_beneath_it(tiny_model, dist_info, engine, tmp_path):
    """SGLang keeps serving an adapter over new base weights; the embedded engine merges it again on
    top of the updated weights, and an unload then leaves the updated base."""
    from transformers import AutoModelForCausalLM

    from agentrl.learner.lora import adapter_parameters, write_adapter
    from agentrl.learner.weight_push import WeightUpdater, full_tensors

    url = engine.url
    trainer = _trainer(tiny_model, dist_info)
    trainer.rl_step(fixed_samples(40))
    folder = write_adapter(tmp_path / "a", dict(full_tensors(adapter_parameters(trainer.policy))), SPEC)
    new_base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new_base.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert httpx.post(url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folder)}).status_code == 200
    with WeightUpdater([url], backend="gloo", bucket_bytes=64 << 10) as updater:  # several buckets
        try:
            updater.push(list(new_base.named_parameters()), version=5)
            out, lp = _logprobs(_generate(url, "a"))
            # expected: the new base with the same adapter merged
            expected = new_base
            adapted = _merged_teacher(tiny_model, trainer).model.state_dict()
            base_sd = original.state_dict()
            with torch.no_grad():
                for name, p in expected.named_parameters():
                    p.add_(adapted[name] - base_sd[name])
            assert max_abs_diff(lp, Teacher(expected).logprobs(PROMPT, out)) <= 1e-4
            assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
            with torch.no_grad():
                for name, p in expected.named_parameters():
                    p.sub_(adapted[name] - base_sd[name])
            out, lp = _logprobs(_generate(url))
            assert max_abs_diff(lp, Teacher(expected).logprobs(PROMPT, out)) <= 1e-4
        finally:
            updater.push(list(original.named_parameters()), version=0)  # leave the engine as it was


# ------------------------------------------------------------------ adapter mode in a run: nothing fails


def _adapter_run(tiny_model, run_dir):
    """A planned ``sync = "adapter"`` run with one engine, the engine's ChildSpec (as ``agentrl run``
    starts and restarts it) and a learner on it (its real weight updater, no actors)."""
    from agentrl.config import load_config
    from agentrl.learner.loop import Learner, LearnerIO
    from agentrl.learner.weight_push import WeightUpdater
    from agentrl.run.placement import placement_for
    from agentrl.run.process_plan import engine_specs, plan_config
    from tests._learner_helpers import ListSource, Recorder

    cfg = load_config(
        None,
        [
            f'model.path="{tiny_model}"',
            f'run.run_dir="{run_dir}"',
            "run.torch_num_threads=1",
            "learner.lora.rank=4",
            "learner.lora.alpha=8.0",
            "learner.lora.sync=adapter",
            'learner.device="cpu"',
            "learner.max_tokens_per_microbatch=96",
            "learner.lr=5e-2",
            "tracking.enabled=false",
            "engine.max_context_tokens=1024",
        ],
    )
    placement = placement_for(cfg, ())
    cfg = plan_config(cfg, run_dir, str(tiny_model), placement)
    (spec,) = engine_specs(cfg, run_dir, placement)
    for argv in (spec.argv, spec.restart_argv):  # first start and restart: no version until the adapter is in
        assert argv[argv.index("--weight-version") + 1] == "default"

    def learner() -> Learner:
        updater = WeightUpdater.from_config(cfg.engine)
        updater.connect()
        return Learner(cfg, io=LearnerIO(source=ListSource([]), progress=Recorder(), weights=updater))

    return cfg, spec, learner


def _start_spec(spec, argv, url: str, log_path):
    from agentrl.engine.launch import EngineProcess

    proc = EngineProcess(spec.argv[spec.argv.index("--model") + 1], int(url.rsplit(":", 1)[1]), log_path=log_path)
    proc.argv = list(argv)
    return proc.start(wait_s=240)


async def _until(condition, timeout_s: float, what: str) -> None:
    """Poll ``condition`` (it depends on another process's answers) until it holds."""
    import trio

    deadline = trio.current_time() + timeout_s
    while not condition():
        assert trio.current_time() < deadline, f"not within {timeout_s} s: {what}"
        await trio.sleep(0.05)


async def _episode_waits_until(url: str, tokenizer, bring_adapter) -> object:
    """An actor's episode naming the adapter on ``url``; once it waits, ``bring_adapter()`` runs
    (in a thread, as the learner's process would); returns the episode's trajectory."""
    import trio

    from agentrl.engine.client import EngineClient
    from agentrl.envs.base import Task
    from agentrl.episode import rollout
    from agentrl.episode.rollout import run_episode, toolbox_for
    from agentrl.episode.turn import EpisodeLimits
    from tests._actors_user_env import AddEnv

    env, out = AddEnv(), {}
    limits = EpisodeLimits(max_turns=2, max_new_tokens_per_turn=8, max_total_tokens=512)

    async def play(client) -> None:
        out["traj"] = await run_episode(
            client, tokenizer, env, toolbox_for(env), Task(id="t", data={"a": 1, "b": 2}), {"temperature": 0.0}, limits
        )

    async with EngineClient([url], lora_path=LORA_ADAPTER_NAME) as client:
        with trio.fail_after(200):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(play, client)
                await _until(lambda: url in rollout._waiting_logged, 60, "the episode waits")
                assert "traj" not in out
                refused = await trio.to_thread.run_sync(lambda: _generate(url, LORA_ADAPTER_NAME))
                assert refused.status_code == 400, refused.text  # what SGLang answers: nothing holds it
                assert "never been loaded" in refused.json()["error"]["message"]
                await trio.to_thread.run_sync(bring_adapter)
    return out["traj"]


def _versions(traj) -> set[int]:
    return set(traj.weight_versions[traj.loss_mask == 1].tolist())


def test_a_fresh_adapter_run_s_first_episodes_wait_for_the_learner_s_adapter(tiny_model, dist_info, tmp_path):
    """Engines of an adapter run start at "default" without the adapter; an actor's request naming
    it (SGLang: 400) waits instead of failing, until the learner's start loads it as version 0."""
    import trio
    from transformers import AutoTokenizer

    cfg, spec, new_learner = _adapter_run(tiny_model, tmp_path / "run")
    url = cfg.engine.urls[0]
    proc = _start_spec(spec, spec.argv, url, tmp_path / "engine.log")
    try:
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "default"
        learner = new_learner()
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)

        def learner_starts() -> None:  # Learner.run's first lines: check the engines, push where needed
            learner._update_engines(learner._engines_changed())

        try:
            traj = trio.run(_episode_waits_until, url, tokenizer, learner_starts)
        finally:
            learner.io.close()
        assert _versions(traj) == {0} and traj.metadata["num_turns"] >= 1
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "0"
    finally:
        proc.stop()


def test_a_restarted_engine_gets_the_adapter_before_its_answers_count(tiny_model, dist_info, tmp_path):
    """An engine restarted mid-run comes back at "default" without the adapter: the episode on it
    waits; the learner notices the restart and loads its adapter (its first load into the new
    process: no unload to refuse); the episode then runs on the learner's policy."""
    import trio
    from transformers import AutoTokenizer

    cfg, spec, new_learner = _adapter_run(tiny_model, tmp_path / "run")
    url = cfg.engine.urls[0]
    proc = _start_spec(spec, spec.argv, url, tmp_path / "engine.log")
    learner = None
    try:
        learner = new_learner()
        learner._update_engines(learner._engines_changed())
        learner.trainer.rl_step(fixed_samples(21))
        learner.steps_since_sync = 1
        learner._sync_weights()
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "1"
        teacher = _merged_teacher(tiny_model, learner.trainer)

        proc.stop()
        proc = _start_spec(spec, spec.restart_argv, url, tmp_path / "engine-restarted.log")
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "default"
        reasons = []

        def learner_notices() -> None:  # what its poll does every ENGINE_CHECK_S
            reasons.append(learner._engines_changed())
            learner._update_engines(reasons[-1])

        traj = trio.run(_episode_waits_until, url, AutoTokenizer.from_pretrained(tiny_model), learner_notices)
        assert "restarted" in reasons[0]
        assert _versions(traj) == {1}
        assert httpx.get(url + "/model_info", timeout=10).json()["weight_version"] == "1"
        out, lp = _logprobs(_generate(url, LORA_ADAPTER_NAME))
        assert max_abs_diff(lp, teacher.logprobs(PROMPT, out)) <= 1e-4  # the learner's adapter, not the base
    finally:
        if learner is not None:
            learner.io.close()
        proc.stop()
