"""Build a small Qwen3-architecture model and byte-level BPE tokenizer offline.

``agentrl init-model OUT --size tiny`` needs no network: the tokenizer is trained on a synthetic
corpus covering what agentrl's environments say, the model is randomly initialised, and both are
saved with ``save_pretrained`` so ``AutoTokenizer``/``AutoModelForCausalLM`` load them offline.
Digits are always single tokens, so a number reads the same in a question, a tool call and an
answer.

The chat template is Qwen's tool format with tools listed as one-line signatures (half the
calculator episode); ``<|im_end|>`` ends turns and sequences, and the tool tags are single added
tokens that survive ``skip_special_tokens``. Sizes: ``tiny`` (~0.9M parameters, the CPU default),
``small`` (~25M), ``0.5b`` (Qwen2.5-0.5B's shape, for GPU benchmarks). See docs/run.md.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + f.name + '(' }}"
    "{%- for name, spec in (f.parameters.properties if f.parameters is defined and f.parameters.properties is defined else {}).items() %}"
    "{%- if not loop.first %}{{- ', ' }}{%- endif %}{{- name + ': ' + (spec.type if spec.type is defined else 'any') }}"
    "{%- endfor %}"
    "{{- ')' }}{%- if f.description %}{{- ': ' + f.description }}{%- endif %}"
    "{%- endfor %}"
    '{{- \'\\nCall a tool with <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The vision-language template: the same, with a message's content either a string or a list of parts,
# ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` / ``{"type": "image_url", ...}`` (one image pad each;
# the processor expands a pad to the image's token count).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_CONTENT_MACRO = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- else -%}{%- for part in c -%}"
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ['image', 'image_url'] -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
VISION_CHAT_TEMPLATE = _CONTENT_MACRO + (
    CHAT_TEMPLATE.replace("messages[0].content", "content(messages[0].content)")
    .replace("message.content + '<|im_end|>", "content(message.content) + '<|im_end|>")
    .replace("'\\n<tool_response>\\n' + message.content", "'\\n<tool_response>\\n' + content(message.content)")
)

SIZES: dict[str, dict[str, float]] = {
    # initializer_range: the transformers default (0.02) is sized for wide models; at hidden 128
    # it left the quickstart's SFT on a plateau for ~400 steps, 0.06 (about 0.7/sqrt(hidden))
    # learned to copy numbers by step 200 (measured; see docs/performance.md, "The quickstart")
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_target=1024,
        initializer_range=0.06,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_target=2048,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_target=2048,
        vocab_size=151936,
    ),
}

_WORDS = (
    "the a an of to and is in what how many much if then total each has have had gives gets buys sells "
    "left more less than times per answer result compute calculate find search question number numbers "
    "sum difference product quotient plus minus multiplied divided by equals value you I we it this that "
    "who where when which capital city country born year wrote discovered river mountain language of the "
    "function return def python code test tests pass fail error print import for while range list int str "
    "apples books coins cookies marbles pencils tickets boxes friends students hours minutes days week"
).split()


def _synthetic_corpus(rng: random.Random, num_docs: int = 1500) -> list[str]:
    """Text shaped like agentrl's episodes, for training the BPE merges."""
    docs: list[str] = []
    ops = ["+", "-", "*", "/"]
    for _ in range(num_docs):
        a, b, c = (rng.randint(0, 999) for _ in range(3))
        expr = f"{a} {rng.choice(ops)} {b} {rng.choice(ops)} {c}"
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        call = json.dumps({"name": rng.choice(["calculator", "search", "python"]), "arguments": {"expression": expr}})
        docs.append(
            f"<|im_start|>user\n{words.capitalize()}? {expr}<|im_end|>\n"
            f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{rng.randint(-9999, 99999)}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\nThe answer is {rng.randint(0, 9999)}.<|im_end|>\n"
        )
        docs.append(f"def f(x):\n    return x {rng.choice(ops)} {a}\n\nprint(f({b}))\nassert f({c}) == {a}\n")
        docs.append(_tool_preamble(rng))
    return docs


_TOOL_NAMES = ["calculator", "search", "python", "lookup", "run_tests", "weather", "translate"]
_PARAM_NAMES = ["expression", "query", "code", "top_k", "text", "city", "language"]


def _tool_preamble(rng: random.Random) -> str:
    """A system turn with tool schemas as the chat template renders them, so that the BPE merges
    cover the words every agent prompt starts with; half use the built-in tools' own schemas."""
    if rng.random() < 0.5:
        tools = [rng.choice(_builtin_tool_schemas())]
    else:
        tools = []
        for _ in range(rng.randint(1, 2)):
            param = rng.choice(_PARAM_NAMES)
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": rng.choice(_TOOL_NAMES),
                        "description": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 8))).capitalize()
                        + ".",
                        "parameters": {
                            "type": "object",
                            "properties": {param: {"type": "integer" if param == "top_k" else "string"}},
                        },
                    },
                }
            )
    system = {"role": "system", "content": " ".join(rng.choice(_WORDS) for _ in range(6)).capitalize() + "."}
    return _chat_template().render(messages=[system], tools=tools, add_generation_prompt=False)


@functools.cache
def _chat_template() -> Any:
    """The chat template compiled once (compiling takes ~25 ms; a tokenizer's corpus renders it 1,500 times)."""
    from jinja2 import Template

    return Template(CHAT_TEMPLATE)


@functools.cache
def _builtin_tool_schemas() -> tuple[dict, ...]:
    from agentrl.tools.calculator import CalculatorTool
    from agentrl.tools.python_sandbox import PythonTool
    from agentrl.tools.search import SearchTool

    return (CalculatorTool().schema(), SearchTool("http://127.0.0.1:1").schema(), PythonTool().schema())


def build_tokenizer(vocab_target: int, seed: int = 0):
    """Train a byte-level BPE and wrap it as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    tok = Tokenizer(models.BPE())
    # one token per digit (as Qwen and Llama do): a number reads the same in the question, the
    # tool call and the answer, so copying it is the same lesson everywhere
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(TOOL_TOKENS, special_tokens=False)
    return fast


def build_model_config(size: str, vocab_size: int):
    from transformers import Qwen3Config

    spec: dict = dict(SIZES[size])
    spec.pop("vocab_target")
    padded = spec.pop("vocab_size", None) or (vocab_size + 63) // 64 * 64
    return Qwen3Config(
        vocab_size=padded,
        max_position_embeddings=32768 if size == "0.5b" else 4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        **spec,
    )


def init_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build tokenizer + randomly initialised model under ``out_dir`` and return the path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size == "tiny-vl":
        return build_tiny_vl(out_dir, seed=seed)
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}, tiny-vl")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(int(SIZES[size]["vocab_target"]), seed=seed)
    config = build_model_config(size, len(tokenizer))
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int), "build_tokenizer sets a pad token"
    config.pad_token_id = pad_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# A Qwen2.5-VL with the tiny text model and a two-block vision tower. An image of 56x56 pixels is a 4x4 grid
# of 14-pixel patches, merged 2x2 into 4 tokens; the processor keeps images between 56x56 and 224x224.
TINY_VL_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1])
TINY_VL_PIXELS = dict(min_pixels=56 * 56, max_pixels=224 * 224)


def build_tiny_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """A randomly initialised Qwen2.5-VL (``tiny`` text model + a small vision tower), its tokenizer (the tiny BPE
    plus Qwen's vision tokens) and processor under ``out_dir``; loads with ``AutoModelForImageTextToText`` and
    ``AutoProcessor`` offline."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = dict(SIZES["tiny"])
    for key in ("vocab_target", "head_dim"):
        text.pop(key)
    tokenizer = build_tokenizer(int(SIZES["tiny"]["vocab_target"]), seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})  # type: ignore[arg-type]
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    ids: dict[str, int] = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in [*VISION_TOKENS, "<|im_end|>"]}  # type: ignore[arg-type]
    head_dim = int(text["hidden_size"]) // int(text["num_attention_heads"])
    eighth = head_dim // 2 // 8  # mRoPE splits the rotary half-dimension 2:3:3, as Qwen's [16, 24, 24] of 64
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=(len(tokenizer) + 63) // 64 * 64,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            # mRoPE: the rotary half-dimension split over (time, height, width) like Qwen's [16, 24, 24]
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [2 * eighth, 3 * eighth, 3 * eighth],
            },
            **text,
        ),
        vision_config=dict(out_hidden_size=int(text["hidden_size"]), initializer_range=0.06, **TINY_VL_VISION),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _image_processor().save_pretrained(out)
    return out


def _image_processor() -> Any:
    """Qwen2-VL's image processor (the PIL backend). Saved on its own, not as a ``Qwen2_5_VLProcessor``: that class
    also needs Qwen2-VL's video processor, which imports torchvision, and no CPU torchvision wheel is installable
    here. agentrl reads images with ``AutoImageProcessor`` and the tokenizer (see agentrl/images.py)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": TINY_VL_PIXELS["min_pixels"], "longest_edge": TINY_VL_PIXELS["max_pixels"]}
    return Qwen2VLImageProcessorPil(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)


def count_parameters(path: str | Path) -> int:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = "vision_config" in json.loads((Path(path) / "config.json").read_text())
    model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def ensure_model(path: str | Path, size: str, seed: int = 0) -> Path:
    """Return ``path`` if it holds a model, else build one of ``size`` there ('' = never build)."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    if not size:
        raise ValueError(f"no model at {p} (config.json missing) and model.init_size is empty")
    return init_model(p, size=size, seed=seed)
