"""The engine's model runner, against transformers itself: the functional forward of each
Llama-family architecture, the generic path for others, and the sampler's distribution."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

VOCAB = 960  # the tiny model's; its tokenizer files are copied next to each test model


def _tiny(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":  # q/k norms, explicit head_dim
        return Qwen3Config(**common, head_dim=32)
    if kind == "qwen2":  # biases on q, k and v
        return Qwen2Config(**common)
    if kind == "llama3-rope":  # a scaled rotary table, no grouping of K/V heads, MLP biases
        return LlamaConfig(
            **{**common, "num_key_value_heads": 4},
            mlp_bias=True,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if kind == "llama-dynamic-rope":  # rotary that changes with the length: the generic path
        return LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if kind == "mistral":  # an architecture the functional forward does not know: the generic path
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(kind)


@pytest.fixture(scope="module")
def model_dir(engine_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    def build(kind: str) -> Path:
        out = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny(kind))
        with torch.no_grad():  # random biases and norm weights, so that a dropped one shows
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.normal_(0.0, 0.3).add_(1.0 if "norm" in name else 0.0)
        model.save_pretrained(out)
        for f in Path(engine_model).iterdir():
            if f.name.startswith("tokenizer"):
                shutil.copy(f, out / f.name)
        return out

    return build


def _reference(model, seq: list[int]) -> torch.Tensor:
    """log_softmax of transformers' own forward of the whole sequence: [len(seq), V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)


def _run_and_compare(runner, model) -> float:
    """Ragged prefill, a prefix-cached prefill next to a fresh one, then decode steps; the worst
    difference of next-token logprobs against transformers' full forward."""
    rng = random.Random(0)
    seqs = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 9)]
    worst = 0.0
    with torch.inference_mode():
        logits = runner.prefill(0, seqs)
        for i, s in enumerate(seqs):
            worst = max(worst, (torch.log_softmax(logits[i], -1) - _reference(model, s)[-1]).abs().max().item())
        runner.save_prefix(1, seqs[1])  # row 1's K/V, for a later prompt that extends it
        for _ in range(4):  # decode every row
            nxt = [rng.randrange(3, VOCAB) for _ in seqs]
            logits = runner.decode(nxt, [len(s) for s in seqs])
            seqs = [s + [t] for s, t in zip(seqs, nxt)]
            for i, s in enumerate(seqs):
                worst = max(worst, (torch.log_softmax(logits[i], -1) - _reference(model, s)[-1]).abs().max().item())
        # Rows 3 and 4 join: one continues row 1's cached prefix, one starts from nothing.
        new = [seqs[1][:17] + [11, 12, 13], [rng.randrange(3, VOCAB) for _ in range(6)]]
        starts = [runner.load_prefix(3 + i, s) for i, s in enumerate(new)]
        assert starts == [17, 0]
        logits = runner.prefill(3, new, starts)
        for i, s in enumerate(new):
            worst = max(worst, (torch.log_softmax(logits[i], -1) - _reference(model, s)[-1]).abs().max().item())
    return worst


@pytest.mark.parametrize(
    "kind, fast",
    [("qwen3", True), ("qwen2", True), ("llama3-rope", True), ("llama-dynamic-rope", False), ("mistral", False)],
)
def test_runner_matches_transformers(model_dir, kind, fast):
    from transformers import AutoModelForCausalLM

    from agentrl.engine.model_runner import ModelRunner

    path = model_dir(kind)
    runner = ModelRunner(path, device="cpu", dtype="float32", max_running_requests=8, max_context_tokens=128)
    assert (runner.fast is not None) == fast
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _run_and_compare(runner, model) <= 1e-4
    if fast:  # the generic path (transformers' decoder over the slot cache) agrees as well
        generic = ModelRunner(path, device="cpu", dtype="float32", max_running_requests=8, max_context_tokens=128)
        generic.fast = None
        assert _run_and_compare(generic, model) <= 1e-4


def test_functional_forward_sees_weight_updates(model_dir):
    """It reads the model's own parameter tensors: an in-place copy (what a weight push does) shows at once."""
    from agentrl.engine.model_runner import ModelRunner

    runner = ModelRunner(
        model_dir("qwen3"), device="cpu", dtype="float32", max_running_requests=2, max_context_tokens=64
    )
    assert runner.fast is not None
    with torch.inference_mode():
        before = runner.prefill(0, [[5, 6, 7]])
        named = runner.named_tensors()
        named["model.layers.1.mlp.down_proj.weight"].data.mul_(0.5)
        after = runner.prefill(0, [[5, 6, 7]])
    assert not torch.allclose(before, after)


def test_sampler_draws_from_the_truncated_softmax(engine_model):
    """Inverse-CDF draws: frequencies follow softmax(logits / T) restricted by top-k / top-p / min-p;
    removed tokens are never drawn; greedy rows take the argmax; a seed fixes a row's draws."""
    from agentrl.engine.model_runner import ModelRunner
    from agentrl.engine.native_api import parse_sampling_params

    runner = ModelRunner(engine_model, device="cpu", dtype="float32", max_running_requests=2, max_context_tokens=64)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.2]])
    settings = [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.0},
    ]
    params = [parse_sampling_params(s, 100) for s in settings]
    n = 20000
    rows = [p for p in params for _ in range(n)]
    rp = runner.row_params(rows, [None] * len(rows))
    tokens, logprobs = runner.sample(logits.expand(len(rows), -1).contiguous(), rp)
    for k, s in enumerate(settings):
        drawn = torch.bincount(torch.tensor(tokens[k * n : (k + 1) * n]), minlength=logits.shape[1]).double() / n
        temperature = s["temperature"] or 1.0
        probs = torch.softmax(logits[0].double() / temperature, -1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        order = probs.argsort(descending=True)
        if "top_k" in s:
            keep[order[s["top_k"] :]] = False
        if "top_p" in s:
            before = probs[order].cumsum(0) - probs[order]
            keep[order[before > s["top_p"]]] = False
        if "min_p" in s:
            keep &= probs >= probs.max() * s["min_p"]
        if s["temperature"] == 0.0:
            keep = probs == probs.max()
        want = probs * keep / (probs * keep).sum()
        assert torch.all(drawn[~keep] == 0), (s, drawn)
        assert (drawn - want).abs().max() < 0.015, (s, drawn, want)  # ~4 standard errors at n = 20000
        # the logprobs are of the full (untruncated) distribution at that temperature
        expected = torch.log_softmax(logits[0] / temperature, -1)[torch.tensor(tokens[k * n : k * n + 50])]
        assert torch.allclose(torch.tensor(logprobs[k * n : k * n + 50]), expected, atol=1e-6)
    # Seeded rows: the same draws whatever the other rows are.
    seeded = parse_sampling_params({"temperature": 1.0, "sampling_seed": 5}, 100)

    def seeded_draws(other_rows: int) -> list[int]:
        out = []
        gen = torch.Generator().manual_seed(5)
        for _ in range(30):
            batch = [params[0]] * other_rows + [seeded]
            rp = runner.row_params(batch, [None] * other_rows + [gen])
            out.append(runner.sample(logits.expand(len(batch), -1).contiguous(), rp)[0][-1])
        return out

    assert seeded_draws(0) == seeded_draws(7)
    assert len(set(seeded_draws(3))) > 1
