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
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return httpx.post(url + "/generate", json=body, timeout=60)


def _logprobs(resp: httpx.Response) -> tuple[list[int], list[float]]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]


def _merged_teacher(base_path, trainer) -> Teacher:
    from transformers import AutoModelForCausalLM

    from agentrl.learner.weight_push import iter_full_tensors

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model.load_state_dict(dict(iter_full_tensors(trainer.policy)), strict=False)
    return Teacher(model)


def test_adapter_pushes_serve_the_learners_policy_and_unload_restores_the_base(tiny_model, dist_info, engine,
                                                                               tmp_path):
    from agentrl.learner.weight_push import WeightUpdater, push_adapter

    url = engine.url
    base = Teacher(tiny_model)
    base_out, base_lp = _logprobs(_generate(url))
    trainer = _trainer(tiny_model, dist_info)
    updater = WeightUpdater([url], backend="gloo")
    try:
        for version in (1, 2):  # the second push unloads the first adapter, then loads the new one
            trainer.rl_step(fixed_samples(20 + version))
            stats = push_adapter(trainer.policy, updater, version, folder_root=tmp_path / "adapters", spec=SPEC,
                                 base_model_path=str(tiny_model))
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
            ("model.layers.0.self_attn", ((4, 128), (128, 4)), "no layer")):
        bad = tmp_path / f"bad{len(needle)}{a_shape[1]}"
        write_adapter(bad, {f"{name}.lora_A.default.weight": torch.ones(a_shape),
                            f"{name}.lora_B.default.weight": torch.ones(b_shape)}, SPEC)
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
        batch = httpx.post(url + "/generate", timeout=60, json={
            "input_ids": [PROMPT, PROMPT], "lora_path": ["a", None],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
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
            httpx.post(url + "/generate", json={"input_ids": PROMPT, "lora_path": "a", "rid": "paused-lora",
                                                "sampling_params": {"max_new_tokens": 1}}, timeout=1.0)
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
