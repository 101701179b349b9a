"""SGLang 0.5.x native HTTP API: field names, defaults, validation and response shapes.

The one place that knows the wire format of ``POST /generate``: the embedded server validates with
it and the client builds requests with the same names. It imports neither torch nor sglang.
``sampling_params`` keys and defaults, ``finish_reason``, ``output_token_logprobs``, batches and
400 errors mirror SGLang's (``sglang/srt/sampling/sampling_params.py``, ``managers/io_struct.py``).

Invariant: a request means the same thing on both servers or fails here. What the embedded engine
does not implement (penalties, ``n`` > 1, constrained decoding, ``logit_bias``, top logprobs ...)
is accepted at its default value and refused otherwise with a 400 naming the field.
See docs/engine.md.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30

# Every key SGLang 0.5.x accepts inside ``sampling_params``, with its default.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}

# Accepted by SGLang but not implemented by the embedded engine: only the default is allowed.
UNSUPPORTED_SAMPLING = (
    "stop_regex",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "logit_bias",
    "beam_width",
    "watermark",
    "choice",
)


class RequestError(ValueError):
    """A malformed request; the server answers HTTP 400 with this message."""


def decode_body(raw: bytes) -> dict:
    """The JSON object of a request body (empty: ``{}``); RequestError says what is wrong with it.

    Besides invalid JSON and non-objects, two things Python's ``json`` accepts are refused here
    because they break later, far from the request: JSON nested too deeply to decode
    (``RecursionError``) and ``\\udXXX`` escapes of lone surrogates, which no tokenizer takes and
    no response can echo as UTF-8 (a ``weight_version`` holding one would break every response
    after it). The message names the field that holds one."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {_short(str(e))}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    where = _lone_surrogate(body)
    if where is not None:
        raise RequestError(
            f"{_short(where)} holds a lone surrogate (a \\ud800-\\udfff escape), which is not valid Unicode"
        )
    return body


def _lone_surrogate(body: dict) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, else None."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if not k.isascii() and _has_surrogate(k):
                    return f"{path}.{_short(repr(k))}".lstrip(".")
                stack.append((f"{path}.{k}".lstrip("."), v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def show(value: Any) -> str:
    """``repr`` of a client's value for an error message, cut short (a field may hold megabytes)."""
    return _short(repr(value), 80)


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request (SGLang semantics, greedy normalised)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def needs_filter(self) -> bool:
        """True when top-k/top-p/min-p truncate the distribution before sampling."""
        return self.top_k < TOP_K_ALL or self.top_p < 1.0 or self.min_p > 0.0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite JSON number that a float can hold (an integer of 400 digits is not: it overflows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate one ``sampling_params`` object; raise :class:`RequestError` naming the field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    for key in raw:
        if key not in SAMPLING_DEFAULTS:
            raise RequestError(f"sampling_params has an unknown field {show(key)}")
    # null means "use the default", as in SGLang's __post_init__.
    p = {k: (SAMPLING_DEFAULTS[k] if raw.get(k) is None else raw[k]) for k in SAMPLING_DEFAULTS}
    for key in UNSUPPORTED_SAMPLING:
        if p[key] != SAMPLING_DEFAULTS[key] and p[key] not in ({}, []):  # some SGLang defaults are {} / []
            raise RequestError(
                f"sampling_params.{key} = {show(p[key])} is not supported by the embedded engine "
                f"(only the default {SAMPLING_DEFAULTS[key]!r})"
            )

    max_new = raw.get("max_new_tokens", 128)  # an explicit null means "up to the context length"
    if max_new is not None and (not _is_int(max_new) or max_new < 0):
        raise RequestError(f"sampling_params.max_new_tokens must be an integer >= 0, got {show(max_new)}")
    temperature = p["temperature"]
    if not _is_num(temperature) or temperature < 0:
        raise RequestError(f"sampling_params.temperature must be a non-negative finite number, got {show(temperature)}")
    top_p = p["top_p"]
    if not _is_num(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {show(top_p)}")
    min_p = p["min_p"]
    if not _is_num(min_p) or not 0.0 <= min_p <= 1.0:
        raise RequestError(f"sampling_params.min_p must be in [0, 1], got {show(min_p)}")
    top_k = p["top_k"]
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise RequestError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {show(top_k)}")
    top_k = TOP_K_ALL if top_k == -1 else min(top_k, TOP_K_ALL)  # beyond the vocabulary: all of it

    stop = p["stop"] or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of strings")
    stop = tuple(s for s in stop if s)
    stop_ids = p["stop_token_ids"] or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    for t in stop_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"sampling_params.stop_token_ids has {show(t)}, outside [0, {vocab_size})")
    flags = {}
    for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if not isinstance(p[key], bool):
            raise RequestError(f"sampling_params.{key} must be true or false, got {show(p[key])}")
        flags[key] = p[key]
    seed = p["sampling_seed"]
    if seed is not None and not _is_int(seed):
        raise RequestError(f"sampling_params.sampling_seed must be an integer, got {show(seed)}")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:  # SGLang's range (torch's generators take it)
        raise RequestError(f"sampling_params.sampling_seed must be in [-2**63, 2**63 - 1], got {show(seed)}")
    interval = p["stream_interval"]
    if interval is not None and (not _is_int(interval) or interval < 1):
        raise RequestError(f"sampling_params.stream_interval must be an integer >= 1, got {show(interval)}")

    if temperature < SAMPLING_EPS:  # greedy: SGLang samples with top_k = 1 at temperature 1
        temperature, top_k = 1.0, 1
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        stop=stop,
        stop_token_ids=frozenset(stop_ids),
        sampling_seed=seed,
        stream_interval=interval,
        **flags,
    )


@dataclass
class GenerateInput:
    """One prompt of a (possibly batched) ``/generate`` call, validated."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    lora_path: str | None = None  # the LoRA adapter the request names (SGLang's lora_path); the server checks it
    images: list[bytes] = field(default_factory=list)  # PNG bytes, one per image pad run of input_ids, in order
    vision: Any = None  # the engine's prepared inputs of ``images`` (ModelRunner.prepare_images), set by the server


@dataclass
class GenerateCall:
    inputs: list[GenerateInput]
    batched: bool  # answer with a list even for one prompt
    stream: bool = False


def _per_item(value: Any, n: int, name: str, batched: bool) -> list[Any]:
    if batched and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def _check_ids(ids: Any, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{where} is empty" if isinstance(ids, list) else f"{where} must be a list of token ids")
    for t in ids:
        if not _is_int(t):
            raise RequestError(f"{where} must hold integers, got {show(t)}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{where} has token id {show(t)}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_context(num_input: int, max_new: int | None, context_len: int) -> None:
    """SGLang's context-length rules (same wording), raised as :class:`RequestError`."""
    if num_input >= context_len:
        raise RequestError(
            f"The input ({num_input} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if max_new is not None and max_new + num_input >= context_len:
        total = max_new + num_input
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {total} tokens: {num_input} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."
        )


# The top-level /generate fields parse_generate reads (fields of SGLang's GenerateReqInput; others are
# ignored, as SGLang ignores keys it does not know). tests/test_engine_conformance.py checks them.
GENERATE_FIELDS = (
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "lora_path",
    "top_logprobs_num",
    "logprob_start_len",
    "stream",
    "rid",
    "sampling_params",
    "return_logprob",
    "return_text_in_logprobs",
)


def _has_images(raw: Any) -> bool:
    """SGLang's ``has_valid_data``: anything but null, or lists (nested) of nulls."""
    stack = [raw]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif value is not None:
            return True
    return False


def _image_items(raw: Any, n: int, batched: bool) -> list[list[tuple[Any, str]]]:
    """Per prompt, its ``image_data`` items with where each is, normalised as SGLang does
    (``GenerateReqInput._normalize_image_data``): a single request takes one item or a list of
    items; a batch takes one item for every prompt, a list of one item per prompt, or a list of lists.
    Null entries are no image (SGLang's ``has_valid_data``)."""
    if not _has_images(raw):
        return [[] for _ in range(n)]
    if not batched:
        items = list(enumerate(raw)) if isinstance(raw, list) else [(None, raw)]
        return [[(item, "image_data" if j is None else f"image_data[{j}]") for j, item in items if item is not None]]
    if not isinstance(raw, list):
        return [[(raw, "image_data")] for _ in range(n)]
    if len(raw) != n:  # SGLang's message, with the counts
        raise RequestError(
            f"image_data: The length of image_data should be equal to the batch size ({len(raw)} entries "
            f"for a batch of {n} prompts)."
        )
    if not isinstance(raw[0], list):
        return [[] if item is None else [(item, f"image_data[{i}]")] for i, item in enumerate(raw)]
    out = []
    for i, per in enumerate(raw):
        if per is not None and not isinstance(per, list):
            raise RequestError(
                f"image_data[{i}] must be a list of images (image_data[0] is a list), got {type(per).__name__}"
            )
        out.append([(item, f"image_data[{i}][{j}]") for j, item in enumerate(per or []) if item is not None])
    return out


def _load_images(
    prompt: list[int], items: list[tuple[Any, str]], vision: Any, where: str, field_name: str
) -> tuple[list[int], list[bytes]]:
    """The prompt with each image's pad run expanded, and the images as PNG bytes; RequestError names the field."""
    from agentrl.images import MAX_IMAGE_BYTES, ImageError, load_image_data_item

    runs = len(vision.image_spans(prompt))
    if runs != len(items):  # checked before decoding: a request cannot make the server decode more images
        raise RequestError(
            f"{field_name}: {len(items)} image(s) for the {runs} image placeholder run(s) of {where} (each image "
            "needs one run of <|image_pad|> tokens between <|vision_start|> and <|vision_end|>)"
        )
    longest = MAX_IMAGE_BYTES * 4 // 3 + 64  # MAX_IMAGE_BYTES as a base64 data URL
    pngs = []
    for item, at in items:
        if isinstance(item, str) and len(item) > longest:
            raise RequestError(f"{at}: {len(item)} characters, more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES} in base64")
        try:
            pngs.append(load_image_data_item(item, at))
        except ImageError as e:
            raise RequestError(str(e)) from None
    try:
        return vision.expand(prompt, pngs), pngs
    except ImageError as e:
        raise RequestError(f"{field_name}: {e} (in {where})") from None


def parse_generate(body: Any, *, vocab_size: int, context_len: int, encode=None, vision: Any = None) -> GenerateCall:
    """Validate a ``/generate`` body. ``encode(text) -> ids`` serves the ``text`` field; ``vision`` (the
    model's ``agentrl.images.VisionProcessor``, None for a text model) serves ``image_data``: each prompt's
    image pad runs are expanded to the images' token counts, and the images kept as PNG bytes."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("Either text or input_ids should be provided (exactly one of them).")
    for key in ("input_embeds", "audio_data", "video_data"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported by the embedded engine")
    raw_images = body.get("image_data")
    if _has_images(raw_images):
        if has_text:
            raise RequestError(
                "image_data needs input_ids: the embedded engine does not expand images in text prompts "
                "(render the prompt with <|vision_start|><|image_pad|><|vision_end|> per image and send its ids)"
            )
        if vision is None:
            raise RequestError(
                "image_data: the model this engine serves is a text model and takes no images (SGLang ignores "
                "image_data for a text model; the embedded engine refuses it)"
            )
    if has_text:
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a list of strings")
        if encode is None:
            raise RequestError("text input needs a tokenizer; send input_ids")
        prompts, batched = [encode(t) for t in texts], isinstance(text, list)
    else:
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    n = len(prompts)
    field_name = "text" if has_text else "input_ids"
    if n == 0:
        raise RequestError(f"{field_name} is empty")
    where = lambda i: f"{field_name}[{i}]" if batched else field_name  # noqa: E731
    prompts = [_check_ids(p, vocab_size, where(i)) for i, p in enumerate(prompts)]
    images: list[list[bytes]] = [[] for _ in prompts]
    for i, items in enumerate(_image_items(raw_images, n, batched) if vision is not None else []):
        if items:
            image_field = f"image_data[{i}]" if batched else "image_data"
            prompts[i], images[i] = _load_images(prompts[i], items, vision, where(i), image_field)

    if body.get("top_logprobs_num") not in (None, 0):
        raise RequestError("top_logprobs_num > 0 is not supported by the embedded engine")
    if body.get("logprob_start_len") not in (None, -1):
        raise RequestError("logprob_start_len >= 0 (input logprobs) is not supported by the embedded engine")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {show(stream)}")

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if batched else [rid]
    elif isinstance(rid, list) and batched and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise RequestError("rid must be a string, or a list of strings with one per prompt")
    repeated = sorted({r for r in rids if rids.count(r) > 1})
    if repeated:  # SGLang's message (io_struct.py), with the field named
        raise RequestError(f"rid: Duplicate request IDs detected within the request: {repeated}")

    lora = body.get("lora_path")
    if batched and isinstance(lora, list) and len(lora) != n:  # SGLang's check and message
        raise RequestError(f"lora_path list length ({len(lora)}) must match batch size ({n})")
    lora_paths = _per_item(lora, n, "lora_path", batched)
    if not all(p is None or isinstance(p, str) for p in lora_paths):
        raise RequestError(f"lora_path must be a string, null, or in a batch a list of them, got {show(lora)}")
    raw_params = _per_item(body.get("sampling_params"), n, "sampling_params", batched)
    logprob = _per_item(body.get("return_logprob", False), n, "return_logprob", batched)
    text_lp = body.get("return_text_in_logprobs", False)
    if not all(isinstance(x, bool) for x in logprob) or not isinstance(text_lp, bool):
        raise RequestError("return_logprob and return_text_in_logprobs must be true or false")
    inputs = []
    for i in range(n):
        params = parse_sampling_params(raw_params[i], vocab_size)
        max_new = params.max_new_tokens
        check_context(len(prompts[i]), max_new, context_len)
        inputs.append(GenerateInput(rids[i], prompts[i], params, logprob[i], text_lp, lora_paths[i] or None, images[i]))
    return GenerateCall(inputs=inputs, batched=batched, stream=stream)


# ------------------------------------------------------------------------- finish reasons


def finish_stop_token(token_id: int) -> dict:
    return {"type": "stop", "matched": token_id}


def finish_stop_str(stop: str) -> dict:
    return {"type": "stop", "matched": stop}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}


def error_body(message: str) -> dict:
    """SGLang's error shape for /generate and control endpoints."""
    return {"error": {"message": message}}


@dataclass
class Completion:
    """What the scheduler knows about a request when it reports it (finished or streamed)."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict | None
    weight_version: str
    weight_versions: list[dict] = field(default_factory=list)
    e2e_latency: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


def output_text_ids(c: Completion, params: SamplingParams) -> list[int]:
    """Token ids that make up ``text``: the matched stop token is trimmed unless no_stop_trim."""
    fr = c.finish_reason or {}
    if not params.no_stop_trim and fr.get("type") == "stop" and isinstance(fr.get("matched"), int) and c.output_ids:
        return c.output_ids[:-1]
    return c.output_ids


def trim_stop_str(text: str, c: Completion, params: SamplingParams) -> str:
    fr = c.finish_reason or {}
    matched = fr.get("matched")
    if not params.no_stop_trim and fr.get("type") == "stop" and isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


def build_response(c: Completion, inp: GenerateInput, text: str, token_texts: list[str] | None = None) -> dict:
    """The JSON object SGLang returns for one prompt."""
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.cached_tokens,
        "weight_version": c.weight_version,
        "weight_versions": c.weight_versions,
        "e2e_latency": c.e2e_latency,
    }
    if inp.return_logprob:
        texts = token_texts if token_texts is not None else [None] * len(c.output_ids)
        meta["output_token_logprobs"] = [[lp, tok, txt] for lp, tok, txt in zip(c.output_logprobs, c.output_ids, texts)]
    return {"text": text, "output_ids": list(c.output_ids), "meta_info": meta}
