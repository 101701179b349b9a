"""The FSDP2 trainer on one rank: steps, checkpoint resume, weight gathering, export, SFT."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.learner.loss import PolicyLossConfig
from tests._learner_helpers import fixed_samples, iter_full_tensors, sample_logprobs, tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def dist_info():
    from agentrl.learner.distributed import init_distributed

    torch.set_num_threads(1)
    return init_distributed("cpu")


def _samples(seed: int, groups: int = 4, policy_version: int = 0, advantage: str = "grpo"):
    return fixed_samples(seed, groups, policy_version, advantage)


def _spec(path, **kw):
    from agentrl.learner.trainer import TrainerSpec

    base = dict(model_path=str(path), lr=1e-3, max_tokens_per_microbatch=96, temperature=1.0)
    base.update(kw)
    return TrainerSpec(**base)


def _params(trainer) -> dict[str, torch.Tensor]:

    return {n: t.clone() for n, t in iter_full_tensors(trainer.policy)}


def test_rl_step_trains_and_reports(tiny_model, dist_info):
    from agentrl.learner.trainer import Trainer

    trainer = Trainer(_spec(tiny_model, loss=PolicyLossConfig(kl_coef=0.05, entropy_coef=0.001)), dist_info)
    before = _params(trainer)
    metrics = trainer.rl_step(_samples(0))
    after = _params(trainer)
    assert trainer.step == 1
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for key in (
        "loss/total",
        "grad_norm",
        "lr",
        "policy/clip_frac",
        "policy/iw_max",
        "policy/iw_truncated_frac",
        "policy/behavior_logprob_diff",
        "policy/kl",
        "policy/entropy",
        "time/forward_backward_s",
        "time/optimizer_s",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    # several micro-batches were used (96-token budget), and the gradient norm is finite
    assert metrics["grad_norm"] > 0


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        ("grpo", dict()),
        ("ppo", dict(num_minibatches=2)),
    ],
)
def test_checkpoint_resume_reproduces_the_next_step(tiny_model, dist_info, tmp_path, algorithm, extra):
    from agentrl.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from agentrl.learner.trainer import Trainer

    advantage = "gae" if algorithm == "ppo" else "grpo"
    spec = _spec(tiny_model, algorithm=algorithm, warmup_steps=3, lr_schedule="cosine", total_steps=10, **extra)
    first = Trainer(spec, dist_info)
    first.rl_step(_samples(1, advantage=advantage))
    save_checkpoint(tmp_path, first, state={"policy_version": 7}, pending_groups=b"xyz")
    rng_probe = torch.rand(3)
    expected = first.rl_step(_samples(2, advantage=advantage))
    expected_params = _params(first)

    resumed = Trainer(spec, dist_info)
    state = load_checkpoint(latest_checkpoint(tmp_path), resumed)
    assert state["policy_version"] == 7 and state["pending_groups"] == b"xyz"
    assert resumed.step == 1
    assert torch.equal(torch.rand(3), rng_probe)  # RNG restored
    got = resumed.rl_step(_samples(2, advantage=advantage))
    assert got["loss/total"] == expected["loss/total"]
    assert got["lr"] == expected["lr"]
    got_params = _params(resumed)
    for name, value in expected_params.items():
        assert torch.equal(value, got_params[name]), name
    if algorithm == "ppo":
        assert got["critic/value_loss"] == expected["critic/value_loss"]


def test_activation_checkpointing_recomputes_and_matches(tiny_model, dist_info):
    from agentrl.learner.trainer import Trainer

    results = {}
    for ac in (False, True):
        trainer = Trainer(_spec(tiny_model, activation_checkpointing=ac), dist_info)
        calls = []
        trainer.policy.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
        metrics = trainer.rl_step(_samples(5, groups=2))
        results[ac] = (metrics["loss/total"], _params(trainer), len(calls))
    (loss0, p0, calls0), (loss1, p1, calls1) = results[False], results[True]
    assert calls1 == 2 * calls0  # every layer forward is replayed in the backward
    assert loss1 == pytest.approx(loss0, abs=1e-7)
    assert max((p0[n] - p1[n]).abs().max().item() for n in p0) < 1e-6


def test_lr_schedule():
    from agentrl.learner.trainer import lr_factor

    f = lambda s, kind: lr_factor(s, warmup_steps=2, total_steps=12, schedule=kind)  # noqa: E731
    assert [f(s, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert f(2, "cosine") == pytest.approx(1.0) and f(7, "cosine") == pytest.approx(0.5) and f(12, "cosine") == 0.0
    assert f(7, "linear") == pytest.approx(0.5) and f(20, "linear") == 0.0
    # a decay that ends at step 6 on half the base lr, then stays there (the quickstart's shape)
    g = lambda s: lr_factor(s, warmup_steps=0, total_steps=6, schedule="cosine", min_ratio=0.5)  # noqa: E731
    assert g(0) == 1.0 and g(3) == pytest.approx(0.75) and g(6) == pytest.approx(0.5) and g(30) == pytest.approx(0.5)


def test_gathered_tensors_are_the_state_dict_and_bounded_by_the_bucket(tiny_model, dist_info):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.trainer import Trainer
    from agentrl.learner.weight_push import tensors_to_push

    trainer = Trainer(_spec(tiny_model), dist_info)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    bucket = 64 << 10
    largest = max(p.numel() * 4 for _, p in tensors_to_push(trainer.policy))
    alive: list[tuple[weakref.ref, int]] = []
    names = []
    peak = 0
    for name, tensor in iter_full_tensors(trainer.policy, bucket_bytes=bucket):
        names.append(name)
        assert torch.equal(tensor, reference[name]), name
        alive.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        del tensor  # freed by reference counting unless the iterator still holds it
        peak = max(peak, sum(n for ref, n in alive if ref() is not None))
    assert "lm_head.weight" not in names  # tied to the embeddings: engines tie it themselves
    assert set(names) == set(reference) - {"lm_head.weight"}
    assert peak <= max(bucket, largest)  # never the whole model (about 3.4 MB) at once
    bf16 = dict(iter_full_tensors(trainer.policy, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_push_weights_into_a_sink(tiny_model, dist_info):
    from agentrl.learner.trainer import Trainer
    from agentrl.learner.weight_push import push_weights

    class Sink:  # WeightUpdater's interface, as push_weights uses it
        device = torch.device("cpu")

        def push_plan(self, plan, version, materialize):
            self.version = version
            self.tensors = [t for bucket in plan for t in materialize(bucket)]
            return {"seconds": 0.0}

    trainer = Trainer(_spec(tiny_model), dist_info)
    sink = Sink()
    assert push_weights(trainer.policy, sink, 3, bucket_bytes=1 << 20, dtype=torch.bfloat16) == {"seconds": 0.0}
    names = [n for n, _ in sink.tensors]
    assert sink.version == 3 and "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert all(t.dtype == torch.bfloat16 for _, t in sink.tensors)


def test_export_loads_in_transformers_with_the_learners_logits(tiny_model, dist_info, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.learner.checkpoint import save_checkpoint
    from agentrl.learner.export import export_checkpoint
    from agentrl.learner.trainer import Trainer

    trainer = Trainer(_spec(tiny_model, lr=1e-2), dist_info)
    trainer.rl_step(_samples(3))
    save_checkpoint(tmp_path / "ckpt", trainer)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf2" / "model.safetensors").exists()
    result = CliRunner().invoke(app, ["export", str(tmp_path / "nothing"), str(tmp_path / "hf3")])
    assert result.exit_code == 2 and "no checkpoint" in result.output
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "tool_call" in tok.chat_template
    samples = _samples(4, groups=1)
    learner = sample_logprobs(trainer, samples)
    with torch.no_grad():
        for s, lp in zip(samples, learner):
            ids = torch.from_numpy(s.tokens.astype(np.int64))[None]
            ref = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[:-1]
            ref = ref.gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert torch.allclose(ref, lp, atol=1e-5)


def test_sft_masks_assistant_tokens_only(tiny_model):
    from transformers import AutoTokenizer

    from agentrl.learner.sft import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ]
    sample = tokenize_conversation(tok, messages, tools)
    masked = tok.decode(sample.tokens[sample.loss_mask.astype(bool)].tolist())
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>' in masked
    assert masked.endswith("The answer is 5.<|im_end|>")
    assert "What is" not in masked and "<tool_response>" not in masked and "assistant" not in masked
    assert tok.decode(sample.tokens.tolist()) == tok.apply_chat_template(messages, tools=tools, tokenize=False)
    with pytest.raises(ValueError, match="no assistant"):
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}])


def test_sft_learns_resumes_and_exports(tiny_model, dist_info, tmp_path):
    """`sft` on a JSONL file: the NLL falls, the exported model loads, a longer run resumes."""
    from transformers import AutoModelForCausalLM

    from agentrl.config import load_config
    from agentrl.learner.sft import sft

    data = tmp_path / "convs.jsonl"
    with data.open("w") as f:
        for a in range(12):
            messages = [
                {"role": "user", "content": f"What is {a} + {a}?"},
                {"role": "assistant", "content": f"The answer is {2 * a}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    run_dir = tmp_path / "run"
    overrides = [
        f'model.path="{tiny_model}"',
        f'run.run_dir="{run_dir}"',
        f'sft.data="{data}"',
        "sft.batch_tokens=400",
        "sft.max_steps=8",
        "sft.lr=3e-3",
        "learner.max_tokens_per_microbatch=256",
        "learner.checkpoint_every_steps=4",
        "tracking.enabled=false",
    ]
    out = sft(load_config(None, overrides))
    rows = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["sft/nll"] < rows[0]["sft/nll"]
    assert out == run_dir / "sft" / "model"
    AutoModelForCausalLM.from_pretrained(out)
    sft(load_config(None, [*overrides, "sft.max_steps=10"]))  # resumes from step 8
    rows = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))


class EchoEnv:
    """A tiny environment whose demonstrations call a tool (loaded by import path)."""


def _echo_env_class():
    from agentrl.envs.base import Env, Task

    class _EchoEnv(Env):
        name = "echo"

        def tasks(self, split="train", seed=0):
            i = 0
            while True:
                yield Task(id=str(i), data={"x": i})
                i += 1

        def initial_messages(self, task):
            return [{"role": "user", "content": f"Echo {task.data['x']}"}]

        def tools(self):
            return [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]

        def demonstration(self, task):
            if task.data["x"] % 3 == 2:
                return None  # an env may have no demonstration for some tasks
            call = {"type": "function", "function": {"name": "echo", "arguments": {"text": str(task.data["x"])}}}
            return [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(task.data["x"])},
                {"role": "assistant", "content": f"It said {task.data['x']}."},
            ]

    return _EchoEnv


EchoEnv = _echo_env_class()


def test_sft_demonstrations_from_an_env(tiny_model):
    from transformers import AutoTokenizer

    from agentrl.config import load_config
    from agentrl.learner.sft import env_demonstrations, load_samples

    cfg = load_config(
        None, [f'model.path="{tiny_model}"', 'env.cls="tests.test_learner_trainer:EchoEnv"', "sft.num_demonstrations=5"]
    )
    convs = env_demonstrations(cfg)
    assert len(convs) == 5
    messages, tools = convs[0]
    assert messages[0] == {"role": "user", "content": "Echo 0"} and tools[0]["function"]["name"] == "echo"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    samples = load_samples(cfg, tok)
    text = tok.decode(samples[1].tokens.tolist())
    assert "# Tools\necho(" in text and "Echo 1" in text
    learned = tok.decode(samples[1].tokens[samples[1].loss_mask.astype(bool)].tolist())
    assert '"arguments": {"text": "1"}' in learned and "It said 1." in learned and "Echo" not in learned


def test_sft_reports_bad_data(tmp_path, tiny_model):
    from agentrl.config import load_config
    from agentrl.learner.sft import load_jsonl

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n{"nope": 1}\n'
    )
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_jsonl(bad)
    assert load_config(None, [f'sft.data="{bad}"']).sft.data == str(bad)


def test_weight_broadcast_makes_a_real_engine_match_the_learner(tiny_model, dist_info, tmp_path):
    """Train a step, push through WeightUpdater into a real embedded engine process: the engine's
    logprobs are then the learner's (teacher-forced recompute of the engine's own output)."""
    import httpx
    from transformers import AutoModelForCausalLM

    from agentrl.learner.trainer import Trainer
    from agentrl.learner.weight_push import WeightUpdater, push_weights
    from tests.conftest_engine import Teacher, max_abs_diff, start_engines

    trainer = Trainer(_spec(tiny_model, lr=5e-2), dist_info)
    trainer.rl_step(_samples(11))  # a large step: the weights differ clearly from the engine's
    (engine,) = start_engines(tiny_model, 1, tmp_path / "logs")
    updater = WeightUpdater([engine.url], backend="gloo", bucket_bytes=256 << 10)
    try:
        updater.connect()
        prompt = [5, 17, 42, 99, 7]
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
        }
        before = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
        push_weights(trainer.policy, updater, 1, bucket_bytes=256 << 10, dtype=torch.float32)
        after = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    finally:
        updater.close()
        engine.stop()
    assert before["meta_info"]["weight_version"] == "0" and after["meta_info"]["weight_version"] == "1"
    learner_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    learner_model.load_state_dict({n: t for n, t in iter_full_tensors(trainer.policy)}, strict=False)
    learner = Teacher(learner_model)
    out = after["output_ids"]
    engine_lp = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    assert max_abs_diff(engine_lp, learner.logprobs(prompt, out)) <= 1e-4
    old_lp = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
    assert max_abs_diff(old_lp, learner.logprobs(prompt, before["output_ids"])) > 1e-3  # it did change


def test_every_recipe_of_the_algorithms_page_builds_the_learners_loss() -> None:
    """Each row of docs/algorithms.md's "Recipes" table, as [learner] keys on the quickstart's config, gives a
    valid config and the trainer's loss config (Dr. GRPO's normalization_tokens resolved to the env's limit)."""
    import re
    import tomllib

    from agentrl.config import load_config
    from agentrl.learner.trainer import TrainerSpec

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "algorithms.md").read_text()
    rows = page.split("## Recipes", 1)[1].splitlines()
    recipes = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("recipe", "---"):
            pairs = re.findall(r"`(\w+) = ([^`]+)`", cells[1])
            recipes[cells[0]] = [f"learner.{k}={tomllib.loads(f'v = {v}')['v']}" for k, v in pairs]
    assert len(recipes) == 9 and recipes["GRPO (the quickstart)"] == []
    for name, sets in recipes.items():
        cfg = load_config(root / "examples" / "calculator" / "config.toml", sets)
        loss = TrainerSpec.for_learn(cfg).loss
        assert loss.normalization == cfg.learner.loss_normalization, name
        if loss.normalization == "constant":
            assert loss.normalization_tokens == cfg.env.max_total_tokens == 256
