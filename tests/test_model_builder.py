"""The tiny model: ``agentrl init-model`` builds it offline; transformers reloads it offline.

Both steps run in ONE fresh interpreter with ``HF_HUB_OFFLINE=1`` (importing torch and
transformers costs several seconds here, so it is paid once): it calls the CLI's entry point
exactly as the ``agentrl`` script does, then reloads what the command wrote with
``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained`` and reports what it saw as JSON.
This test process never imports torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

PROBE = r"""
import json, sys
out_dir = sys.argv[1]
sys.argv = ["agentrl", "init-model", out_dir, "--size", "tiny"]
from agentrl.cli import main
try:
    main()
    rc = 0
except SystemExit as e:
    rc = e.code or 0
print()

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from huggingface_hub import constants

tok = AutoTokenizer.from_pretrained(out_dir)
model = AutoModelForCausalLM.from_pretrained(out_dir)
tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]
messages = [
    {"role": "system", "content": "You are careful."},
    {"role": "user", "content": "What is 12 * (3 + 4)?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}}]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "The answer is 84."},
]
text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
prompt = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False, add_generation_prompt=True)
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits
print(json.dumps({
    "rc": rc,
    "offline": constants.HF_HUB_OFFLINE,
    "num_params": sum(p.numel() for p in model.parameters()),
    "text": text,
    "prompt": prompt,
    "ids": ids,
    "decoded": tok.decode(ids),
    "reencoded": tok(text, add_special_tokens=False)["input_ids"],
    "digits": [tok.decode([i]) for i in tok("x = 1234 + 56", add_special_tokens=False)["input_ids"]],
    "tool_tokens": {t: tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<tool_response>")},
    "im_end": tok.convert_tokens_to_ids("<|im_end|>"),
    "eos_token_id": model.config.eos_token_id,
    "tokenizer_eos": tok.eos_token_id,
    "vocab": len(tok),
    "logits_shape": list(logits.shape),
    "finite": bool(torch.isfinite(logits).all()),
}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str, dict]:
    out_dir = tmp_path_factory.mktemp("model") / "tiny"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out_dir)], capture_output=True, text=True, env=env, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli_output, _, report = proc.stdout.rstrip().rpartition("\n")
    return out_dir, cli_output, json.loads(report)


def test_init_model_cli_builds_offline(built) -> None:
    out_dir, cli_output, report = built
    assert report["rc"] == 0 and report["offline"] is True
    assert "wrote a tiny model" in cli_output and str(out_dir) in cli_output
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out_dir / name).is_file(), name


def test_tiny_model_has_about_a_million_parameters(built) -> None:
    _, cli_output, report = built
    assert 0.5e6 < report["num_params"] < 1.5e6
    assert f"{report['num_params']:,} parameters" in cli_output  # the CLI reports the same count
    assert report["logits_shape"][0] == 1 and report["logits_shape"][1] == len(report["ids"])
    assert report["logits_shape"][2] >= report["vocab"] and report["finite"]


def test_chat_template_with_tools_round_trips(built) -> None:
    _, _, report = built
    assert report["decoded"] == report["text"]  # decode(ids) is exactly the rendered text
    assert report["reencoded"] == report["ids"]  # and tokenizing the text gives the same ids
    text = report["text"]
    # tools are rendered as compact signatures, so the tiny model's prompts stay short
    assert text.startswith(
        "<|im_start|>system\nYou are careful.\n\n# Tools\n"
        "calculator(expression: string): Evaluate arithmetic.\nCall a tool with <tool_call>"
    )
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nThe answer is 84.<|im_end|>\n")
    assert report["prompt"].endswith("<|im_start|>user\nWhat is 12 * (3 + 4)?<|im_end|>\n<|im_start|>assistant\n")
    # tool tags are single tokens, and <|im_end|> is the end of sequence everywhere
    assert all(tid in report["ids"] for tid in report["tool_tokens"].values())
    assert report["eos_token_id"] == report["tokenizer_eos"] == report["im_end"]
    assert report["ids"].count(report["im_end"]) == 5
    # one token per digit, so a number reads the same wherever it appears
    assert report["digits"][-8:] == ["1", "2", "3", "4", " +", " ", "5", "6"]
