"""Engines ``agentrl run`` did not start (``engine.urls``): whatever an earlier run left in them
(other weights under any version number, a merged LoRA adapter), they hold this run's policy as
version 0 before the evaluation before RL (``agentrl.run.evaluate.load_policy_into_engines``, called
by ``agentrl.run.stages``). Real embedded engine processes; "a fresh engine" is one started on the policy."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agentrl.config import LORA_ADAPTER_NAME, load_config
from tests.conftest_engine import start_engines

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calculator" / "config.toml"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 31]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """This run's policy, and the weights an earlier run left in the external engine."""
    from agentrl.models.builder import init_model

    root = tmp_path_factory.mktemp("external_models")
    return init_model(root / "policy", "tiny", seed=0), init_model(root / "other", "tiny", seed=1)


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    """(fresh, external): both started on the policy at version 0; each test first leaves the
    external one as an earlier run would have."""
    procs = start_engines(models[0], 2, tmp_path_factory.mktemp("external_engine_logs"))
    yield procs
    for p in procs:
        p.stop()


def _greedy(url: str) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
    }
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _version(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=10).json()["weight_version"]


def _leave_other_weights(url: str, other: Path) -> None:
    resp = httpx.post(
        url + "/update_weights_from_disk", json={"model_path": str(other), "weight_version": "2"}, timeout=120
    )
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def test_the_evaluation_before_rl_sees_the_run_s_policy_on_an_engine_left_at_version_2(
    models, engines, tmp_path, monkeypatch
):
    """``agentrl run`` with ``engine.urls`` up to its evaluation before RL (the RL stage itself is
    left out: ``_train`` is cut to that evaluation, which is where it starts)."""
    import trio

    from agentrl.run import stages as run_module

    policy, other = models
    fresh, external = engines
    _leave_other_weights(external.url, other)
    assert _version(external.url) == "2" and _greedy(external.url) != _greedy(fresh.url)  # the attack is real
    seen: dict = {}

    async def evaluation_before_only(sup, outer, cfg, run_dir, state, *rest) -> None:
        seen["version"] = await trio.to_thread.run_sync(_version, external.url)
        seen["greedy"] = await trio.to_thread.run_sync(_greedy, external.url)
        state.eval_before = await run_module.evaluate_policy(cfg, name_adapter=False)

    monkeypatch.setattr(run_module, "_train", evaluation_before_only)
    cfg = load_config(
        EXAMPLE,
        [
            f"model.path={policy}",
            "sft.enabled=false",
            "eval.num_tasks=2",
            f'engine.urls=["{external.url}"]',
            "tracking.enabled=false",
            "run.torch_num_threads=1",
        ],
    )
    summary = run_module.run(cfg, tmp_path / "run", live_display=False)
    assert seen["version"] == "0"
    assert seen["greedy"] == _greedy(fresh.url)  # token for token, logprob for logprob
    assert summary["eval_before"]["n"] == 2 and summary["eval_before"]["n_failed"] == 0
    assert any("loaded this run's policy" in e for e in summary["events"])


def test_an_adapter_an_earlier_run_merged_is_dropped_before_the_evaluation(models, engines, tmp_path):
    """``sync = "adapter"``: the embedded engine merges an adapter into the weights every request
    runs on, so a stale one is unloaded too (the learner loads its own later)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from agentrl.run.evaluate import load_policy_into_engines

    policy, other = models
    fresh, external = engines
    torch.manual_seed(3)
    stale = get_peft_model(
        AutoModelForCausalLM.from_pretrained(policy),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    stale.save_pretrained(tmp_path / "stale_adapter")
    _leave_other_weights(external.url, other)
    loaded = httpx.post(
        external.url + "/load_lora_adapter",
        timeout=60,
        json={"lora_name": LORA_ADAPTER_NAME, "lora_path": str(tmp_path / "stale_adapter")},
    )
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text

    cfg = load_config(
        EXAMPLE,
        [f"model.path={policy}", f'engine.urls=["{external.url}"]', "learner.lora.rank=4", "learner.lora.sync=adapter"],
    )
    load_policy_into_engines(cfg)
    assert _version(external.url) == "0"
    assert _greedy(external.url) == _greedy(fresh.url)
    again = httpx.post(external.url + "/unload_lora_adapter", json={"lora_name": LORA_ADAPTER_NAME}, timeout=30)
    assert again.json()["loaded_adapters"] == {}  # nothing merged is left


def test_a_policy_the_engines_cannot_read_is_a_clear_error(models, engines, tmp_path):
    from agentrl.learner.weight_push import WeightUpdateError
    from agentrl.run.evaluate import load_policy_into_engines

    _, external = engines
    missing = tmp_path / "not-on-this-machine"
    cfg = load_config(EXAMPLE, [f"model.path={missing}", f'engine.urls=["{external.url}"]'])
    with pytest.raises(WeightUpdateError, match=r"must hold this run's policy.*readable at that path") as e:
        load_policy_into_engines(cfg)
    assert external.url in str(e.value) and str(missing) in str(e.value)
    assert _version(external.url) == "0"  # left as it was, and not paused:
    assert _greedy(external.url)
